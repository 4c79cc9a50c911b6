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
TOKEN="$WORK/node-token"
head -c 32 /dev/urandom | base64 > "$TOKEN"
chmod 600 "$TOKEN"
NS_PREFIX="cubicle-e2e-$$"
declare -A NODE_PID=()
R1_PID= R2_PID= SINGLE_PID= PG_DIR=

in_ns() { nsenter --net="/run/netns/$NS_PREFIX-$1" -- "${@:2}"; }

stop() { # pid: SIGTERM, then wait until it is gone (also for processes db_failover.py started)
  kill -TERM "$1" 2>/dev/null || return 0
  wait "$1" 2>/dev/null
  for _ in $(seq 1 300); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
}

cleanup() {
  [[ -f "$WORK/r2.pid" ]] && R2_PID=$(cat "$WORK/r2.pid") && rm -f "$WORK/r2.pid"
  [[ -f "$WORK/n3.pid" ]] && NODE_PID[3]=$(cat "$WORK/n3.pid") && rm -f "$WORK/n3.pid"
  for p in $R1_PID $R2_PID $SINGLE_PID; do stop "$p"; done
  for i in 1 2 3; do
    p=${NODE_PID[$i]:-}
    [[ -n $p ]] && stop "$p"
  done
  R1_PID= R2_PID= SINGLE_PID=
  NODE_PID=()
  # What the nodes leave (a SIGKILLed node's sandboxes, async teardown) goes by a local kill
  # in the node's own namespace (its sandboxes' veths are there).
  for i in 1 2 3; do
    [[ -e /run/netns/$NS_PREFIX-n$i ]] || continue
    for id in $(in_ns n$i "$BIN" local list --state-dir "$STATE-n$i" --first-slot $((SLOT + i * 200)) --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
      in_ns n$i "$BIN" local kill "$id" --state-dir "$STATE-n$i" --first-slot $((SLOT + i * 200)) --any-free-slots >/dev/null 2>&1
    done
    ip netns del "$NS_PREFIX-n$i" 2>/dev/null
  done
  for id in $("$BIN" local list --state-dir "$STATE-single" --first-slot $((SLOT + 800)) --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
    "$BIN" local kill "$id" --state-dir "$STATE-single" --first-slot $((SLOT + 800)) --any-free-slots >/dev/null 2>&1
  done
  [[ -n $PG_DIR ]] && "$ROOT/scripts/pg-test-cluster.sh" stop "$PG_DIR" >/dev/null 2>&1
  PG_DIR=
}
# A SIGKILLed node leaves its quota filesystem mounted. The leftover check's `local list`
# (in this mount namespace) releases it when no sandbox is left; on an early exit the
# cleanup's `local` calls ran inside the nodes' namespaces (`ip netns exec` has a mount
# namespace of its own), so release what is left here.
release_mounts() {
  for s in "$STATE"-n1 "$STATE"-n2 "$STATE"-n3 "$STATE-single"; do
    if mountpoint -q "$s/sandboxes" && [[ -z "$(ls -A "$s/sandboxes" 2>/dev/null | grep -v '^\.')" ]]; then
      umount "$s/sandboxes" 2>/dev/null || echo "cluster-db-e2e: could not unmount $s/sandboxes" >&2
    fi
  done
}
trap 'cleanup; release_mounts; rm -rf "$WORK"' EXIT

wait_line() { # file pattern seconds
  for _ in $(seq 1 $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "cluster-db-e2e: no '$2' in $1 within $3 s:" >&2; tail -n 30 "$1" "${1%.out}.log" >&2; return 1
}

# The suite's network: a bridge, and one namespace per node behind a veth.
ip link add cbr-e2e type bridge && ip addr add 10.79.0.1/24 dev cbr-e2e && ip link set cbr-e2e up || exit 1
for i in 1 2 3; do
  ns="$NS_PREFIX-n$i"
  ip netns add "$ns" || exit 1
  ip link add "vh$i" type veth peer name "vc$i" || exit 1
  ip link set "vc$i" netns "$ns"
  ip link set "vh$i" master cbr-e2e up
  in_ns n$i ip link set lo up
  in_ns n$i ip link set "vc$i" name eth0
  in_ns n$i ip addr add "10.79.0.1$i/24" dev eth0
  in_ns n$i ip link set eth0 up
done

# A private PostgreSQL on the bridge's address.
eval "$("$ROOT/scripts/pg-test-cluster.sh" start --owner $$ --listen 10.79.0.1 --trust-net 10.79.0.0/24 | sed 's/^/PG_/')"
[[ -n ${PG_tcp_url:-} ]] || { echo "cluster-db-e2e: PostgreSQL did not start" >&2; exit 1; }
PG_DIR=$PG_dir
DB=$PG_tcp_url
export CUBICLE_E2E_DB=$DB

node_cmd() { # i: the command line of node i, NUL-separated
  printf '%s\0' nsenter --net="/run/netns/$NS_PREFIX-n$1" -- "$BIN" node --state-dir "$STATE-n$1" \
    --first-slot $((SLOT + $1 * 200)) --max-sandboxes 100 --any-free-slots \
    --listen "10.79.0.1$1:3100" --node-token-file "$TOKEN" --pool tiny=1 --no-build-templates \
    --dns-upstream 203.0.113.53 --database "$DB" --node-name "n$1" --capacity-cpus 64 --capacity-memory-mb 65536
}
for i in 1 2 3; do
  mapfile -d '' cmd < <(node_cmd $i)
  # (nsenter itself, not a subshell: $! must be the node's pid)
  "${cmd[@]}" >>"$WORK/n$i.out" 2>>"$WORK/n$i.log" &
  NODE_PID[$i]=$!
done
for i in 1 2 3; do wait_line "$WORK/n$i.out" "cubicle node: ready" 60 || exit 1; done

replica_cmd() { # n: the command line of replica n, NUL-separated
  printf '%s\0' "$BIN" --log-format json serve --state-dir "$STATE-r$1" --listen "10.79.0.1:0" --database "$DB" \
    --node-token-file "$TOKEN"
}
start_replica() { # n
  mapfile -d '' cmd < <(replica_cmd $1)
  "${cmd[@]}" >"$WORK/r$1.out" 2>"$WORK/r$1.log" &
}
start_replica 1; R1_PID=$!
start_replica 2; R2_PID=$!
"$BIN" --log-format json serve --state-dir "$STATE-single" --listen 127.0.0.1:0 --first-slot $((SLOT + 800)) --max-sandboxes 100 \
  --any-free-slots --pool tiny=1 --no-build-templates --no-reap-foreign --dns-upstream 203.0.113.53 \
  >"$WORK/single.out" 2>"$WORK/single.log" &
SINGLE_PID=$!
for r in r1 r2 single; do wait_line "$WORK/$r.out" "cubicle: ready" 60 || exit 1; done
env_of() { # name var
  grep "^export $2=" "$WORK/$1.out" | head -1 | sed "s/^export $2=//; s/^'//; s/'\$//; s/^\"//; s/\"\$//"
}
export CUBICLE_R1_API=$(env_of r1 E2B_API_URL) CUBICLE_R1_SANDBOX=$(env_of r1 E2B_SANDBOX_URL)
export CUBICLE_R2_API=$(env_of r2 E2B_API_URL) CUBICLE_R2_SANDBOX=$(env_of r2 E2B_SANDBOX_URL)
export CUBICLE_SINGLE_API=$(env_of single E2B_API_URL) CUBICLE_SINGLE_SANDBOX=$(env_of single E2B_SANDBOX_URL)
export E2B_API_KEY=$(env_of r1 E2B_API_KEY)
[[ -n $E2B_API_KEY ]] || E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE-r1" --database "$DB")
export CUBICLE_SINGLE_KEY=$(env_of single E2B_API_KEY)
[[ -n $CUBICLE_SINGLE_KEY ]] || CUBICLE_SINGLE_KEY=$("$BIN" apikey --state-dir "$STATE-single")
export CUBICLE_BIN=$BIN CUBICLE_NODE_TOKEN_FILE=$TOKEN CUBICLE_NS_PREFIX=$NS_PREFIX
export CUBICLE_N1_PID=${NODE_PID[1]} CUBICLE_N3_PID=${NODE_PID[3]} CUBICLE_E2E_WORK=$WORK
export CUBICLE_R2_PID=$R2_PID
export CUBICLE_R2_CMD=$(replica_cmd 2 | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read().split("\0")[:-1]))')
# db_failover.py restarts node 3 with this command line (and writes its new pid).
export CUBICLE_N3_CMD=$(node_cmd 3 | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read().split("\0")[:-1]))')

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
# (node 3 and replica 2 were restarted by it: cleanup reads their pid files)
cleanup
trap - EXIT
left=""
for s in n1:$((SLOT + 200)) n2:$((SLOT + 400)) n3:$((SLOT + 600)) single:$((SLOT + 800)); do
  slot=${s#*:} s=${s%%:*}
  l=$("$BIN" local list --state-dir "$STATE-$s" --first-slot "$slot" --any-free-slots 2>/dev/null | awk 'NR>1')
  [[ -n $l ]] && left="$left $s: $l"
  compgen -G "$STATE-$s/sandboxes/*/" >/dev/null && left="$left $s: sandbox directories"
done
ls /run/netns 2>/dev/null | grep -q "^$NS_PREFIX" && left="$left netns"
ip -o link show | grep -q ' cbs\| vh[123]' && left="$left veths"
[[ -d ${PG_dir:-/nonexistent} ]] && left="$left postgres($PG_dir)"
if [[ -n $left ]]; then
  echo "cluster-db-e2e: left behind:$left" >&2
  rc=1
fi
for s in "$STATE"-n1 "$STATE"-n2 "$STATE"-n3 "$STATE-single"; do
  if mountpoint -q "$s/sandboxes"; then
    echo "cluster-db-e2e: left behind: the quota filesystem mounted on $s/sandboxes" >&2
    rc=1
  fi
done
release_mounts
rm -rf "$WORK"
"$PY" -c "import sys,time; print(f'cluster-db-e2e: suite took {time.time() - float(sys.argv[1]):.1f} s')" "$T_START"
exit $rc
