#!/usr/bin/env bash
# A few iterations of every measure of the README's bench command that needs no large
# template (create, cycle, exec, density, peer), both pool modes, in a private network
# namespace: the bench must run to its end and every row must have its samples and no
# errors. Not a measurement (a debug build, three samples a row): it catches a bench
# that no longer runs (e.g. `peer` looking for a template's rootfs where there is none).
#
#   CUBICLE_BIN=target/debug/cubicle CUBICLE_ENVD_BIN=<static envd> tests/e2e/bench_smoke.sh
set -euo pipefail

BIN=${CUBICLE_BIN:?CUBICLE_BIN: the cubicle binary}
ENVD=${CUBICLE_ENVD_BIN:?CUBICLE_ENVD_BIN: a statically linked cubicle-envd}
STATE=${CUBICLE_BENCH_STATE_DIR:-/var/lib/cubicle-bench-smoke}
out=$(mktemp /tmp/cubicle-bench-smoke.XXXXXX)
trap 'rm -f "$out"' EXIT

# The bench kills what it made; its own server's slots (`--any-free-slots`) and state
# dir keep it apart from anything else on the host.
CUBICLE_ENVD_BIN="$ENVD" unshare --net sh -c '
  ip link set lo up
  exec "$1" bench create cycle exec density peer --json --iterations 3 \
    --concurrency 1,3 --n 4 --pool-size 3 --also "" --server-state-dir "$2"
' _ "$BIN" "$STATE" >"$out"
cat "$out"

python3 - "$out" <<'EOF'
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
problems = []
for r in rows:
    if r.get("errors", 0) != 0 or r.get("n", 0) == 0:
        problems.append(f"row with errors or no samples: {r}")
seen = {(r["name"], r.get("pool"), r.get("runtime")) for r in rows}
want = [(m, p, None) for m in ("create", "cycle") for p in ("off", "on", "shells")]
want += [("exec", None, None)]  # exec and density: first pool mode only
want += [("peer", None, "runc run"), ("peer", None, "bwrap --unshare-all")]
for name, pool, runtime in want:
    if not any(n == name and (pool is None or p == pool) and (runtime is None or rt == runtime)
               for n, p, rt in seen):
        problems.append(f"no {name} row (pool {pool}, runtime {runtime})")
if not any(r["name"] == "density" and r.get("held") == r.get("asked") == 4 for r in rows):
    problems.append("no density row holding the 4 sandboxes it asked for")
if not any(r["name"] == "peer" and r.get("peer_over_cubicle", 0) > 0 for r in rows):
    problems.append("the peer rows carry no ratio to Cubicle's cycle")
if problems:
    print("bench smoke: FAILED\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"bench smoke: {len(rows)} rows, every one with samples and no errors")
EOF
