#!/usr/bin/env bash
# Cubicle's test command (README: `sudo scripts/test.sh`; `.ci/run` calls it).
#
#   1. install system packages (scripts/install-deps.sh) and the e2e test
#      dependencies: Python venv with the official e2b SDK, npm e2b SDK
#      (scripts/install-test-deps.sh) — both skip work when already installed;
#   2. the checks that keep the code clean, early and fast: `cargo fmt --all -- --check`
#      and `cargo clippy --workspace --all-targets -- -D warnings` (the workspace lints:
#      Cargo.toml, clippy.toml); either failing fails the run;
#   3. build the workspace;
#   4. `cargo test --workspace` (as root: tests that need root run; the store's tests
#      on SQLite and on a private PostgreSQL cluster each, PostgreSQL required), then
#      the escape suite once more with its sandboxes made from shells;
#   5. the envd end-to-end suites with the real SDKs, each inside its own network +
#      mount namespace next to a development-mode cubicle-envd
#      (tests/e2e/envd-host.sh): pytest (sync + async Python SDK), then node --test
#      (JS SDK);
#   6. the `cubicle serve` end-to-end suite (tests/e2e/serve/run.sh): the static envd is
#      built (scripts/build-envd.sh), `cubicle serve` starts in a private network
#      namespace with state dir /var/lib/cubicle-e2e (templates built once per machine),
#      the Python (sync + async) and JS SDKs run against it with only E2B_API_URL,
#      E2B_SANDBOX_URL, E2B_API_KEY set, then the server is stopped and the host checked
#      for leftovers; alongside it (with the cluster suites wanted), a subset of the same
#      Python tests through an API replica of a cluster coordinated through PostgreSQL
#      (tests/e2e/cluster/serve_suite.sh: two nodes, two replicas);
#   7. the cluster roles check (tests/e2e/cluster/run.sh): one `cubicle node` and one API
#      replica (`cubicle serve --node`) in a private network namespace, the Python SDK's
#      core paths through the replica, then the node killed (E2B-shaped errors); then
#      the same over mutual TLS between replica and node (CUBICLE_E2E_CLUSTER_TLS=1);
#      tests/e2e/cluster/run_db.sh: three nodes in network namespaces of their own and
#      two replicas over a private PostgreSQL (placement, lost nodes, fencing, drain);
#      alongside them, tests/e2e/cluster/moving.sh: two nodes sharing moto as their
#      object store, a paused sandbox resumed on the other node (node SIGKILLed, drained);
#      tests/e2e/cluster/lost_paused.sh: the same over PostgreSQL once the node's lease
#      ran out (the sandbox outlives its lost node);
#      and tests/e2e/cluster/replica_state.sh: a template built through a replica over
#      PostgreSQL used on both nodes and deleted everywhere, a volume pinned to its node;
#   8. the deployment recipes (scripts/check-deploy.py): deploy/kubernetes validated
#      against Kubernetes' OpenAPI schemas, flags checked against the CLI, deploy/systemd
#      units through systemd-analyze verify;
#   9. the bench's smoke run (tests/e2e/bench_smoke.sh): three samples of every row of
#      `cubicle bench create cycle exec density peer`, both pool modes, each row checked
#      for samples and no errors (a bench that no longer runs; not a measurement).
# Every suite runs even if an earlier one failed; the exit status is non-zero if
# any step failed. Each runner prints its own summary; a recap follows at the end.
#
# Environment knobs (all optional):
#   CUBICLE_TEST_SUITES   space-separated subset of "lint cargo python js serve cluster deploy bench"
#                         (default: all)
#   CUBICLE_PYTEST_ARGS   extra pytest arguments (e.g. "-k files -x")
#   CUBICLE_E2E_TIMEOUT   per-e2e-suite time limit in seconds (default 1200)
#   CUBICLE_TEST_MIN_FREE_GB  free space required before starting (default 6)
#   CUBICLE_SERVE_E2E_TIMEOUT  time limit of the whole serve suite (default 5400: the first
#                         run on a machine builds the `base` template)
#   CLUSTER_SERVE_MODULES the serve suite's test files the cluster serve suite runs
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

# Hermetic runs: do not pass descriptors this script inherited (beyond stdio) on to
# builds, tests and the services they start.
for fd in /proc/$$/fd/*; do
  fd=${fd##*/}
  if ((fd > 2 && fd != 255)); then eval "exec $fd>&-" 2>/dev/null || true; fi
done
SUITES=${CUBICLE_TEST_SUITES:-lint cargo python js serve cluster deploy bench}
E2E_TIMEOUT=${CUBICLE_E2E_TIMEOUT:-1200}
# The serve suite's modules that also run through a cluster's API replica (alongside the
# serve suite, when both `serve` and `cluster` are wanted): lifecycle, commands, files,
# pty, watch (dataplane, fidelity), async, code interpreter, stateful (pause, resume,
# snapshots, forks), teams, secrets, bad input, raw REST, operations, host isolation,
# templates (builds from registries through the replica), volumes, and
# the leak check. CLUSTER_SERVE_MODULES overrides (e.g. "tests/e2e/serve/python" for all).
CLUSTER_SERVE_DEFAULT=$(printf 'tests/e2e/serve/python/test_%s.py ' lifecycle dataplane fidelity async \
  code_interpreter stateful teams secrets bad_input rest_raw operations host_isolation templates volumes \
  zz_leaks)

if [[ $(id -u) -ne 0 ]]; then
  echo "scripts/test.sh must run as root (namespaces, setuid test users): sudo scripts/test.sh" >&2
  exit 1
fi

# A full run needs room: the workspace build (several GB of target/), the templates under
# /var/lib/cubicle-e2e (~3 GB on first use) and the sandboxes' quota images. Running out
# midway fails tests far from the cause, so say it first.
need_gb=${CUBICLE_TEST_MIN_FREE_GB:-6}
for d in "$ROOT" /var/lib; do
  free_gb=$(($(df --output=avail -k "$d" | tail -1) / 1048576))
  if ((free_gb < need_gb)); then
    echo "scripts/test.sh: only ${free_gb} GB free on the filesystem of $d; a full run needs at least ${need_gb} GB (free some, e.g. target/debug/incremental, or set CUBICLE_TEST_MIN_FREE_GB)" >&2
    exit 1
  fi
done

# rustup installs cargo under the invoking user's home; keep it reachable under sudo.
if ! command -v cargo >/dev/null 2>&1; then
  for d in "${SUDO_USER:+$(getent passwd "$SUDO_USER" | cut -d: -f6)/.cargo/bin}" /root/.cargo/bin; do
    [[ -n "$d" && -x "$d/cargo" ]] && PATH="$d:$PATH" && break
  done
fi

results=()
failed=0
banner() { printf '\n==== %s ====\n' "$*"; }
record() { # name rc
  if [[ $2 -eq 0 ]]; then results+=("PASS  $1"); else results+=("FAIL  $1 (exit $2)"); failed=1; fi
}
wants() { [[ " $SUITES " == *" $1 "* ]]; }
t_start=$(date +%s)

banner "dependencies"
bash scripts/install-deps.sh
record "install-deps" $?
# (cargo: the object-store tests start moto's S3 server from tests/e2e/.venv-s3.)
if wants python || wants js || wants serve || wants cluster || wants cargo || wants deploy; then
  bash scripts/install-test-deps.sh
  record "install-test-deps" $?
fi

if wants lint; then
  banner "lint (cargo fmt --check, cargo clippy -D warnings)"
  cargo fmt --all -- --check
  record "cargo fmt --all -- --check" $?
  cargo clippy --workspace --all-targets -- -D warnings
  record "cargo clippy --workspace --all-targets -- -D warnings" $?
fi

banner "build (cargo build --workspace)"
build_json=$(mktemp /tmp/cubicle-build.XXXXXX)
cargo build --workspace --message-format=json-render-diagnostics >"$build_json"
build_rc=$?
record "cargo build --workspace" $build_rc
ENVD_BIN=$(/usr/bin/python3 - "$build_json" <<'PY'
import json, sys
exe = ""
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cubicle-envd" \
            and m.get("executable"):
        exe = m["executable"]
print(exe)
PY
)
rm -f "$build_json"
echo "cubicle-envd: ${ENVD_BIN:-<not built>}"

if wants cargo; then
  # The tests that start sandboxes use the static envd (target/x86_64-unknown-linux-gnu/
  # debug/cubicle-envd) and build it only when it is missing: build it now, so that a
  # stale one from an older checkout is never what they run.
  banner "static envd (scripts/build-envd.sh)"
  bash scripts/build-envd.sh
  record "static envd build" $?
  banner "cargo test --workspace --no-fail-fast"
  # The node lifecycle test's create/destroy cycles: 500 as issue 6 asks (~15 s).
  # The store's tests run on SQLite and on a private PostgreSQL cluster they start
  # (scripts/pg-test-cluster.sh): here PostgreSQL is required, never skipped.
  CUBICLE_REQUIRE_POSTGRES=1 \
    CUBICLE_TEST_CYCLES=${CUBICLE_TEST_CYCLES:-500} cargo test --workspace --no-fail-fast
  record "cargo test --workspace" $?
  # The escape suite again, every attack in a sandbox that was a shell (made ahead of its
  # template, then given the base root under its running envd: docs/node.md, "Shells").
  banner "escape suite on shells (CUBICLE_ESCAPE_SHELLS=4)"
  CUBICLE_ESCAPE_SHELLS=4 cargo test -p cubicle-node --test escape
  record "escape suite on shells" $?
fi

run_e2e() { # name, command...
  local name=$1; shift
  banner "$name"
  if [[ $build_rc -ne 0 || -z "$ENVD_BIN" ]]; then
    echo "skipped: cubicle-envd was not built"
    record "$name" 1
    return
  fi
  CUBICLE_ENVD_BIN="$ENVD_BIN" timeout --kill-after=30 "$E2E_TIMEOUT" \
    tests/e2e/envd-host.sh "$@"
  record "$name" $?
}

if wants python; then
  # shellcheck disable=SC2086
  run_e2e "e2e python (e2b $(tests/e2e/.venv/bin/python -c 'import importlib.metadata as m; print(m.version("e2b"))' 2>/dev/null), sync+async)" \
    "$ROOT/tests/e2e/.venv/bin/python" -m pytest -c "$ROOT/tests/e2e/pytest.ini" \
    --rootdir "$ROOT/tests/e2e" -v "$ROOT/tests/e2e/python" ${CUBICLE_PYTEST_ARGS:-}
fi

if wants js; then
  run_e2e "e2e js (e2b@2.51.0, node $(node --version))" \
    bash -c 'cd "$1/tests/e2e/js" && exec node --test --test-concurrency=1 --test-timeout=120000 --test-reporter=spec envd/*.test.mjs' _ "$ROOT"
fi

if wants serve; then
  banner "e2e serve (cubicle serve + e2b python sync/async + js)"
  if [[ $build_rc -ne 0 ]]; then
    echo "skipped: the workspace did not build"
    record "e2e serve" 1
  elif ! bash scripts/build-envd.sh; then
    record "e2e serve (static envd build)" 1
  else
    cluster_serve_pid=
    if wants cluster; then
      # The serve suite's templates first (what run.sh's first stage does, once per
      # machine), so that the cluster serve suite can copy them and run alongside.
      for t in tiny base code-interpreter-v1; do
        CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
          target/debug/cubicle template build "$t" --state-dir /var/lib/cubicle-e2e >/dev/null \
          || echo "building template $t failed; the serve suites' tests that use it will fail" >&2
      done
      # The serve suite's official-SDK tests through the API replicas of a cluster (two
      # nodes, two replicas, PostgreSQL), split as behind a load balancer: the control
      # plane through one replica, the data plane (E2B_SANDBOX_URL) through the other.
      # A named subset of the python modules (CLUSTER_SERVE_MODULES), then the JS suite;
      # its own state dirs (/var/lib/cubicle-e2e-cluster-serve-*), slots 24000+ and
      # network namespace; its output is printed after the serve suite's.
      cluster_serve_log=$(mktemp /tmp/cubicle-cluster-serve-e2e.XXXXXX)
      CUBICLE_E2E_SPLIT_REPLICAS=1 CUBICLE_BIN="$ROOT/target/debug/cubicle" \
        CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
        timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/serve_suite.sh all \
        ${CLUSTER_SERVE_MODULES:-$CLUSTER_SERVE_DEFAULT} >"$cluster_serve_log" 2>&1 &
      cluster_serve_pid=$!
    fi
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      timeout --kill-after=90 "${CUBICLE_SERVE_E2E_TIMEOUT:-5400}" tests/e2e/serve/run.sh
    record "e2e serve" $?
    if [[ -n $cluster_serve_pid ]]; then
      wait "$cluster_serve_pid"
      cluster_serve_rc=$?
      banner "e2e cluster serve (the serve suite's python and JS tests through two API replicas)"
      cat "$cluster_serve_log"
      rm -f "$cluster_serve_log"
      record "e2e cluster serve (python + js, split over two replicas)" $cluster_serve_rc
    fi
  fi
fi

if wants cluster; then
  banner "e2e cluster (cubicle node + an API replica, e2b python)"
  if [[ $build_rc -ne 0 ]]; then
    echo "skipped: the workspace did not build"
    record "e2e cluster" 1
  elif ! bash scripts/build-envd.sh; then
    record "e2e cluster (static envd build)" 1
  else
    # The serve suite's state dir (its templates are built there; the serve suite's
    # server has stopped by now) on its own slots (21000+, serve's are 20000+).
    # Moving paused sandboxes between nodes (two nodes, moto as S3) runs alongside, on
    # its own state dirs (/var/lib/cubicle-e2e-moving-*) and slots (23000+).
    moving_log=$(mktemp /tmp/cubicle-moving-e2e.XXXXXX)
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      CUBICLE_E2E_STATE_DIR=/var/lib/cubicle-e2e \
      timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/moving.sh >"$moving_log" 2>&1 &
    moving_pid=$!
    # Templates and volumes through a replica coordinated by PostgreSQL (two nodes, a
    # file:// object store), alongside as well: /var/lib/cubicle-e2e-tpl-*, slots 24000+.
    state_log=$(mktemp /tmp/cubicle-replica-state-e2e.XXXXXX)
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      CUBICLE_E2E_STATE_DIR=/var/lib/cubicle-e2e \
      timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/replica_state.sh >"$state_log" 2>&1 &
    state_pid=$!
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      CUBICLE_E2E_STATE_DIR=/var/lib/cubicle-e2e \
      timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/run.sh
    record "e2e cluster" $?
    # The same over mutual TLS between replica and node (docs/cluster.md, "Deploying").
    CUBICLE_E2E_CLUSTER_TLS=1 CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      CUBICLE_E2E_STATE_DIR=/var/lib/cubicle-e2e \
      timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/run.sh
    record "e2e cluster over mutual TLS" $?
    # Three nodes and two replicas coordinated through PostgreSQL (leases, placement,
    # lost nodes, fencing, drain), `tiny` sandboxes, slots 22200+.
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/run_db.sh
    record "e2e cluster (database)" $?
    # A paused sandbox outlives its node: two nodes over PostgreSQL sharing moto, the
    # node SIGKILLed, connect resumes the sandbox on the other one; `base` from the
    # serve suite's state dir, /var/lib/cubicle-e2e-lost-paused-*, slots 27200+.
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      CUBICLE_E2E_TEMPLATES_FROM=/var/lib/cubicle-e2e \
      timeout --kill-after=30 "$E2E_TIMEOUT" tests/e2e/cluster/lost_paused.sh
    record "e2e cluster (paused sandboxes outlive their node)" $?
    wait "$moving_pid"
    moving_rc=$?
    banner "e2e cluster: moving sandboxes between nodes (two nodes, moto, e2b python)"
    cat "$moving_log"
    rm -f "$moving_log"
    record "e2e cluster moving" $moving_rc
    wait "$state_pid"
    state_rc=$?
    banner "e2e cluster: templates and volumes through a replica (two nodes, PostgreSQL, e2b python)"
    cat "$state_log"
    rm -f "$state_log"
    record "e2e cluster templates and volumes" $state_rc
  fi
fi

if wants deploy; then
  banner "deploy (Kubernetes manifests and systemd units, checked offline)"
  if [[ $build_rc -ne 0 ]]; then
    echo "skipped: the workspace did not build"
    record "deploy check" 1
  else
    tests/e2e/.venv-deploy/bin/python scripts/check-deploy.py --cubicle "$ROOT/target/debug/cubicle"
    record "deploy check (scripts/check-deploy.py)" $?
  fi
fi

if wants bench; then
  banner "bench smoke (cubicle bench, three samples a row)"
  if [[ $build_rc -ne 0 ]] || ! bash scripts/build-envd.sh; then
    echo "skipped: the workspace or the static envd did not build"
    record "bench smoke" 1
  else
    CUBICLE_BIN="$ROOT/target/debug/cubicle" \
      CUBICLE_ENVD_BIN="$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd" \
      timeout --kill-after=30 600 tests/e2e/bench_smoke.sh
    record "bench smoke (tests/e2e/bench_smoke.sh)" $?
  fi
fi

# Whatever the suites' own leak checks cover, no sandbox this run made may still have a
# cgroup on the host (a test that removes a node's state directory while a sandbox of
# it still runs would leave one running that no reconciliation can find). Only cgroups
# made since the run started count: a service running on the host keeps its own.
banner "nothing left on the host (sandbox cgroups made by this run)"
left=()
for d in /sys/fs/cgroup/pids/cubicle/i????????????????????/ /sys/fs/cgroup/cubicle/i????????????????????/; do
  [[ -d $d ]] || continue
  [[ $(stat -c %Y "$d") -ge $t_start ]] || continue
  left+=("$d (processes: $(tr '\n' ' ' <"$d/cgroup.procs" 2>/dev/null))")
done
if [[ ${#left[@]} -eq 0 ]]; then
  echo "none"
  record "nothing left on the host" 0
else
  printf '  left: %s\n' "${left[@]}"
  record "nothing left on the host (${#left[@]} sandbox cgroups)" 1
fi

banner "recap ($(( $(date +%s) - t_start ))s)"
printf '  %s\n' "${results[@]}"
exit $failed
