#!/usr/bin/env bash
# End-to-end check of moving paused sandboxes between nodes (docs/cluster.md, "Moving
# sandboxes between nodes") with the official Python SDK: two `cubicle node`s (A on
# 127.0.0.2, B on 127.0.0.3) sharing moto's S3 server as their object store, and one API
# replica (127.0.0.1), in a private network namespace. moving.py drives the replica:
# a sandbox paused on A resumes on B after A is SIGKILLed (file and process memory
# intact), A restarted does not keep it, and a drain of A with migration moves its idle
# sandboxes to B at their next connect (timed).
#
#   tests/e2e/cluster/moving.sh
#
# Environment (optional): CUBICLE_BIN, CUBICLE_ENVD_BIN (as run.sh),
# CUBICLE_E2E_STATE_DIR (prefix of the state dirs: node A's is PREFIX-moving-a, B's
# PREFIX-moving-b, the replica's PREFIX-moving-replica; default /var/lib/cubicle-e2e),
# CUBICLE_E2E_FIRST_SLOT (A's first slot, B's is +100; default 23000). Node A's state
# dir gets `tiny` and `base` from PREFIX's templates when it has them (copied), else
# builds them; B's shares A's layers (hard links).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
SELF="$ROOT/tests/e2e/cluster/moving.sh"
BIN=${CUBICLE_BIN:-$ROOT/target/debug/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd}
PREFIX=${CUBICLE_E2E_STATE_DIR:-/var/lib/cubicle-e2e}
STATE_A=$PREFIX-moving-a STATE_B=$PREFIX-moving-b STATE_R=$PREFIX-moving-replica
SLOT_A=${CUBICLE_E2E_FIRST_SLOT:-23000}
SLOT_B=$(( SLOT_A + 100 ))
PY="$ROOT/tests/e2e/.venv/bin/python"

if [[ "${CUBICLE_CLUSTER_E2E_INNER:-}" != "1" ]]; then
  [[ -x $ROOT/tests/e2e/.venv-s3/bin/moto_server ]] || { echo "moving-e2e: no moto (scripts/install-test-deps.sh makes it)" >&2; exit 1; }
  # shellcheck source=tests/e2e/cluster/templates.sh
  . "$ROOT/tests/e2e/cluster/templates.sh"
  for t in tiny base; do
    seed_template "$PREFIX" "$STATE_A" "$t" || exit 1
    LINK=1 seed_template "$STATE_A" "$STATE_B" "$t" || exit 1
  done
  export CUBICLE_CLUSTER_E2E_INNER=1
  exec unshare --net -- "$SELF" "$@"
fi
ip link set lo up
rm -f "$STATE_A/draining" "$STATE_B/draining"  # a drain an earlier run left
ip addr add 127.0.0.2/8 dev lo 2>/dev/null
ip addr add 127.0.0.3/8 dev lo 2>/dev/null

WORK=$(mktemp -d /tmp/cubicle-moving-e2e.XXXXXX)
TOKEN="$WORK/node-token"
head -c 32 /dev/urandom | base64 > "$TOKEN"
chmod 600 "$TOKEN"
MOTO_PID= A_PID= B_PID= REPLICA_PID=
stop() { # pid…
  for p in "$@"; do [[ -n $p ]] && kill -TERM "$p" 2>/dev/null; done
  for p in "$@"; do [[ -n $p ]] && wait "$p" 2>/dev/null; done
}
local_kill_all() { # state slot
  for id in $("$BIN" local list --state-dir "$1" --first-slot "$2" --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
    "$BIN" local kill "$id" --state-dir "$1" --first-slot "$2" --any-free-slots >/dev/null 2>&1
  done
}
cleanup() {
  stop "$REPLICA_PID" "$A_PID" "$B_PID" "$MOTO_PID"
  REPLICA_PID= A_PID= B_PID= MOTO_PID=
  local_kill_all "$STATE_A" "$SLOT_A"
  local_kill_all "$STATE_B" "$SLOT_B"
}
trap 'cleanup; rm -rf "$WORK"' EXIT

wait_line() { # file pattern seconds
  for _ in $(seq 1 $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "moving-e2e: no '$2' in $1 within $3 s:" >&2; tail -30 "$1" >&2; return 1
}

# moto on 127.0.0.1 (this namespace only), with the bucket.
# shellcheck source=tests/e2e/cluster/moto.sh
. "$ROOT/tests/e2e/cluster/moto.sh"
moto_start 127.0.0.1 4566 cubicle-e2e "$WORK/moto.log"
BUCKET=s3://cubicle-e2e/run-$$

# The template both nodes run: published once (as a cluster does after a build), in the
# background while the nodes start. (moto keeps it in memory; ~30 s for base's 927 MiB.)
t_push=$(date +%s%N)
"$BIN" template push base --state-dir "$STATE_A" --object-store "$BUCKET" >"$WORK/push.out" 2>&1 &
PUSH_PID=$!

start_node() { # name state slot addr pool → pid in NODE_PID
  "$BIN" node --state-dir "$2" --first-slot "$3" --max-sandboxes 100 --any-free-slots \
    --listen "$4:3100" --node-token-file "$TOKEN" --pool "$5" --no-build-templates \
    --dns-upstream 203.0.113.53 --object-store "$BUCKET" \
    >"$WORK/$1.out" 2>>"$WORK/$1.log" &
  NODE_PID=$!
}
start_node a "$STATE_A" "$SLOT_A" 127.0.0.2 base=1; A_PID=$NODE_PID
start_node b "$STATE_B" "$SLOT_B" 127.0.0.3 base=0; B_PID=$NODE_PID
wait_line "$WORK/a.out" "cubicle node: ready" 120 || exit 1
wait_line "$WORK/b.out" "cubicle node: ready" 120 || exit 1

"$BIN" serve --state-dir "$STATE_R" --listen 127.0.0.1:0 \
  --node http://127.0.0.2:3100,http://127.0.0.3:3100 --node-token-file "$TOKEN" \
  >"$WORK/replica.out" 2>"$WORK/replica.log" &
REPLICA_PID=$!
wait_line "$WORK/replica.out" "cubicle: ready" 60 || exit 1
eval "$(grep '^export ' "$WORK/replica.out")"
[[ -n ${E2B_API_KEY:-} ]] || export E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE_R")

if ! wait "$PUSH_PID"; then
  echo "moving-e2e: publishing base failed:" >&2; cat "$WORK/push.out" >&2; exit 1
fi
echo "     base published to moto in $(( ($(date +%s%N) - t_push) / 1000000 )) ms (once per cluster)"

export CUBICLE_NODE_A_PID=$A_PID CUBICLE_STATE_A=$STATE_A CUBICLE_STATE_B=$STATE_B
export CUBICLE_NODE_TOKEN_FILE=$TOKEN CUBICLE_BIN=$BIN CUBICLE_MOVING_WORK=$WORK
# moving.py restarts node A itself (same command line) after it SIGKILLed it.
export CUBICLE_NODE_A_CMD="$BIN node --state-dir $STATE_A --first-slot $SLOT_A --max-sandboxes 100 --any-free-slots --listen 127.0.0.2:3100 --node-token-file $TOKEN --pool base=1 --no-build-templates --dns-upstream 203.0.113.53 --object-store $BUCKET"

"$PY" "$ROOT/tests/e2e/cluster/moving.py"
rc=$?
if [[ $rc -ne 0 || -n ${CUBICLE_E2E_KEEP_LOG:-} ]]; then
  for f in a b replica; do echo "--- $f log (tail)"; tail -40 "$WORK/$f.log"; done
fi
grep -h "resumed on another node\|released its copy\|moving the paused" "$WORK/replica.log" | head -8
A_PID=$(cat "$WORK/a2.pid" 2>/dev/null || echo "")  # the restarted node A (moving.py)
cleanup
left_a=$("$BIN" local list --state-dir "$STATE_A" --first-slot "$SLOT_A" --any-free-slots 2>/dev/null | awk 'NR>1')
left_b=$("$BIN" local list --state-dir "$STATE_B" --first-slot "$SLOT_B" --any-free-slots 2>/dev/null | awk 'NR>1')
if [[ -n $left_a$left_b ]] || compgen -G "$STATE_A/sandboxes/*/" >/dev/null \
    || compgen -G "$STATE_B/sandboxes/*/" >/dev/null || ip -o link show | grep -q ' cbs'; then
  echo "moving-e2e: left behind: $left_a $left_b" >&2
  ls "$STATE_A/sandboxes" "$STATE_B/sandboxes" >&2; ip -o link show | grep ' cbs' >&2
  rc=1
fi
trap - EXIT
rm -rf "$WORK"
# A node or `cubicle local` that ends with no sandbox left releases its quota filesystem
# (<state>/storage.img on <state>/sandboxes); the leftover check above was the last.
for s in "$STATE_A" "$STATE_B"; do
  if mountpoint -q "$s/sandboxes"; then
    echo "moving-e2e: left behind: the quota filesystem mounted on $s/sandboxes" >&2
    umount "$s/sandboxes" || true
    rc=1
  fi
done
exit $rc
