#!/usr/bin/env bash
# End-to-end check of a cluster coordinated through PostgreSQL (docs/cluster.md,
# "Leases, placement and drain"): three `cubicle node --database …` processes, each in a
# network namespace of its own (10.79.0.11-13, veths to a bridge 10.79.0.1 in the suite's
# private namespace), two API replicas (`cubicle serve --database … --node-token-file …`,
# no --node), a private PostgreSQL (scripts/pg-test-cluster.sh), and one single-host
# `cubicle serve` for the create-latency comparison. db_failover.py drives it with the
# official Python SDK: creates spread over the nodes through both replicas, a sandbox made
# through one replica used through the other; then node 1 is SIGKILLed and node 2 cut off
# (its link down in its namespace): both are declared lost within 10 s, their sandboxes
# reported ended (event reason node_lost), creates land on node 3; node 2's link comes back:
# it was fenced, registers under a new epoch and no longer serves its old sandboxes;
# node 3 is drained: its sandboxes paused, new creates elsewhere; node 3 and replica 2 are
# restarted and adopt / serve what exists. Nothing is left behind.
#
#   tests/e2e/cluster/run_db.sh
#
# Environment (optional): CUBICLE_BIN, CUBICLE_ENVD_BIN, CUBICLE_E2E_STATE_DIR (prefix of
# the state dirs, default /var/lib/cubicle-e2e-cluster-db: -n1..-n3, -r1, -r2, -single),
# CUBICLE_E2E_FIRST_SLOT (default 22000; this suite uses 1000 slots from there).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
SELF="$ROOT/tests/e2e/cluster/run_db.sh"
BIN=${CUBICLE_BIN:-$ROOT/target/debug/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd}
STATE=${CUBICLE_E2E_STATE_DIR:-/var/lib/cubicle-e2e-cluster-db}
SLOT=${CUBICLE_E2E_FIRST_SLOT:-22000}
PY="$ROOT/tests/e2e/.venv/bin/python"

if [[ "${CUBICLE_CLUSTER_DB_E2E_INNER:-}" != "1" ]]; then
  export CUBICLE_CLUSTER_DB_E2E_INNER=1
  for s in n1 n2 n3 single; do
    [[ -f "$STATE-$s/templates/tiny/template.json" ]] || "$BIN" template build tiny --state-dir "$STATE-$s" >/dev/null || exit 1
  done
  exec unshare --net -- "$SELF" "$@"
fi
T_START=$(date +%s.%N)
ip link set lo up

WORK=$(mktemp -d /tmp/cubicle-cluster-db-e2e.XXXXXX)
# The cluster's set-up (network, PostgreSQL, nodes, replicas, cleanup): shared with
# serve_suite.sh.
# shellcheck source=tests/e2e/cluster/db_cluster.sh
. "$ROOT/tests/e2e/cluster/db_cluster.sh"
SINGLE_PID=

cleanup() {
  dbc_cleanup
  [[ -n $SINGLE_PID ]] && dbc_stop "$SINGLE_PID"
  SINGLE_PID=
  for id in $("$BIN" local list --state-dir "$STATE-single" --first-slot $((SLOT + 800)) --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
    "$BIN" local kill "$id" --state-dir "$STATE-single" --first-slot $((SLOT + 800)) --any-free-slots >/dev/null 2>&1
  done
}
trap 'cleanup; dbc_release_mounts "$STATE-single"; rm -rf "$WORK"' EXIT

dbc_network || exit 1
dbc_start_postgres || exit 1
export CUBICLE_E2E_DB=$DB
dbc_start_nodes || exit 1
dbc_start_replica 1
dbc_start_replica 2
"$BIN" --log-format json serve --state-dir "$STATE-single" --listen 127.0.0.1:0 --first-slot $((SLOT + 800)) --max-sandboxes 100 \
  --any-free-slots --pool tiny=1 --no-build-templates --no-reap-foreign --dns-upstream 203.0.113.53 \
  >"$WORK/single.out" 2>"$WORK/single.log" &
SINGLE_PID=$!
for r in r1 r2 single; do dbc_wait_line "$WORK/$r.out" "cubicle: ready" 60 || exit 1; done
export CUBICLE_R1_API=$(dbc_env_of r1 E2B_API_URL) CUBICLE_R1_SANDBOX=$(dbc_env_of r1 E2B_SANDBOX_URL)
export CUBICLE_R2_API=$(dbc_env_of r2 E2B_API_URL) CUBICLE_R2_SANDBOX=$(dbc_env_of r2 E2B_SANDBOX_URL)
export CUBICLE_SINGLE_API=$(dbc_env_of single E2B_API_URL) CUBICLE_SINGLE_SANDBOX=$(dbc_env_of single E2B_SANDBOX_URL)
export E2B_API_KEY=$(dbc_env_of r1 E2B_API_KEY)
[[ -n $E2B_API_KEY ]] || E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE-r1" --database "$DB")
export CUBICLE_SINGLE_KEY=$(dbc_env_of single E2B_API_KEY)
[[ -n $CUBICLE_SINGLE_KEY ]] || CUBICLE_SINGLE_KEY=$("$BIN" apikey --state-dir "$STATE-single")
export CUBICLE_BIN=$BIN CUBICLE_NODE_TOKEN_FILE=$TOKEN CUBICLE_NS_PREFIX=$NS_PREFIX
export CUBICLE_N1_PID=${NODE_PID[1]} CUBICLE_N3_PID=${NODE_PID[3]} CUBICLE_E2E_WORK=$WORK
export CUBICLE_R2_PID=${REPLICA_PID[2]}
export CUBICLE_R2_CMD=$(dbc_cmd_json dbc_replica_cmd 2)
# db_failover.py restarts node 3 with this command line (and writes its new pid).
export CUBICLE_N3_CMD=$(dbc_cmd_json dbc_node_cmd 3)

"$PY" "$ROOT/tests/e2e/cluster/db_failover.py"
rc=$?
if [[ $rc -ne 0 || -n ${CUBICLE_E2E_KEEP_LOG:-} ]]; then
  for f in n1 n2 n3 r1 r2; do echo "--- $f log (tail)"; tail -25 "$WORK/$f.log"; done
fi
echo "--- placements and creates (replica and single-host logs)"
"$PY" - "$WORK" <<'PYEOF'
import json, statistics, sys
work = sys.argv[1]
def lines(name):
    for l in open(f"{work}/{name}.log", errors="replace"):
        try:
            yield json.loads(l)
        except ValueError:
            pass
for name in ("r1", "r2"):
    for e in lines(name):
        if e.get("message", "").startswith(("placed on", "node lost")):
            print(f"{name}: {e['message'][:170]}")
            break
def med(xs):
    return f"{statistics.median(xs):.1f} ms (n={len(xs)})" if xs else "-"
for name in ("r1", "single"):
    posts = [float(e["duration_ms"]) for e in lines(name)
             if e.get("route") == "/v2/sandboxes" and e.get("method") == "POST" and e.get("status") == 201]
    print(f"{name}: POST /v2/sandboxes server time p50 {med(posts)}")
placed = [e for e in lines("r1") if e.get("message", "").startswith("placed on")]
print(f"r1: placement reserve p50 {med([float(e['reserve_ms']) for e in placed])}, "
      f"reserve + node create p50 {med([float(e['ms']) for e in placed])}, "
      f"commit p50 {med([float(e['commit_ms']) for e in placed if 'commit_ms' in e])}")
if placed and "phases" in placed[-1]:
    print(f"r1: phases of the last create (ms): {placed[-1]['phases']}")
for name in ("r1", "r2"):
    for e in lines(name):
        if e.get("message", "").startswith("node lost"):
            print(f"{name}: node lost: {e.get('node')} (lease expired {e.get('lease_expired_ms_ago')} ms before), {e.get('sandboxes')} sandboxes")
PYEOF
grep -h "fenced\|reconciled with the cluster" "$WORK/n2.log" | cut -c1-240 | tail -3
NODE_PID[1]=  # SIGKILLed by db_failover.py
# (node 3 and replica 2 were restarted by it: dbc_cleanup reads their pid files)
cleanup
trap - EXIT
left=$(dbc_leftovers "$STATE-single:$((SLOT + 800))")
if [[ -n $left ]]; then
  echo "cluster-db-e2e: left behind:" >&2
  echo "$left" | sed 's/^/  /' >&2
  rc=1
fi
dbc_release_mounts "$STATE-single"
rm -rf "$WORK"
"$PY" -c "import sys,time; print(f'cluster-db-e2e: suite took {time.time() - float(sys.argv[1]):.1f} s')" "$T_START"
exit $rc
