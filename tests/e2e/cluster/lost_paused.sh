#!/usr/bin/env bash
# End-to-end check that a paused sandbox outlives the loss of its node (docs/cluster.md,
# "Paused sandboxes outlive their node"): two `cubicle node --database … --object-store …`
# processes in network namespaces of their own and two API replicas over a private
# PostgreSQL (the set-up of tests/e2e/cluster/db_cluster.sh), moto's S3 server as the
# shared bucket (tests/e2e/cluster/moto.sh). lost_paused.py drives it with the official
# Python SDK: sandboxes paused on one node (through the API, and at their end time),
# that node SIGKILLed, its lease runs out, `Sandbox.connect` through the other replica
# resumes them on the other node with their files and processes; the node restarted
# never resumes them. Nothing is left behind.
#
#   tests/e2e/cluster/lost_paused.sh
#
# Environment (optional): CUBICLE_BIN, CUBICLE_ENVD_BIN, CUBICLE_E2E_STATE_DIR (prefix of
# the state dirs, default /var/lib/cubicle-e2e-lost-paused: -n1, -n2, -r1, -r2),
# CUBICLE_E2E_FIRST_SLOT (default 27000; this suite uses 500 slots from there),
# CUBICLE_E2E_TEMPLATES_FROM (a state dir whose `base` node 1 copies; default
# /var/lib/cubicle-e2e; without it `base` is built), CUBICLE_E2E_LOST_TEMPLATE (the
# sandboxes' template, default base: the SDK's commands need bash).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
SELF="$ROOT/tests/e2e/cluster/lost_paused.sh"
BIN=${CUBICLE_BIN:-$ROOT/target/debug/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd}
STATE=${CUBICLE_E2E_STATE_DIR:-/var/lib/cubicle-e2e-lost-paused}
SLOT=${CUBICLE_E2E_FIRST_SLOT:-27000}
export CUBICLE_E2E_LOST_TEMPLATE=${CUBICLE_E2E_LOST_TEMPLATE:-base}
TEMPLATES_FROM=${CUBICLE_E2E_TEMPLATES_FROM:-/var/lib/cubicle-e2e}
PY="$ROOT/tests/e2e/.venv/bin/python"

if [[ "${CUBICLE_CLUSTER_LOST_E2E_INNER:-}" != "1" ]]; then
  export CUBICLE_CLUSTER_LOST_E2E_INNER=1
  # shellcheck source=tests/e2e/cluster/templates.sh
  . "$ROOT/tests/e2e/cluster/templates.sh"
  seed_template "$TEMPLATES_FROM" "$STATE-n1" "$CUBICLE_E2E_LOST_TEMPLATE" || exit 1
  LINK=1 seed_template "$STATE-n1" "$STATE-n2" "$CUBICLE_E2E_LOST_TEMPLATE" || exit 1
  exec unshare --net -- "$SELF" "$@"
fi
T_START=$(date +%s.%N)
ip link set lo up

WORK=$(mktemp -d /tmp/cubicle-lost-paused-e2e.XXXXXX)
DBC_NODES=2
# shellcheck source=tests/e2e/cluster/db_cluster.sh
. "$ROOT/tests/e2e/cluster/db_cluster.sh"
# shellcheck source=tests/e2e/cluster/moto.sh
. "$ROOT/tests/e2e/cluster/moto.sh"

cleanup() {
  dbc_cleanup
  [[ -n $MOTO_PID ]] && dbc_stop "$MOTO_PID"
  MOTO_PID=
}
trap 'cleanup; dbc_release_mounts; rm -rf "$WORK"' EXIT

dbc_network || exit 1
# moto on the bridge: the nodes reach it from their namespaces.
moto_start 10.79.0.1 4566 cubicle-e2e "$WORK/moto.log" || exit 1
BUCKET=s3://cubicle-e2e/run-$$
# (db_cluster.sh gives every node `--object-store "$BUCKET"`.)
DBC_NODE_ARGS=(--pool "$CUBICLE_E2E_LOST_TEMPLATE=1")
# The template, published once (as a cluster does after a build), while the rest starts.
t_push=$(date +%s%N)
"$BIN" template push "$CUBICLE_E2E_LOST_TEMPLATE" --state-dir "$STATE-n1" --object-store "$BUCKET" >"$WORK/push.out" 2>&1 &
PUSH_PID=$!
dbc_start_postgres || exit 1
dbc_start_nodes || exit 1
if ! wait "$PUSH_PID"; then
  echo "lost-paused-e2e: publishing $CUBICLE_E2E_LOST_TEMPLATE failed:" >&2; cat "$WORK/push.out" >&2; exit 1
fi
echo "     $CUBICLE_E2E_LOST_TEMPLATE published to moto in $(( ($(date +%s%N) - t_push) / 1000000 )) ms (once per cluster)"
dbc_start_replica 1
dbc_start_replica 2
for r in r1 r2; do dbc_wait_line "$WORK/$r.out" "cubicle: ready" 60 || exit 1; done
export CUBICLE_R1_API=$(dbc_env_of r1 E2B_API_URL) CUBICLE_R1_SANDBOX=$(dbc_env_of r1 E2B_SANDBOX_URL)
export CUBICLE_R2_API=$(dbc_env_of r2 E2B_API_URL) CUBICLE_R2_SANDBOX=$(dbc_env_of r2 E2B_SANDBOX_URL)
export E2B_API_KEY=$(dbc_env_of r1 E2B_API_KEY)
[[ -n $E2B_API_KEY ]] || E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE-r1" --database "$DB")
export CUBICLE_BIN=$BIN CUBICLE_NODE_TOKEN_FILE=$TOKEN CUBICLE_E2E_DB=$DB CUBICLE_E2E_WORK=$WORK CUBICLE_E2E_STATE=$STATE
export CUBICLE_N1_PID=${NODE_PID[1]} CUBICLE_N2_PID=${NODE_PID[2]}
# lost_paused.py restarts the node it SIGKILLed with its command line (and writes its pid).
export CUBICLE_N1_CMD=$(dbc_cmd_json dbc_node_cmd 1) CUBICLE_N2_CMD=$(dbc_cmd_json dbc_node_cmd 2)

"$PY" "$ROOT/tests/e2e/cluster/lost_paused.py"
rc=$?
if [[ $rc -ne 0 || -n ${CUBICLE_E2E_KEEP_LOG:-} ]]; then
  for f in n1 n2 r1 r2; do echo "--- $f log (tail)"; tail -25 "$WORK/$f.log"; done
fi
grep -h "node lost\|lost node resumed\|resuming the paused sandbox of a lost node" "$WORK/r1.log" "$WORK/r2.log" | cut -c1-400
grep -h "sandbox taken over\|released: it moved" "$WORK/n1.log" "$WORK/n2.log" | cut -c1-300
# (the SIGKILLed node was restarted by lost_paused.py: dbc_cleanup reads its pid file)
cleanup
trap - EXIT
left=$(dbc_leftovers)
if [[ -n $left ]]; then
  echo "lost-paused-e2e: left behind:" >&2
  echo "$left" | sed 's/^/  /' >&2
  rc=1
fi
dbc_release_mounts
rm -rf "$WORK"
"$PY" -c "import sys,time; print(f'lost-paused-e2e: suite took {time.time() - float(sys.argv[1]):.1f} s')" "$T_START"
exit $rc
