#!/usr/bin/env bash
# Install the end-to-end test dependencies: the official E2B SDKs.
#
#   tests/e2e/.venv              Python venv: e2b, e2b-code-interpreter, pytest,
#                                pytest-asyncio, playwright (the dashboard's browser tests,
#                                with Debian's chromium; no browser download) — pinned in
#                                tests/e2e/requirements.txt
#   tests/e2e/js/node_modules    e2b (JS) pinned in package.json / package-lock.json,
#                                installed with `npm ci`
#   tests/e2e/.venv-schemathesis schemathesis (tests/e2e/schemathesis-requirements.txt):
#                                fuzzes the server from its OpenAPI description
#   tests/e2e/.venv-s3           moto's S3-compatible server (tests/e2e/s3-requirements.txt)
#                                for the object-store tests (crates/node/tests/moving.rs)
#   tests/e2e/.venv-deploy       kubernetes-validate (tests/e2e/deploy-requirements.txt):
#                                scripts/check-deploy.py checks deploy/ offline
#
# Idempotent: each part is skipped when a stamp shows it was installed from the
# same pin file and the SDK reports the expected version.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
E2E="$ROOT/tests/e2e"
VENV="$E2E/.venv"
REQ="$E2E/requirements.txt"
JS="$E2E/js"
PY_E2B=2.63.0
JS_E2B=2.51.0

# The venv is built from Debian's python3, not a pyenv shim under $HOME: the e2e
# launcher mounts a tmpfs over /root, and the venv must still work there.
PYTHON=${CUBICLE_E2E_PYTHON:-/usr/bin/python3}

hash_of() { sha256sum "$@" | sha256sum | cut -d' ' -f1; }

# --- Python ---------------------------------------------------------------
py_stamp="$VENV/.cubicle-deps"
py_want="$(hash_of "$REQ")"
if [[ -x "$VENV/bin/python" && -f "$py_stamp" && "$(cat "$py_stamp")" == "$py_want" ]] &&
   "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('e2b') != '$PY_E2B')" 2>/dev/null; then
  echo "install-test-deps: python venv up to date (e2b $PY_E2B)"
else
  echo "install-test-deps: creating $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --disable-pip-version-check -q -r "$REQ"
  echo "$py_want" >"$py_stamp"
  echo "install-test-deps: installed $("$VENV/bin/python" -c "import importlib.metadata as m; print('e2b', m.version('e2b'))")"
fi

# --- schemathesis (its own venv) ---------------------------------------------
ST_VENV="$E2E/.venv-schemathesis"
ST_REQ="$E2E/schemathesis-requirements.txt"
st_stamp="$ST_VENV/.cubicle-deps"
st_want="$(hash_of "$ST_REQ")"
if [[ -x "$ST_VENV/bin/schemathesis" && -f "$st_stamp" && "$(cat "$st_stamp")" == "$st_want" ]]; then
  echo "install-test-deps: schemathesis venv up to date"
else
  echo "install-test-deps: creating $ST_VENV"
  rm -rf "$ST_VENV"
  "$PYTHON" -m venv "$ST_VENV"
  "$ST_VENV/bin/pip" install --disable-pip-version-check -q -r "$ST_REQ"
  echo "$st_want" >"$st_stamp"
  echo "install-test-deps: installed $("$ST_VENV/bin/schemathesis" --version 2>/dev/null | head -n1)"
fi

# --- S3-compatible test server (its own venv) -------------------------------------
S3_VENV="$E2E/.venv-s3"
S3_REQ="$E2E/s3-requirements.txt"
s3_stamp="$S3_VENV/.cubicle-deps"
s3_want="$(hash_of "$S3_REQ")"
if [[ -x "$S3_VENV/bin/moto_server" && -f "$s3_stamp" && "$(cat "$s3_stamp")" == "$s3_want" ]]; then
  echo "install-test-deps: s3 test server venv up to date"
else
  echo "install-test-deps: creating $S3_VENV"
  rm -rf "$S3_VENV"
  "$PYTHON" -m venv "$S3_VENV"
  "$S3_VENV/bin/pip" install --disable-pip-version-check -q -r "$S3_REQ"
  echo "$s3_want" >"$s3_stamp"
  echo "install-test-deps: installed moto $("$S3_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('moto'))")"
fi

# --- Kubernetes schema validation (its own venv) ------------------------------------
DP_VENV="$E2E/.venv-deploy"
DP_REQ="$E2E/deploy-requirements.txt"
dp_stamp="$DP_VENV/.cubicle-deps"
dp_want="$(hash_of "$DP_REQ")"
if [[ -x "$DP_VENV/bin/python" && -f "$dp_stamp" && "$(cat "$dp_stamp")" == "$dp_want" ]]; then
  echo "install-test-deps: deploy check venv up to date"
else
  echo "install-test-deps: creating $DP_VENV"
  rm -rf "$DP_VENV"
  "$PYTHON" -m venv "$DP_VENV"
  "$DP_VENV/bin/pip" install --disable-pip-version-check -q -r "$DP_REQ"
  echo "$dp_want" >"$dp_stamp"
  echo "install-test-deps: installed kubernetes-validate $("$DP_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('kubernetes-validate'))")"
fi

# --- JavaScript -----------------------------------------------------------
js_stamp="$JS/node_modules/.cubicle-deps"
js_want="$(hash_of "$JS/package.json" "$JS/package-lock.json")"
js_have_version() { node -p "require('$JS/node_modules/e2b/package.json').version" 2>/dev/null || true; }
if [[ -f "$js_stamp" && "$(cat "$js_stamp")" == "$js_want" && "$(js_have_version)" == "$JS_E2B" ]]; then
  echo "install-test-deps: node_modules up to date (e2b $JS_E2B)"
else
  echo "install-test-deps: npm ci in $JS"
  (cd "$JS" && npm ci --no-audit --no-fund --loglevel=error)
  echo "$js_want" >"$js_stamp"
  echo "install-test-deps: installed e2b $(js_have_version) (js)"
fi
