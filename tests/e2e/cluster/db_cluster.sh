# shellcheck shell=bash
# A cluster coordinated through PostgreSQL, for the e2e suites that need one (sourced by
# tests/e2e/cluster/run_db.sh and tests/e2e/cluster/serve_suite.sh; docs/cluster.md,
# "Leases, placement and drain"): N `cubicle node --database …` processes, each in a
# network namespace of its own (10.79.0.11, .12, … behind veths on a bridge 10.79.0.1 in
# the caller's private network namespace), API replicas (`cubicle serve --database …
# --node-token-file …`, no --node) in the caller's namespace, and a private PostgreSQL on
# the bridge's address (scripts/pg-test-cluster.sh).
#
# The caller runs in a private network namespace of its own (`unshare --net`, lo up) and
# sets, before calling anything here:
#   ROOT BIN     the repository and the cubicle binary
#   STATE        prefix of the state dirs: node i uses $STATE-n$i, replica n $STATE-r$n
#   SLOT         node i's first slot is SLOT + i * DBC_SLOT_STRIDE
#   WORK         a scratch directory (logs: $WORK/n$i.out/.log, $WORK/r$n.out/.log)
# and optionally:
#   DBC_NODES            how many nodes (default 3)
#   DBC_SLOT_STRIDE      slots between two nodes' first slots (default 200)
#   DBC_MAX_SANDBOXES    each node's --max-sandboxes (default 100; also the size of the
#                        slot range of the state dirs dbc_leftovers checks)
#   DBC_NODE_CPUS, DBC_NODE_MEMORY_MB  each node's --capacity-cpus / --capacity-memory-mb
#                        (default 64 / 65536: limits the placement counts against)
#   DBC_NODE_ARGS        extra `cubicle node` arguments (array; default: --pool tiny=1)
#   DBC_REPLICA_LISTEN   the replicas' --listen (default 10.79.0.1:0)
#   DBC_REPLICA_ARGS     extra `cubicle serve` arguments of the replicas (array)
#   DBC_OBJECT_STORE     `file`: the nodes share an object store (`--object-store
#                        file://$WORK/bucket`, a directory every node sees, as in
#                        replica_state.sh): templates built through a replica are
#                        published there and pulled by the other nodes; default: none
#
# After dbc_start_postgres: DB (the database URL the nodes and replicas use), PG_DIR.
# After dbc_object_store: BUCKET (the object store's URL; empty without one). A caller
# with a store of its own (moto: lost_paused.sh) sets BUCKET instead; every node gets
# `--object-store "$BUCKET"` when it is set.
# NODE_PID[i], REPLICA_PID[n] hold the processes' pids (callers that restart one write its
# new pid to $WORK/n$i.pid / $WORK/r$n.pid: dbc_cleanup reads those).

DBC_NODES=${DBC_NODES:-3}
DBC_SLOT_STRIDE=${DBC_SLOT_STRIDE:-200}
DBC_MAX_SANDBOXES=${DBC_MAX_SANDBOXES:-100}
DBC_REPLICA_LISTEN=${DBC_REPLICA_LISTEN:-10.79.0.1:0}
DBC_NODE_CPUS=${DBC_NODE_CPUS:-64}
DBC_NODE_MEMORY_MB=${DBC_NODE_MEMORY_MB:-65536}
if ! declare -p DBC_NODE_ARGS >/dev/null 2>&1; then DBC_NODE_ARGS=(--pool tiny=1); fi
if ! declare -p DBC_REPLICA_ARGS >/dev/null 2>&1; then DBC_REPLICA_ARGS=(); fi
DBC_OBJECT_STORE=${DBC_OBJECT_STORE:-}
NS_PREFIX="cubicle-e2e-$$"
TOKEN="$WORK/node-token"
declare -A NODE_PID=() REPLICA_PID=()
PG_DIR= DB= DBC_PG_DIR_WAS= BUCKET=

dbc_in_ns() { nsenter --net="/run/netns/$NS_PREFIX-$1" -- "${@:2}"; }

dbc_node_slot() { echo $((SLOT + $1 * DBC_SLOT_STRIDE)); }

dbc_stop() { # pid: SIGTERM, then wait until it is gone (also for processes a test started)
  kill -TERM "$1" 2>/dev/null || return 0
  wait "$1" 2>/dev/null
  for _ in $(seq 1 300); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
}

dbc_wait_line() { # file pattern seconds
  for _ in $(seq 1 $(( $3 * 10 ))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "cluster-db: no '$2' in $1 within $3 s:" >&2; tail -n 30 "$1" "${1%.out}.log" >&2; return 1
}

# The network: a bridge, and one namespace per node behind a veth; the node token.
dbc_network() {
  head -c 32 /dev/urandom | base64 > "$TOKEN"
  chmod 600 "$TOKEN"
  ip link add cbr-e2e type bridge && ip addr add 10.79.0.1/24 dev cbr-e2e && ip link set cbr-e2e up || return 1
  local i ns
  for i in $(seq 1 "$DBC_NODES"); do
    ns="$NS_PREFIX-n$i"
    ip netns add "$ns" || return 1
    ip link add "vh$i" type veth peer name "vc$i" || return 1
    ip link set "vc$i" netns "$ns"
    ip link set "vh$i" master cbr-e2e up
    dbc_in_ns n$i ip link set lo up
    dbc_in_ns n$i ip link set "vc$i" name eth0
    dbc_in_ns n$i ip addr add "10.79.0.1$i/24" dev eth0
    dbc_in_ns n$i ip link set eth0 up
  done
}

# A private PostgreSQL on the bridge's address (stopped by its watcher once this shell
# exits, or by dbc_cleanup).
dbc_start_postgres() {
  local PG_tcp_url= PG_dir=
  eval "$("$ROOT/scripts/pg-test-cluster.sh" start --owner $$ --listen 10.79.0.1 --trust-net 10.79.0.0/24 | sed 's/^/PG_/')"
  [[ -n $PG_tcp_url ]] || { echo "cluster-db: PostgreSQL did not start" >&2; return 1; }
  PG_DIR=$PG_dir DBC_PG_DIR_WAS=$PG_dir
  DB=$PG_tcp_url
}

# The nodes' shared object store (DBC_OBJECT_STORE), before dbc_start_nodes: BUCKET.
# (A directory under $WORK: it goes with the scratch directory.)
dbc_object_store() {
  case "$DBC_OBJECT_STORE" in
    "") BUCKET= ;;
    file) mkdir -p "$WORK/bucket" && BUCKET="file://$WORK/bucket" ;;
    *) echo "cluster-db: DBC_OBJECT_STORE=$DBC_OBJECT_STORE: only 'file' is known" >&2; return 1 ;;
  esac
}

dbc_node_cmd() { # i: the command line of node i, NUL-separated
  local store=()
  [[ -n $BUCKET ]] && store=(--object-store "$BUCKET")
  printf '%s\0' nsenter --net="/run/netns/$NS_PREFIX-n$1" -- "$BIN" node --state-dir "$STATE-n$1" \
    --first-slot "$(dbc_node_slot "$1")" --max-sandboxes "$DBC_MAX_SANDBOXES" --any-free-slots \
    --listen "10.79.0.1$1:3100" --node-token-file "$TOKEN" --no-build-templates \
    --dns-upstream 203.0.113.53 --database "$DB" --node-name "n$1" --capacity-cpus "$DBC_NODE_CPUS" \
    --capacity-memory-mb "$DBC_NODE_MEMORY_MB" "${store[@]}" \
    "${DBC_NODE_ARGS[@]}"
}

dbc_start_nodes() { # start every node, wait for each one's `ready`
  local i cmd
  for i in $(seq 1 "$DBC_NODES"); do
    mapfile -d '' cmd < <(dbc_node_cmd "$i")
    # (nsenter itself, not a subshell: $! must be the node's pid)
    "${cmd[@]}" >>"$WORK/n$i.out" 2>>"$WORK/n$i.log" &
    NODE_PID[$i]=$!
  done
  for i in $(seq 1 "$DBC_NODES"); do dbc_wait_line "$WORK/n$i.out" "cubicle node: ready" 60 || return 1; done
}

dbc_replica_cmd() { # n: the command line of replica n, NUL-separated
  printf '%s\0' "$BIN" --log-format json serve --state-dir "$STATE-r$1" --listen "$DBC_REPLICA_LISTEN" \
    --database "$DB" --node-token-file "$TOKEN" "${DBC_REPLICA_ARGS[@]}"
}

dbc_start_replica() { # n: start replica n (REPLICA_PID[n]); dbc_wait_line "$WORK/r$n.out" "cubicle: ready" to wait
  local cmd
  mapfile -d '' cmd < <(dbc_replica_cmd "$1")
  "${cmd[@]}" >"$WORK/r$1.out" 2>"$WORK/r$1.log" &
  REPLICA_PID[$1]=$!
}

dbc_env_of() { # name var: the value of an `export VAR=…` line a replica printed
  grep "^export $2=" "$WORK/$1.out" | head -1 | sed "s/^export $2=//; s/^'//; s/'\$//; s/^\"//; s/\"\$//"
}

# As a JSON list (for tests that restart a process with the same command line).
dbc_cmd_json() { "$@" | "$ROOT/tests/e2e/.venv/bin/python" -c 'import json,sys; print(json.dumps(sys.stdin.read().split("\0")[:-1]))'; }

# Stop the replicas and nodes, kill what the nodes left (a SIGKILLed node's sandboxes,
# async teardown) by a local kill in the node's own namespace (its sandboxes' veths are
# there), delete the namespaces and PostgreSQL.
dbc_cleanup() {
  local i n p id
  for f in "$WORK"/r*.pid; do [[ -f $f ]] && n=${f##*/r} && REPLICA_PID[${n%.pid}]=$(cat "$f") && rm -f "$f"; done
  for f in "$WORK"/n*.pid; do [[ -f $f ]] && i=${f##*/n} && NODE_PID[${i%.pid}]=$(cat "$f") && rm -f "$f"; done
  for p in "${REPLICA_PID[@]}"; do [[ -n $p ]] && dbc_stop "$p"; done
  for p in "${NODE_PID[@]}"; do [[ -n $p ]] && dbc_stop "$p"; done
  REPLICA_PID=() NODE_PID=()
  for i in $(seq 1 "$DBC_NODES"); do
    [[ -e /run/netns/$NS_PREFIX-n$i ]] || continue
    for id in $(dbc_in_ns n$i "$BIN" local list --state-dir "$STATE-n$i" --first-slot "$(dbc_node_slot "$i")" --max-sandboxes "$DBC_MAX_SANDBOXES" --any-free-slots 2>/dev/null | awk 'NR>1{print $1}'); do
      dbc_in_ns n$i "$BIN" local kill "$id" --state-dir "$STATE-n$i" --first-slot "$(dbc_node_slot "$i")" --max-sandboxes "$DBC_MAX_SANDBOXES" --any-free-slots >/dev/null 2>&1
    done
    ip netns del "$NS_PREFIX-n$i" 2>/dev/null
  done
  [[ -n $PG_DIR ]] && "$ROOT/scripts/pg-test-cluster.sh" stop "$PG_DIR" >/dev/null 2>&1
  PG_DIR=
}

# A SIGKILLed node leaves its quota filesystem mounted. The leftover check's `local list`
# (in this mount namespace) releases it when no sandbox is left; on an early exit the
# cleanup's `local` calls ran inside the nodes' namespaces (`ip netns exec` has a mount
# namespace of its own), so release what is left here. Arguments: more state dirs.
dbc_release_mounts() {
  local s i
  for s in $(for i in $(seq 1 "$DBC_NODES"); do echo "$STATE-n$i"; done) "$@"; do
    if mountpoint -q "$s/sandboxes" && [[ -z "$(ls -A "$s/sandboxes" 2>/dev/null | grep -v '^\.')" ]]; then
      umount "$s/sandboxes" 2>/dev/null || echo "cluster-db: could not unmount $s/sandboxes" >&2
    fi
  done
}

# After dbc_cleanup: what is left of the nodes (sandboxes a node still lists, sandbox
# directories, namespaces, veths, PostgreSQL, quota mounts), one line each on stdout;
# nothing when nothing is. Arguments: more "statedir:firstslot" pairs to check.
dbc_leftovers() {
  local s slot l i pairs=()
  for i in $(seq 1 "$DBC_NODES"); do pairs+=("$STATE-n$i:$(dbc_node_slot "$i")"); done
  for s in "${pairs[@]}" "$@"; do
    slot=${s##*:} s=${s%:*}
    # (a node's slot range: DBC_MAX_SANDBOXES slots, as it ran; more could overlap a
    # colleague's node and fail to open)
    if ! l=$("$BIN" local list --state-dir "$s" --first-slot "$slot" --max-sandboxes "$DBC_MAX_SANDBOXES" --any-free-slots 2>&1); then
      echo "$s: cubicle local list failed: $l"
    elif [[ -n $(echo "$l" | awk 'NR>1') ]]; then
      echo "$s: sandboxes: $(echo "$l" | awk 'NR>1')"
    fi
    compgen -G "$s/sandboxes/*/" >/dev/null && echo "$s: sandbox directories: $(cd "$s/sandboxes" && ls -d */ | tr '\n' ' ')"
    mountpoint -q "$s/sandboxes" && echo "$s: the quota filesystem is still mounted on $s/sandboxes"
  done
  ls /run/netns 2>/dev/null | grep -q "^$NS_PREFIX" && echo "network namespaces $NS_PREFIX-*"
  ip -o link show | grep -q ' cbs\| vh[0-9]' && echo "veths: $(ip -o link show | grep -o ' cbs[0-9]*\| vh[0-9]*' | tr -d ' ' | tr '\n' ' ')"
  [[ -n $DBC_PG_DIR_WAS && -d $DBC_PG_DIR_WAS ]] && echo "postgres ($DBC_PG_DIR_WAS)"
  return 0
}
