# shellcheck shell=bash
# moto's S3 server as the cluster's object store, for the e2e suites that need one
# (sourced by tests/e2e/cluster/moving.sh and lost_paused.sh): `moto_start HOST PORT
# BUCKET LOG` starts it on HOST:PORT (reachable from wherever HOST is: the caller's
# private namespace), creates bucket BUCKET and exports the AWS_* variables the nodes and
# `cubicle template push` read; MOTO_PID is its pid (the caller stops it). Needs ROOT.

MOTO="$ROOT/tests/e2e/.venv-s3/bin/moto_server"
MOTO_PID=

moto_start() { # host port bucket log
  [[ -x $MOTO ]] || { echo "e2e: no $MOTO (scripts/install-test-deps.sh makes it)" >&2; return 1; }
  "$MOTO" -H "$1" -p "$2" >"$4" 2>&1 &
  MOTO_PID=$!
  for _ in $(seq 1 300); do
    /usr/bin/python3 - "$1" "$2" "$3" <<'PY' 2>/dev/null && break
import sys, urllib.request
host, port, bucket = sys.argv[1:4]
urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/{bucket}", method="PUT"), timeout=2)
PY
    sleep 0.1
  done
  export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_DEFAULT_REGION=us-east-1
  export AWS_ENDPOINT_URL=http://$1:$2
}
