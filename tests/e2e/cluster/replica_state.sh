#!/usr/bin/env bash
# End-to-end check of templates and volumes through a replica coordinated by the
# cluster's database (docs/cluster.md, "Templates through a replica", "Volumes through a
# replica"): two `cubicle node --database
# … --object-store file://…` (127.0.0.2 and 127.0.0.3) and two replicas (`cubicle serve
# --database … --node-token-file …`, no --node), a private PostgreSQL
# (scripts/pg-test-cluster.sh), in a private network namespace. replica_state.py builds a
# template with the official Python SDK's Template builder through the replica, creates
# from it on the build node, drains that node so the next create lands on the other one
# (which pulls it from the object store), and deletes it: gone from both nodes, the
# bucket and the database. Then a volume made through the replica is mounted and written
# by one sandbox, written through the content API, mounted and read by a second sandbox
# (placed on the volume's node), refused while that node drains, and deleted. Nothing is
# left behind.
#
#   tests/e2e/cluster/replica_state.sh
#
# Environment (optional): CUBICLE_BIN, CUBICLE_ENVD_BIN (as run.sh),
# CUBICLE_E2E_STATE_DIR (prefix of the state dirs: PREFIX-tpl-a, -tpl-b, -tpl-replica(-2);
# default /var/lib/cubicle-e2e), CUBICLE_E2E_FIRST_SLOT (A's first slot, B's is +100;
# default 24000).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
SELF="$ROOT/tests/e2e/cluster/replica_state.sh"
BIN=${CUBICLE_BIN:-$ROOT/target/debug/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd}
PREFIX=${CUBICLE_E2E_STATE_DIR:-/var/lib/cubicle-e2e}
STATE_A=$PREFIX-tpl-a STATE_B=$PREFIX-tpl-b STATE_R=$PREFIX-tpl-replica
SLOT_A=${CUBICLE_E2E_FIRST_SLOT:-24000}
SLOT_B=$(( SLOT_A + 100 ))
PY="$ROOT/tests/e2e/.venv/bin/python"

if [[ "${CUBICLE_REPLICA_STATE_E2E_INNER:-}" != "1" ]]; then
  for s in "$STATE_A" "$STATE_B"; do
    [[ -f $s/templates/tiny/template.json ]] || "$BIN" template build tiny --state-dir "$s" >/dev/null || exit 1
  done
  export CUBICLE_REPLICA_STATE_E2E_INNER=1
  exec unshare --net -- "$SELF" "$@"
fi
ip link set lo up
rm -f "$STATE_A/draining" "$STATE_B/draining"
ip addr add 127.0.0.2/8 dev lo 2>/dev/null
ip addr add 127.0.0.3/8 dev lo 2>/dev/null

WORK=$(mktemp -d /tmp/cubicle-replica-state-e2e.XXXXXX)
TOKEN="$WORK/node-token"
head -c 32 /dev/urandom | base64 > "$TOKEN"
chmod 600 "$TOKEN"
A_PID= B_PID= REPLICA_PID= REPLICA2_PID= PG_DIR=
stop() { # pid…
  for p in "$@"; do [[ -n $p ]] && kill -TERM "$p" 2>/dev/null; done
  for p in "$@"; do [[ -n $p ]] && wait "$p" 2>/dev/null; done
}
local_kill_all() { # state slot
  for id in $("$BIN" local list --state-dir "$1" --first-slot "$2" --max-sandboxes 100 --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
    "$BIN" local kill "$id" --state-dir "$1" --first-slot "$2" --max-sandboxes 100 --any-free-slots >/dev/null 2>&1
  done
}
cleanup() {
  stop "$REPLICA_PID" "$REPLICA2_PID" "$A_PID" "$B_PID"
  REPLICA_PID= REPLICA2_PID= A_PID= B_PID=
  local_kill_all "$STATE_A" "$SLOT_A"
  local_kill_all "$STATE_B" "$SLOT_B"
  [[ -n $PG_DIR ]] && "$ROOT/scripts/pg-test-cluster.sh" stop "$PG_DIR" >/dev/null 2>&1
  PG_DIR=
}
trap 'cleanup; rm -rf "$WORK"' EXIT

wait_line() { # file pattern seconds
  for _ in $(seq 1 $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "replica-state-e2e: no '$2' in $1 within $3 s:" >&2; tail -30 "$1" >&2; return 1
}

eval "$("$ROOT/scripts/pg-test-cluster.sh" start --owner $$ | sed 's/^/PG_/')"
[[ -n ${PG_url:-} ]] || { echo "replica-state-e2e: PostgreSQL did not start" >&2; exit 1; }
PG_DIR=$PG_dir
DB=$PG_url
BUCKET_DIR=$WORK/bucket
mkdir -p "$BUCKET_DIR"
BUCKET=file://$BUCKET_DIR

start_node() { # name state slot addr → pid in NODE_PID
  "$BIN" node --state-dir "$2" --first-slot "$3" --max-sandboxes 100 --any-free-slots \
    --listen "$4:3100" --node-token-file "$TOKEN" --pool tiny=0 --no-build-templates \
    --dns-upstream 203.0.113.53 --object-store "$BUCKET" --database "$DB" --node-name "$1" \
    >"$WORK/$1.out" 2>>"$WORK/$1.log" &
  NODE_PID=$!
}
start_node a "$STATE_A" "$SLOT_A" 127.0.0.2; A_PID=$NODE_PID
start_node b "$STATE_B" "$SLOT_B" 127.0.0.3; B_PID=$NODE_PID
wait_line "$WORK/a.out" "cubicle node: ready" 120 || exit 1
wait_line "$WORK/b.out" "cubicle node: ready" 120 || exit 1

"$BIN" serve --state-dir "$STATE_R" --listen 127.0.0.1:0 --database "$DB" \
  --node-token-file "$TOKEN" >"$WORK/replica.out" 2>"$WORK/replica.log" &
REPLICA_PID=$!
wait_line "$WORK/replica.out" "cubicle: ready" 60 || exit 1
# A second replica over the same database: what the first one recorded, it sees.
"$BIN" serve --state-dir "$STATE_R-2" --listen 127.0.0.1:0 --database "$DB" \
  --node-token-file "$TOKEN" >"$WORK/replica2.out" 2>"$WORK/replica2.log" &
REPLICA2_PID=$!
wait_line "$WORK/replica2.out" "cubicle: ready" 60 || exit 1
export CUBICLE_API2=$(grep '^export E2B_API_URL=' "$WORK/replica2.out" | head -1 | sed "s/^export E2B_API_URL=//; s/^'//; s/'\$//; s/^\"//; s/\"\$//")
eval "$(grep '^export ' "$WORK/replica.out")"
[[ -n ${E2B_API_KEY:-} ]] || export E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE_R" --database "$DB")

export CUBICLE_STATE_A=$STATE_A CUBICLE_STATE_B=$STATE_B CUBICLE_BUCKET_DIR=$BUCKET_DIR
export CUBICLE_NODE_TOKEN_FILE=$TOKEN CUBICLE_BIN=$BIN CUBICLE_E2E_DB=$DB
"$PY" "$ROOT/tests/e2e/cluster/replica_state.py"
rc=$?
if [[ $rc -ne 0 || -n ${CUBICLE_E2E_KEEP_LOG:-} ]]; then
  for f in a b replica; do echo "--- $f log (tail)"; tail -40 "$WORK/$f.log"; done
fi
grep -h "template builds pinned\|template removed\|placed on" "$WORK/replica.log" | cut -c1-220 | head -6
cleanup
left_a=$("$BIN" local list --state-dir "$STATE_A" --first-slot "$SLOT_A" --max-sandboxes 100 --any-free-slots 2>/dev/null | awk 'NR>1')
left_b=$("$BIN" local list --state-dir "$STATE_B" --first-slot "$SLOT_B" --max-sandboxes 100 --any-free-slots 2>/dev/null | awk 'NR>1')
if [[ -n $left_a$left_b ]] || compgen -G "$STATE_A/sandboxes/*/" >/dev/null \
    || compgen -G "$STATE_B/sandboxes/*/" >/dev/null || ip -o link show | grep -q ' cbs'; then
  echo "replica-state-e2e: left behind: $left_a $left_b" >&2
  rc=1
fi
trap - EXIT
for s in "$STATE_A" "$STATE_B"; do
  if mountpoint -q "$s/sandboxes"; then
    echo "replica-state-e2e: left behind: the quota filesystem mounted on $s/sandboxes: $(ls -A "$s/sandboxes" | tr '\n' ' ')" >&2
    tail -n 5 "$WORK/a.log" "$WORK/b.log" >&2
    umount "$s/sandboxes" || true
    rc=1
  fi
done
rm -rf "$WORK"
exit $rc
