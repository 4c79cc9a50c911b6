#!/usr/bin/env bash
# The serve suite's official-SDK tests (tests/e2e/serve/python, and the JS suite) against a
# cluster coordinated through PostgreSQL (issue 19, "The official SDKs run their suites
# against a replica"): two `cubicle node --database …` processes, each in a network
# namespace of its own, an API replica (`cubicle serve --database … --node-token-file …`,
# no --node) that the SDKs' E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY point at, and a
# second replica (with CUBICLE_E2E_SPLIT_REPLICAS=1, E2B_SANDBOX_URL points at it: the
# control plane of one replica, the data plane of the other). The set-up is
# tests/e2e/cluster/db_cluster.sh's (also run_db.sh's); the nodes share an object store
# (a directory, DBC_OBJECT_STORE=file): templates built through the replica are published
# there and pulled by the node a create lands on. The tests' image registries listen on
# the bridge's address, 10.79.0.1, which the nodes' builds reach (`--insecure-registry`).
#
#   tests/e2e/cluster/serve_suite.sh [python [PYTEST ARGS] | js | all [PYTEST ARGS]]   (default: python)
#
# The tests see CUBICLE_E2E_CLUSTER=1: those that need a single host's internals (its
# state directory, SQLite file, restarting the server) are skipped with their reason (tests/e2e/serve/python/conftest.py,
# CLUSTER_SKIPS; docs/cluster.md, "Tested"). After the run, with every process stopped,
# nothing may be left on any node: no sandbox a node lists, no sandbox directory, no
# process or cgroup of a sandbox of the run, no sandbox of the run not ended in the
# database, no namespace, veth, quota mount or PostgreSQL.
#
# Environment (optional): CUBICLE_BIN, CUBICLE_ENVD_BIN, CUBICLE_E2E_STATE_DIR (prefix
# of the state dirs, default /var/lib/cubicle-e2e-cluster-serve: -n1, -n2, -r1, -r2),
# CUBICLE_E2E_FIRST_SLOT (default 24000; node i from +i*1000, 500 sandboxes each: at
# most 31000, as a node's slots end at 32768 with the default sandbox network),
# CUBICLE_E2E_TEMPLATE_SOURCE (a state dir whose tiny, base and code-interpreter-v1 the
# nodes get a copy of, layers hard-linked; default /var/lib/cubicle-e2e; built there
# when missing), CUBICLE_E2E_SUITE_TIMEOUT (default 2400), CUBICLE_PYTEST_ARGS,
# CUBICLE_E2E_NODE_ARGS (extra `cubicle node` flags, default "--pool code-interpreter-v1=1").
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
SELF="$ROOT/tests/e2e/cluster/serve_suite.sh"
HERE="$ROOT/tests/e2e/serve"
BIN=${CUBICLE_BIN:-$ROOT/target/debug/cubicle}
export CUBICLE_ENVD_BIN=${CUBICLE_ENVD_BIN:-$ROOT/target/x86_64-unknown-linux-gnu/debug/cubicle-envd}
STATE=${CUBICLE_E2E_STATE_DIR:-/var/lib/cubicle-e2e-cluster-serve}
SLOT=${CUBICLE_E2E_FIRST_SLOT:-24000}
SOURCE=${CUBICLE_E2E_TEMPLATE_SOURCE:-/var/lib/cubicle-e2e}
SUITE_TIMEOUT=${CUBICLE_E2E_SUITE_TIMEOUT:-2400}
PY="$ROOT/tests/e2e/.venv/bin/python"
DBC_NODES=2
DBC_SLOT_STRIDE=1000
DBC_MAX_SANDBOXES=500
# (the load test runs 200 sandboxes of 2 vCPUs at once: the capacity must not refuse them)
DBC_NODE_CPUS=1024
DBC_NODE_MEMORY_MB=1048576
DBC_OBJECT_STORE=file
TEMPLATES=(tiny base code-interpreter-v1)

# Stage 1 (host network): each node gets the templates the suite uses, copied from the
# source state dir (layers hard-linked: they are read-only lower layers), built there
# first when it lacks one (debootstrap and pip need the registries).
if [[ "${CUBICLE_CLUSTER_SERVE_E2E_INNER:-}" != "1" ]]; then
  export CUBICLE_CLUSTER_SERVE_E2E_INNER=1
  [[ $(id -u) -eq 0 ]] || { echo "cluster-serve-e2e: needs root" >&2; exit 1; }
  for t in "${TEMPLATES[@]}"; do
    [[ -f "$SOURCE/templates/$t/template.json" ]] || "$BIN" template build "$t" --state-dir "$SOURCE" || exit 1
  done
  for i in $(seq 1 $DBC_NODES); do
    d="$STATE-n$i"
    mkdir -p "$d/templates" "$d/layers"
    for t in "${TEMPLATES[@]}"; do
      # A copy older than the source's template is replaced.
      if [[ -f "$d/templates/$t/template.json" ]] && cmp -s "$d/templates/$t/template.json" "$SOURCE/templates/$t/template.json"; then
        continue
      fi
      rm -rf "$d/templates/$t"
      for l in $("$PY" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1])).get("layers") or []))' "$SOURCE/templates/$t/template.json"); do
        [[ -d "$d/layers/$l" ]] && continue
        # (hard links need one filesystem; a copy otherwise)
        { cp -al "$SOURCE/layers/$l" "$d/layers/$l" 2>/dev/null || { rm -rf "$d/layers/$l"; cp -a --reflink=auto "$SOURCE/layers/$l" "$d/layers/$l"; }; } \
          && cp -a "$SOURCE/layers/$l.json" "$d/layers/" || exit 1
      done
      cp -a "$SOURCE/templates/$t" "$d/templates/$t" || exit 1
    done
  done
  exec unshare --net -- "$SELF" "$@"
fi
T_START=$(date +%s.%N)
ip link set lo up

WORK=$(mktemp -d /tmp/cubicle-cluster-serve-e2e.XXXXXX)
read -r -a DBC_NODE_ARGS <<<"${CUBICLE_E2E_NODE_ARGS-"--pool code-interpreter-v1=1"}"
# (test_templates.py's registries, on the bridge's address: plain HTTP, any port)
DBC_NODE_ARGS+=(--insecure-registry 10.79.0.1)
PORTS=()
for _ in 1 2; do PORTS+=("$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"); done
# shellcheck source=tests/e2e/cluster/db_cluster.sh
. "$ROOT/tests/e2e/cluster/db_cluster.sh"
IDS="$WORK/sandbox-ids"
: >"$IDS"
rc_all=0
results=()
record() { # name rc
  if [[ $2 -eq 0 ]]; then results+=("PASS  $1"); else results+=("FAIL  $1 (exit $2)"); rc_all=1; fi
}
trap 'dbc_cleanup; dbc_release_mounts; rm -rf "$WORK"' EXIT

# What the serve suite's server gets (run.sh): the network tests' limits, JSON logs,
# fast webhook retries.
export CUBICLE_SANDBOX_MAX_CONNECTIONS=100 CUBICLE_SANDBOX_NEW_CONNECTIONS=100 CUBICLE_SANDBOX_BANDWIDTH_MBIT=400
export CUBICLE_LOG_FORMAT=json CUBICLE_WEBHOOK_RETRY_INTERVAL=1

dbc_network || exit 1
dbc_start_postgres || exit 1
dbc_object_store || exit 1
RUN_START_MS=$(( $(date +%s) * 1000 - 1000 ))
dbc_start_nodes || exit 1
for n in 1 2; do
  DBC_REPLICA_LISTEN="127.0.0.1:${PORTS[$((n - 1))]}" dbc_start_replica "$n"
done
for n in 1 2; do dbc_wait_line "$WORK/r$n.out" "cubicle: ready" 60 || exit 1; done
E2B_API_URL=$(dbc_env_of r1 E2B_API_URL)
E2B_SANDBOX_URL=$(dbc_env_of r1 E2B_SANDBOX_URL)
[[ ${CUBICLE_E2E_SPLIT_REPLICAS:-} == 1 ]] && E2B_SANDBOX_URL=$(dbc_env_of r2 E2B_SANDBOX_URL)
E2B_VOLUME_API_URL=$(dbc_env_of r1 E2B_VOLUME_API_URL)
E2B_API_KEY=$(dbc_env_of r1 E2B_API_KEY)
[[ -n $E2B_API_KEY ]] || E2B_API_KEY=$("$BIN" apikey --state-dir "$STATE-r1" --database "$DB")
KEY_B=$("$BIN" apikey create --team other --state-dir "$STATE-r1" --database "$DB" 2>"$WORK/apikey.err" | grep -v '^[[:space:]]*$' | tail -n1 | awk '{print $NF}')
[[ -n $KEY_B ]] || { echo "cluster-serve-e2e: apikey create --team other failed: $(cat "$WORK/apikey.err")" >&2; record "apikey create --team other" 1; }
echo "cluster-serve-e2e: nodes n1..n$DBC_NODES, replicas $E2B_API_URL and $(dbc_env_of r2 E2B_API_URL) (E2B_SANDBOX_URL=$E2B_SANDBOX_URL), PostgreSQL $DB"

run_env=(env -u E2B_DEBUG -u E2B_DOMAIN -u E2B_ACCESS_TOKEN
  E2B_API_URL="$E2B_API_URL" E2B_SANDBOX_URL="$E2B_SANDBOX_URL" E2B_API_KEY="$E2B_API_KEY"
  E2B_VOLUME_API_URL="$E2B_VOLUME_API_URL"
  CUBICLE_E2E_CLUSTER=1 CUBICLE_E2E_REPLICA2_API_URL="$(dbc_env_of r2 E2B_API_URL)"
  CUBICLE_E2E_KEY_B="$KEY_B" CUBICLE_E2E_DOMAIN="localhost:${PORTS[0]}" CUBICLE_E2E_IDS_FILE="$IDS"
  CUBICLE_BIN="$BIN" CUBICLE_E2E_SERVER_PID="${REPLICA_PID[1]}"
  CUBICLE_E2E_STATE_DIR="$STATE-r1" CUBICLE_DATABASE="$DB"
  CUBICLE_E2E_NODE_STATE_DIRS="$(seq 1 "$DBC_NODES" | sed "s|^|$STATE-n|" | paste -sd:)"
  CUBICLE_E2E_REGISTRY_ADDR=10.79.0.1
  CUBICLE_E2E_MAX_CONNECTIONS=100 CUBICLE_E2E_NEW_CONNECTIONS=100 CUBICLE_E2E_BANDWIDTH_MBIT=400
  CUBICLE_E2E_SERVE_LOG="$WORK/r1.log" CUBICLE_E2E_SERVER_LOG="$WORK/r1.log")

run_python() {
  echo; echo "==== cluster serve e2e: python (through replica r1, $DBC_NODES nodes) ===="
  local a paths=("$HERE/python")
  for a in "$@"; do [[ "$a" != -* && ( "$a" == *.py || "$a" == *.py::* ) ]] && paths=(); done
  # shellcheck disable=SC2086
  (cd "$ROOT" && timeout --kill-after=30 "$SUITE_TIMEOUT" "${run_env[@]}" "$PY" -m pytest -c "$HERE/pytest.ini" \
    --rootdir "$HERE" -v ${CUBICLE_PYTEST_ARGS:-} "${paths[@]}" "$@")
  record "cluster serve e2e python" $?
}
run_js() {
  echo; echo "==== cluster serve e2e: js (through replica r1) ===="
  (cd "$HERE/js" && timeout --kill-after=30 "$SUITE_TIMEOUT" "${run_env[@]}" \
    node --test --test-concurrency=1 --test-timeout=300000 --test-reporter=spec ./*.test.mjs)
  record "cluster serve e2e js" $?
}

case "${1:-python}" in
  python) shift; run_python "$@" ;;
  js) run_js ;;
  all) shift; run_python "$@"; run_js ;;
  *) echo "usage: $0 [python [PYTEST ARGS] | js | all [PYTEST ARGS]]" >&2; exit 2 ;;
esac

# --- nothing left behind, over all nodes --------------------------------------------------
echo; echo "==== cluster serve e2e: leak check ===="
for n in 1 2; do dbc_stop "${REPLICA_PID[$n]}"; done
REPLICA_PID=()
# The sandboxes of the run, as the database has them (before the nodes stop: a stop keeps
# running sandboxes, so whatever is not ended now is a leak).
psql "$DB" -Atc "SELECT id || ' ' || state FROM sandboxes WHERE started_at >= $RUN_START_MS" >"$WORK/db-sandboxes" 2>"$WORK/psql.err" \
  || { echo "psql: $(cat "$WORK/psql.err")"; record "leak check: read the database" 1; }
for i in $(seq 1 $DBC_NODES); do dbc_stop "${NODE_PID[$i]}"; done
NODE_PID=()
leaks=$(
  alive=$(awk '$2 != "ended" {print $1 " (" $2 ")"}' "$WORK/db-sandboxes")
  [[ -n $alive ]] && echo "sandboxes the database still has as not ended: $(echo $alive)"
  ids=$({ cat "$IDS"; cut -d' ' -f1 "$WORK/db-sandboxes"; for i in $(seq 1 $DBC_NODES); do ls -A "$STATE-n$i/sandboxes" 2>/dev/null; done; } | grep -E '^[a-z0-9]+$' | sort -u)
  echo "$ids" | /usr/bin/python3 -c '
import os, re, sys
ids = {l.strip() for l in sys.stdin if l.strip()}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cg = open(f"/proc/{pid}/cgroup").read()
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        continue
    hit = {m for m in re.findall(r"/cubicle/([a-z0-9]+)", cg) if m in ids}
    if hit:
        print(f"process {pid} ({cmd[:100]}) in cgroup cubicle/{hit.pop()}")'
  for id in $ids; do
    for d in /sys/fs/cgroup/*/cubicle/"$id" /sys/fs/cgroup/cubicle/"$id"; do [[ -d $d ]] && echo "cgroup $d"; done
  done
  for i in $(seq 1 $DBC_NODES); do
    left=$(ls -A "$STATE-n$i/sandboxes" 2>/dev/null | grep -vE '^(lost\+found|\.quota.*|aquota.*|\.volumes)$')
    [[ -n $left ]] && echo "sandbox directories on n$i: $(echo $left)"
    while read -r mp; do
      [[ $mp == "$STATE-n$i/sandboxes" ]] || echo "mount $mp"
    done < <(awk -v s="$STATE-n$i/" '{ if (index($5, s) == 1) print $5 }' /proc/self/mountinfo)
  done
  echo "sandbox ids of this run: $(echo "$ids" | grep -c .)" >&2
)
dbc_cleanup
leaks+=$'\n'$(dbc_leftovers)
leaks=$(echo "$leaks" | grep .)
if [[ -n $leaks ]]; then
  echo "$leaks" | sed 's/^/LEAK /'
  record "nothing left (all nodes)" 1
  for f in n1 n2 r1; do echo "--- $f log (tail)"; tail -20 "$WORK/$f.log"; done
else
  echo "nothing left"
  record "nothing left (all nodes)" 0
fi
dbc_release_mounts
trap - EXIT
if [[ $rc_all -ne 0 || -n ${CUBICLE_E2E_KEEP_LOG:-} ]]; then
  rm -rf /tmp/cubicle-cluster-serve-e2e-last && mkdir -p /tmp/cubicle-cluster-serve-e2e-last \
    && cp "$WORK"/*.log /tmp/cubicle-cluster-serve-e2e-last/ && echo "cluster-serve-e2e: logs kept in /tmp/cubicle-cluster-serve-e2e-last"
fi
rm -rf "$WORK"
echo; echo "==== cluster serve e2e recap ($("$PY" -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.0f} s')" "$T_START")) ===="
printf '  %s\n' "${results[@]}"
exit $rc_all
