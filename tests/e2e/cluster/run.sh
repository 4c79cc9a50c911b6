#!/usr/bin/env bash
# End-to-end check of the cluster's role split (docs/cluster.md, "Roles") with the official
# Python SDK: one `cubicle node` and one API replica (`cubicle serve --node …`), on
# distinct addresses (node 127.0.0.2, replica 127.0.0.1) of a private network namespace;
# sdk_core.py drives the replica only (create, commands.run streaming, files read/write,
# upload/download through presigned URLs, list, kill) and then checks that the replica
# answers E2B-shaped errors when the node is gone.
#
#   tests/e2e/cluster/run.sh
#
# Environment (optional): CUBICLE_BIN, CUBICLE_ENVD_BIN (as tests/e2e/serve/run.sh),
# CUBICLE_E2E_STATE_DIR (node's state dir, default /var/lib/cubicle-e2e-cluster; the
# replica's is that + "-replica"), CUBICLE_E2E_FIRST_SLOT (default 21000). The node's
# state dir needs the `base` template (built on the host network on first use).
# CUBICLE_E2E_CLUSTER_TLS=1: the same over mutual TLS between replica and node (a CA made
# here with openssl; the node serves --tls-cert/--tls-key and requires a client
# certificate from --tls-client-ca; the replica names it https:// with --node-ca and
# --node-client-cert/--node-client-key).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
SELF="$ROOT/tests/e2e/cluster/run.sh"
BIN=${CUBICLE_BIN:-$ROOT/target/debug/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd}
STATE=${CUBICLE_E2E_STATE_DIR:-/var/lib/cubicle-e2e-cluster}
SLOT=${CUBICLE_E2E_FIRST_SLOT:-21000}
PY="$ROOT/tests/e2e/.venv/bin/python"

if [[ "${CUBICLE_CLUSTER_E2E_INNER:-}" != "1" ]]; then
  export CUBICLE_CLUSTER_E2E_INNER=1
  for t in tiny base; do
    [[ -f "$STATE/templates/$t/template.json" ]] || "$BIN" template build "$t" --state-dir "$STATE" || exit 1
  done
  exec unshare --net -- "$SELF" "$@"
fi
ip link set lo up

WORK=$(mktemp -d /tmp/cubicle-cluster-e2e.XXXXXX)
TOKEN="$WORK/node-token"
head -c 32 /dev/urandom | base64 > "$TOKEN"
chmod 600 "$TOKEN"
NODE_PID= REPLICA_PID=
cleanup() {
  [[ -n $REPLICA_PID ]] && kill -TERM "$REPLICA_PID" 2>/dev/null && wait "$REPLICA_PID" 2>/dev/null
  [[ -n $NODE_PID ]] && kill -TERM "$NODE_PID" 2>/dev/null && wait "$NODE_PID" 2>/dev/null
  REPLICA_PID= NODE_PID=
  # What the node leaves (async teardown of killed sandboxes) is cleaned by a local kill.
  for id in $("$BIN" local list --state-dir "$STATE" --first-slot "$SLOT" --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
    "$BIN" local kill "$id" --state-dir "$STATE" --first-slot "$SLOT" --any-free-slots >/dev/null 2>&1
  done
}
trap cleanup EXIT

wait_line() { # file pattern seconds
  for _ in $(seq 1 $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "cluster-e2e: no '$2' in $1 within $3 s:" >&2; tail -30 "$1" >&2; return 1
}

NODE_TLS=() REPLICA_TLS=() SCHEME=http
if [[ -n ${CUBICLE_E2E_CLUSTER_TLS:-} ]]; then
  cert() { # name CA-name usage SAN: a key and a certificate the CA signed (self-signed CA without one)
    local n=$1 ca=$2 usage=$3 san=$4 ext=(-addext "basicConstraints=critical,CA:TRUE")
    [[ -n $ca ]] && ext=(-CA "$WORK/$ca.pem" -CAkey "$WORK/$ca.key" -addext "basicConstraints=critical,CA:FALSE"
                        -addext "extendedKeyUsage=$usage" -addext "subjectAltName=$san")
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=$n" \
      -keyout "$WORK/$n.key" -out "$WORK/$n.pem" "${ext[@]}" 2>/dev/null
  }
  cert ca "" "" "" && cert node ca serverAuth IP:127.0.0.2 && cert replica ca clientAuth DNS:replica ||
    { echo "cluster-e2e: openssl could not make the test certificates" >&2; exit 1; }
  NODE_TLS=(--tls-cert "$WORK/node.pem" --tls-key "$WORK/node.key" --tls-client-ca "$WORK/ca.pem")
  REPLICA_TLS=(--node-ca "$WORK/ca.pem" --node-client-cert "$WORK/replica.pem" --node-client-key "$WORK/replica.key")
  SCHEME=https
fi

"$BIN" node --state-dir "$STATE" --first-slot "$SLOT" --max-sandboxes 200 --any-free-slots \
  --listen 127.0.0.2:3100 --node-token-file "$TOKEN" --pool base=1 --no-build-templates \
  --dns-upstream 203.0.113.53 "${NODE_TLS[@]}" >"$WORK/node.out" 2>"$WORK/node.log" &
NODE_PID=$!
wait_line "$WORK/node.out" "cubicle node: ready on $SCHEME://" 300 || exit 1

"$BIN" serve --state-dir "$STATE-replica" --listen 127.0.0.1:0 \
  --node "$SCHEME://127.0.0.2:3100" --node-token-file "$TOKEN" "${REPLICA_TLS[@]}" \
  >"$WORK/replica.out" 2>"$WORK/replica.log" &
REPLICA_PID=$!
wait_line "$WORK/replica.out" "cubicle: ready" 60 || exit 1
eval "$(grep '^export ' "$WORK/replica.out")"
[[ -n ${E2B_API_KEY:-} ]] || export E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE-replica")
export CUBICLE_NODE_PID=$NODE_PID

"$PY" "$ROOT/tests/e2e/cluster/sdk_core.py"
rc=$?
if [[ $rc -ne 0 || -n ${CUBICLE_E2E_KEEP_LOG:-} ]]; then
  echo "--- node log (tail)"; tail -40 "$WORK/node.log"
  echo "--- replica log (tail)"; tail -40 "$WORK/replica.log"
fi
grep -h "placed on" "$WORK/replica.log" | head -3
NODE_PID=  # sdk_core.py killed it (SIGKILL: its sandboxes outlive it, as they do a crash)
cleanup
REPLICA_PID=
trap - EXIT
# The leftovers of the killed node were removed by `cubicle local kill`: nothing may be left.
left=$("$BIN" local list --state-dir "$STATE" --first-slot "$SLOT" --any-free-slots 2>/dev/null | awk 'NR>1')
if [[ -n $left ]] || compgen -G "$STATE/sandboxes/*/" >/dev/null || ip -o link show | grep -q ' cbs'; then
  echo "cluster-e2e: left behind: ${left:-sandbox directories or veths}" >&2
  ls "$STATE/sandboxes" >&2; ip -o link show | grep ' cbs' >&2
  rc=1
fi
# A node or `cubicle local` that ends with no sandbox left releases its quota filesystem.
if mountpoint -q "$STATE/sandboxes"; then
  echo "cluster-e2e: left behind: the quota filesystem mounted on $STATE/sandboxes" >&2
  rc=1
fi
rm -rf "$WORK"
exit $rc
