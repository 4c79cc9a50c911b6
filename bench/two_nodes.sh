#!/usr/bin/env bash
# `cubicle bench` against two `cubicle node`s and one API replica on this host, in a
# private network namespace: the way to hold more sandboxes on one host than one node
# process has descriptors for (each live sandbox holds two of its node's; on a host where
# root cannot raise the hard limit, as on the development VM with its 20,000, one node
# stops near 9,500). Every argument goes to `cubicle bench`, which gets `--url` and
# `--api-key` of the replica:
#
#   sudo bench/two_nodes.sh density --n 10000 --also '' --sandbox-timeout 7200
#
# Environment (optional): CUBICLE_BIN (default target/release/cubicle), CUBICLE_ENVD_BIN
# (default the release cubicle-envd), CUBICLE_BENCH_NODES_STATE (state directories
# "<it>-a", "<it>-b" and "<it>-api"; default /var/lib/cubicle-bench-nodes),
# CUBICLE_BENCH_NODE_SANDBOXES (each node's --max-sandboxes, default 6000). Logs stay in
# the printed work directory when the bench fails.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SELF="$ROOT/bench/two_nodes.sh"
BIN=${CUBICLE_BIN:-$ROOT/target/release/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/release/cubicle-envd}
STATE=${CUBICLE_BENCH_NODES_STATE:-/var/lib/cubicle-bench-nodes}
PER=${CUBICLE_BENCH_NODE_SANDBOXES:-6000}
FIRST_SLOT=12000 # node a's first slot, node b's is PER later (a host has 32,768)

if [[ "${CUBICLE_TWO_NODES_INNER:-}" != "1" ]]; then
  export CUBICLE_TWO_NODES_INNER=1
  for n in a b; do
    [[ -f "$STATE-$n/templates/tiny/template.json" ]] ||
      "$BIN" template build tiny --state-dir "$STATE-$n" || exit 1
  done
  exec unshare --net -- "$SELF" "$@"
fi
ip link set lo up

WORK=$(mktemp -d /tmp/cubicle-two-nodes.XXXXXX)
TOKEN="$WORK/node-token"
head -c 32 /dev/urandom | base64 >"$TOKEN"
chmod 600 "$TOKEN"
PIDS=()
cleanup() {
  # The replica first, then the nodes; what a node left (a killed bench's sandboxes) is
  # removed by a local kill on its state directory.
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
  PIDS=()
  local n s=$FIRST_SLOT
  for n in a b; do
    for id in $("$BIN" local list --state-dir "$STATE-$n" --first-slot $s --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
      "$BIN" local kill "$id" --state-dir "$STATE-$n" --first-slot $s --any-free-slots >/dev/null 2>&1
    done
    s=$((s + PER))
  done
}
trap cleanup EXIT

wait_line() { # file pattern seconds
  for _ in $(seq 1 $(($3 * 10))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "two_nodes: no '$2' in $1 within $3 s:" >&2
  tail -30 "$1" >&2
  return 1
}

# The nodes first, then the replica, which goes to the front of `PIDS` so that it is
# stopped first.
NODES=()
slot=$FIRST_SLOT
for n in a b; do
  addr=127.0.0.$([[ $n == a ]] && echo 2 || echo 3):3100
  "$BIN" node --state-dir "$STATE-$n" --first-slot "$slot" --max-sandboxes "$PER" --any-free-slots \
    --listen "$addr" --node-token-file "$TOKEN" --pool '' --shells 0 --no-build-templates \
    --dns-upstream 203.0.113.53 >"$WORK/node-$n.out" 2>"$WORK/node-$n.log" &
  PIDS+=($!)
  wait_line "$WORK/node-$n.out" "cubicle node: ready on" 120 || exit 1
  NODES+=(--node "http://$addr")
  slot=$((slot + PER))
done
"$BIN" serve --state-dir "$STATE-api" --listen 127.0.0.1:0 "${NODES[@]}" \
  --node-token-file "$TOKEN" >"$WORK/replica.out" 2>"$WORK/replica.log" &
PIDS=($! "${PIDS[@]}")
wait_line "$WORK/replica.out" "cubicle: ready" 60 || exit 1
eval "$(grep '^export ' "$WORK/replica.out")"
[[ -n ${E2B_API_KEY:-} ]] || E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE-api")

"$BIN" bench --url "$E2B_API_URL" --api-key "$E2B_API_KEY" "$@"
rc=$?
cleanup
trap - EXIT
if [[ $rc -ne 0 ]]; then
  echo "two_nodes: the bench failed (rc $rc); logs in $WORK" >&2
else
  rm -rf "$WORK"
fi
exit $rc
