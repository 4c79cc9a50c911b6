"""The official Python SDK against two API replicas coordinated through PostgreSQL, over
three `cubicle node`s (tests/e2e/cluster/run_db.sh starts them and sets the environment):
placement spread and cross-replica use, create latency against a single-host serve, a
SIGKILLed node and a partitioned one (lost within 10 s, sandboxes reported, creates land
elsewhere, the partitioned one fenced and re-registered without its old sandboxes), and a
drain (sandboxes paused, no create lands there)."""

import json
import os
import signal
import statistics
import subprocess
import time

import httpx
from e2b import Sandbox

from checks import check, finish

KEY = os.environ["E2B_API_KEY"]
R = {
    "r1": (os.environ["CUBICLE_R1_API"], os.environ["CUBICLE_R1_SANDBOX"]),
    "r2": (os.environ["CUBICLE_R2_API"], os.environ["CUBICLE_R2_SANDBOX"]),
}
SINGLE = (os.environ["CUBICLE_SINGLE_API"], os.environ["CUBICLE_SINGLE_SANDBOX"], os.environ["CUBICLE_SINGLE_KEY"])
BIN = os.environ["CUBICLE_BIN"]
DB = os.environ["CUBICLE_E2E_DB"]
TOKEN = open(os.environ["CUBICLE_NODE_TOKEN_FILE"]).read().strip()
NS = os.environ["CUBICLE_NS_PREFIX"]
N1_PID = int(os.environ["CUBICLE_N1_PID"])
NODE_ADDR = {f"n{i}": f"http://10.79.0.1{i}:3100" for i in (1, 2, 3)}


def create(r, **kw):
    api, sbx = R[r]
    return Sandbox.create("tiny", timeout=300, api_key=KEY, api_url=api, sandbox_url=sbx, **kw)


def connect(r, sid):
    api, sbx = R[r]
    return Sandbox.connect(sid, api_key=KEY, api_url=api, sandbox_url=sbx)


def nodes():
    out = subprocess.run([BIN, "node", "list", "--database", DB, "--format", "json"],
                         check=True, capture_output=True, text=True).stdout
    return {n["nodeID"]: n for n in json.loads(out)}


def node_has(node, sid):
    r = httpx.get(f"{NODE_ADDR[node]}/node/v1/sandboxes/{sid}",
                  headers={"Authorization": f"Bearer {TOKEN}"}, timeout=1)
    return r.status_code == 200 and r.json().get("state") != "dead"


def owner_of(sid):
    for n in ("n3", "n2", "n1"):
        try:
            if node_has(n, sid):
                return n
        except httpx.HTTPError:
            pass
    return None


def info_gone(r, sid):
    api, _ = R[r]
    resp = httpx.get(f"{api}/sandboxes/{sid}", headers={"X-API-KEY": KEY}, timeout=5)
    return resp.status_code == 404


def events_of(r, sid):
    api, _ = R[r]
    resp = httpx.get(f"{api}/events/sandboxes/{sid}", headers={"X-API-KEY": KEY}, timeout=5)
    return resp.json() if resp.status_code == 200 else []


def in_ns(node, *cmd):
    subprocess.run(["nsenter", f"--net=/run/netns/{NS}-{node}", "--", *cmd], check=True)


# --- placement spread through both replicas; cross-replica use ---------------------
made = []
for k in range(6):
    made.append(create("r1" if k % 2 == 0 else "r2", metadata={"k": str(k)}))
owners = {s.sandbox_id: owner_of(s.sandbox_id) for s in made}
per_node = {n: sum(1 for o in owners.values() if o == n) for n in ("n1", "n2", "n3")}
check("six creates through two replicas spread over three nodes", all(v == 2 for v in per_node.values()), per_node)
listed = nodes()
check("node list counts them", all(listed[n]["sandboxes"] == 2 for n in per_node), {n: listed[n]["sandboxes"] for n in listed})

a = made[0]  # made through r1
b = connect("r2", a.sandbox_id)
# (`tiny` has no bash for commands.run: the envd filesystem API exercises the data plane)
b.files.write("/tmp/x", "through-r2")
check("a sandbox made via replica 1 is written via replica 2", b.files.read("/tmp/x") == "through-r2")
a.files.write("/tmp/y", "hello")
check("files written via replica 1 read via replica 2", b.files.read("/tmp/y") == "hello")
ids_r2 = {s.sandbox_id for s in Sandbox.list(api_key=KEY, api_url=R["r2"][0]).next_items()}
check("replica 2 lists the sandboxes made via replica 1", all(s.sandbox_id in ids_r2 for s in made), ids_r2)


# --- create latency: replica vs single-host serve ----------------------------------
# Interleaved (one through the replica, one on the single host, …) so that load from
# elsewhere on the machine weighs on both alike; CUBICLE_E2E_CREATE_SAMPLES each (15).
def timed(make, kill):
    time.sleep(0.25)  # the warm pool refills (both sides alike)
    t0 = time.perf_counter()
    s = make()
    ms = (time.perf_counter() - t0) * 1000
    kill(s)
    return ms


SAMPLES = int(os.environ.get("CUBICLE_E2E_CREATE_SAMPLES", "15"))
reps, singles = [], []
for _ in range(SAMPLES):
    reps.append(timed(lambda: create("r1"), lambda s: s.kill()))
    singles.append(timed(lambda: Sandbox.create("tiny", timeout=60, api_key=SINGLE[2], api_url=SINGLE[0],
                                                sandbox_url=SINGLE[1]), lambda s: s.kill()))
rep, single = statistics.median(reps), statistics.median(singles)
print(f"     FIGURE create p50 (tiny, SDK, {SAMPLES} each, interleaved): replica {rep:.1f} ms, "
      f"single-host serve {single:.1f} ms, difference {rep - single:+.1f} ms", flush=True)
check("create through a replica works (p50 measured)", rep > 0)

# --- node loss: SIGKILL n1, partition n2 --------------------------------------------
before = nodes()
on = {n: [s.sandbox_id for s in made if owners[s.sandbox_id] == n] for n in ("n1", "n2", "n3")}
t0 = time.monotonic()
os.kill(N1_PID, signal.SIGKILL)
in_ns("n2", "ip", "link", "set", "eth0", "down")
t_lost = {}
while time.monotonic() - t0 < 20 and len(t_lost) < 2:
    st = nodes()
    for n in ("n1", "n2"):
        if n not in t_lost and st[n]["state"] == "lost":
            t_lost[n] = time.monotonic() - t0
    time.sleep(0.1)
print(f"     FIGURE lost-node detection: SIGKILLed n1 {t_lost.get('n1', -1):.1f} s, "
      f"partitioned n2 {t_lost.get('n2', -1):.1f} s (lease 8 s, renewed every 2 s)", flush=True)
check("SIGKILLed node declared lost within 10 s", 0 < t_lost.get("n1", 99) <= 10, t_lost)
check("partitioned node declared lost within 10 s", 0 < t_lost.get("n2", 99) <= 10, t_lost)
gone = on["n1"] + on["n2"]
check("their sandboxes are gone for the API (both replicas)",
      all(info_gone("r1", s) and info_gone("r2", s) for s in gone), gone)
reasons = []
for s in gone:
    ev = [e for e in events_of("r1", s) if e.get("type") == "sandbox.lifecycle.killed"]
    reasons.append(ev[-1].get("eventData", {}).get("death_reason") if ev else None)
check("each has a killed event with reason node_lost", reasons == ["node_lost"] * len(gone), reasons)
after = []
for k in range(4):
    t1 = time.monotonic()
    s = create("r2" if k % 2 else "r1")
    after.append(s)
check("creates after the loss succeed, all on n3", all(owner_of(s.sandbox_id) == "n3" for s in after),
      [owner_of(s.sandbox_id) for s in after])
survivor = connect("r2", on["n3"][0])
survivor.files.write("/tmp/after-loss", "still here")
check("the surviving node's sandboxes still work", survivor.files.read("/tmp/after-loss") == "still here")

# --- the partitioned node comes back: fenced, re-registered, old sandboxes gone ------
old_epoch = before["n2"]["epoch"]
in_ns("n2", "ip", "link", "set", "eth0", "up")
t1 = time.monotonic()
back = None
while time.monotonic() - t1 < 15:
    st = nodes()["n2"]
    if st["state"] == "active" and st["epoch"] > old_epoch + 1:
        back = st
        break
    time.sleep(0.2)
check("partitioned node re-registers under a new epoch", back is not None, nodes()["n2"])
if back:
    print(f"     n2 back after {time.monotonic() - t1:.1f} s: epoch {old_epoch} -> {back['epoch']}", flush=True)
time.sleep(0.5)
check("the fenced node no longer has its old sandboxes", not any(node_has("n2", s) for s in on["n2"]),
      [s for s in on["n2"] if node_has("n2", s)])

# --- drain n3: its sandboxes paused, creates land elsewhere -------------------------
d = subprocess.run([BIN, "node", "drain", "n3", "--database", DB, "--node-token-file",
                    os.environ["CUBICLE_NODE_TOKEN_FILE"]], capture_output=True, text=True)
print("     " + d.stdout.strip().replace("\n", "\n     "), flush=True)
check("drain exits 0", d.returncode == 0, d.stderr)
n3_ids = on["n3"] + [s.sandbox_id for s in after]
time.sleep(0.7)  # the replicas' next poll of n3
states = {}
for s in n3_ids:
    resp = httpx.get(f"{R['r1'][0]}/sandboxes/{s}", headers={"X-API-KEY": KEY}, timeout=5)
    states[s] = resp.json().get("state") if resp.status_code == 200 else resp.status_code
check("the drained node's sandboxes are listed as paused", set(states.values()) == {"paused"}, states)
check("node list shows n3 draining", nodes()["n3"]["state"] == "draining")
late = [create("r1"), create("r2")]
check("creates after the drain land on n2, none on n3", all(owner_of(s.sandbox_id) == "n2" for s in late),
      [owner_of(s.sandbox_id) for s in late])
resumed = connect("r1", on["n3"][0])
check("a paused sandbox of the drained node resumes on connect, files intact",
      resumed.files.read("/tmp/after-loss") == "still here")

# --- node restart: n3 (draining, paused sandboxes, one resumed) adopts what it owns ----
n3_before = nodes()["n3"]
work = os.environ["CUBICLE_E2E_WORK"]
os.kill(int(os.environ["CUBICLE_N3_PID"]), signal.SIGTERM)
t1 = time.monotonic()
while time.monotonic() - t1 < 60:
    try:
        if open(f"/proc/{os.environ['CUBICLE_N3_PID']}/stat").read().split(") ")[1][0] == "Z":
            break
        time.sleep(0.1)
    except (FileNotFoundError, ProcessLookupError):
        break
with open(f"{work}/n3.out", "a") as out, open(f"{work}/n3.log", "a") as log:
    p = subprocess.Popen(json.loads(os.environ["CUBICLE_N3_CMD"]), stdout=out, stderr=log, start_new_session=True)
open(f"{work}/n3.pid", "w").write(str(p.pid))
t1 = time.monotonic()
while time.monotonic() - t1 < 30 and open(f"{work}/n3.out").read().count("cubicle node: ready") < 2:
    time.sleep(0.1)
n3_after = nodes()["n3"]
check("a restarted node registers under a new epoch and stays draining",
      n3_after["epoch"] == n3_before["epoch"] + 1 and n3_after["state"] == "draining", (n3_before, n3_after))
adopted = connect("r2", on["n3"][0])
check("its sandboxes are adopted: a resumed one still serves files, a paused one stays paused",
      adopted.files.read("/tmp/after-loss") == "still here"
      and httpx.get(f"{R['r1'][0]}/sandboxes/{on['n3'][1]}", headers={"X-API-KEY": KEY}).json().get("state") == "paused")

# --- replica restart: replica 2 comes back and serves what exists -----------------------
r2_pid = int(os.environ["CUBICLE_R2_PID"])
os.kill(r2_pid, signal.SIGTERM)
t1 = time.monotonic()
while time.monotonic() - t1 < 30:
    try:
        if open(f"/proc/{r2_pid}/stat").read().split(") ")[1][0] == "Z":
            break
        time.sleep(0.1)
    except (FileNotFoundError, ProcessLookupError):
        break
with open(f"{work}/r2b.out", "w") as out, open(f"{work}/r2.log", "a") as log:
    p = subprocess.Popen(json.loads(os.environ["CUBICLE_R2_CMD"]), stdout=out, stderr=log, start_new_session=True)
open(f"{work}/r2.pid", "w").write(str(p.pid))
t1 = time.monotonic()
while time.monotonic() - t1 < 30 and "cubicle: ready" not in open(f"{work}/r2b.out").read():
    time.sleep(0.1)
url = [l.split("=", 1)[1].strip() for l in open(f"{work}/r2b.out") if l.startswith("export E2B_API_URL=")]
check("replica 2 restarts", bool(url), open(f"{work}/r2b.out").read())
if url:
    R["r2"] = (url[0], url[0])
    again = connect("r2", late[0].sandbox_id)
    again.files.write("/tmp/z", "after restart")
    check("the restarted replica serves a sandbox made before (via the other replica)",
          again.files.read("/tmp/z") == "after restart")
    ids_r2 = {s.sandbox_id for s in Sandbox.list(api_key=KEY, api_url=R["r2"][0]).next_items()}
    check("and lists the cluster's sandboxes", {s.sandbox_id for s in late} <= ids_r2, ids_r2)

for s in after + late + [resumed]:
    try:
        s.kill()
    except Exception:
        pass
for s in on["n3"]:
    try:
        Sandbox.kill(s, api_key=KEY, api_url=R["r1"][0])
    except Exception:
        pass

finish()
