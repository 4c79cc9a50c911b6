"""The official Python SDK against two API replicas coordinated through PostgreSQL, over
two `cubicle node`s sharing an object store (tests/e2e/cluster/lost_paused.sh starts them
and sets the environment): a paused sandbox outlives the loss of its node. One sandbox
(a file, a process holding a secret only in its memory) is paused through the API,
another pauses at its end time, a third keeps running, all on one node; that node is
SIGKILLed; once its lease ran out the running one is reported ended, the paused ones
stay listed as paused, and `Sandbox.connect` through the other replica resumes each on
the other node with its file and its process. The lost node restarted never resumes
them: one owner."""

import json
import os
import re
import signal
import subprocess
import time
import uuid

import httpx
from e2b import Sandbox, SandboxQuery, SandboxState

from checks import check, finish, secret_dump, start_holder, wait_for

KEY = os.environ["E2B_API_KEY"]
R = {
    "r1": (os.environ["CUBICLE_R1_API"], os.environ["CUBICLE_R1_SANDBOX"]),
    "r2": (os.environ["CUBICLE_R2_API"], os.environ["CUBICLE_R2_SANDBOX"]),
}
BIN = os.environ["CUBICLE_BIN"]
DB = os.environ["CUBICLE_E2E_DB"]
WORK = os.environ["CUBICLE_E2E_WORK"]
STATE = os.environ["CUBICLE_E2E_STATE"]
TEMPLATE = os.environ.get("CUBICLE_E2E_LOST_TEMPLATE", "base")
TOKEN = open(os.environ["CUBICLE_NODE_TOKEN_FILE"]).read().strip()
NODE_ADDR = {f"n{i}": f"http://10.79.0.1{i}:3100" for i in (1, 2)}


def create(r, **kw):
    api, sbx = R[r]
    kw.setdefault("timeout", 300)
    return Sandbox.create(TEMPLATE, api_key=KEY, api_url=api, sandbox_url=sbx, **kw)


def connect(r, sid):
    api, sbx = R[r]
    return Sandbox.connect(sid, timeout=300, api_key=KEY, api_url=api, sandbox_url=sbx)


def state_via(r, sid):
    api, _ = R[r]
    resp = httpx.get(f"{api}/sandboxes/{sid}", headers={"X-API-KEY": KEY}, timeout=30)
    return resp.json().get("state") if resp.status_code == 200 else resp.status_code


def listed(r, state):
    """Sandbox id → state for every `state` sandbox `Sandbox.list` shows through replica `r`."""
    api, _ = R[r]
    pages = Sandbox.list(query=SandboxQuery(state=[state]), api_key=KEY, api_url=api)
    seen = {}
    while pages.has_next:
        seen.update({s.sandbox_id: s.state.value for s in pages.next_items()})
    return seen


def nodes():
    out = subprocess.run([BIN, "node", "list", "--database", DB, "--format", "json"],
                         check=True, capture_output=True, text=True).stdout
    return {n["nodeID"]: n for n in json.loads(out)}


def node_has(node, sid):
    try:
        r = httpx.get(f"{NODE_ADDR[node]}/node/v1/sandboxes/{sid}",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json().get("state") != "dead"


def owner_of(sid):
    return next((n for n in ("n1", "n2") if node_has(n, sid)), None)


def restart(node):
    """Starts `node` again with its command line (the harness's pid file follows it) and
    checks it is ready."""
    cmd = json.loads(os.environ[f"CUBICLE_{node.upper()}_CMD"])
    with open(os.path.join(WORK, f"{node}.log"), "ab") as log, open(os.path.join(WORK, f"{node}b.out"), "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=log)
    with open(os.path.join(WORK, f"{node}.pid"), "w") as f:
        f.write(str(proc.pid))
    check(f"{node} restarted", wait_for(lambda: "ready" in open(os.path.join(WORK, f"{node}b.out")).read(), 120))


def published_line(node, sid):
    """The node's log line saying it published `sid` (after a pause), or None."""
    try:
        for line in open(os.path.join(WORK, f"{node}.log"), errors="replace"):
            if "paused sandbox published" in line and sid in line:
                return line.strip()
    except FileNotFoundError:
        pass
    return None


# --- 1. On one node: a sandbox paused through the API (file, process), one that pauses
# at its end time, one that keeps running.
sbx = create("r1")
sid = sbx.sandbox_id
# The list is one service's too: the other replica lists a create at once, not at its
# next poll of the nodes.
t0 = time.monotonic()
check("listed running through the other replica at once", listed("r2", SandboxState.RUNNING).get(sid) == "running")
print(f"     the list through the other replica (polls both nodes first) took {1000 * (time.monotonic() - t0):.1f} ms")
victim = owner_of(sid)
other = {"n1": "n2", "n2": "n1"}.get(victim)
check("placed on a node", victim is not None, victim)
extra, auto, running = [], None, None
for _ in range(8):
    if auto and running:
        break
    if auto is None:
        x = create("r1", timeout=6, lifecycle={"on_timeout": "pause"})
    else:
        x = create("r1")
    if owner_of(x.sandbox_id) != victim:
        extra.append(x)
    elif auto is None:
        auto = x
    else:
        running = x
check("an auto-pausing and a running sandbox on the same node", auto is not None and running is not None)
note = f"survives its node {uuid.uuid4()}"
sbx.files.write("/home/user/note.txt", note)
orig, pid_before = start_holder(sbx)
if auto:
    auto.files.write("/home/user/auto.txt", "paused at its end time")

t0 = time.monotonic()
sbx.pause()
print(f"     pause through the replica (with the publish) took {1000 * (time.monotonic() - t0):.0f} ms", flush=True)
check("listed paused through the other replica at once", listed("r2", SandboxState.PAUSED).get(sid) == "paused")
check("  and no longer listed running there", sid not in listed("r2", SandboxState.RUNNING))
line = published_line(victim, sid)
check("published before the pause answered", line is not None)
if line:
    fields = dict(re.findall(r"(\w+)=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", line)))
    print(f"     of which the publish: {float(fields.get('took_ms', 'nan')):.0f} ms, "
          f"{int(fields.get('bytes', 0)) / 1e6:.2f} MB uploaded")
if auto:
    check("the auto-paused sandbox is published too", wait_for(lambda: published_line(victim, auto.sandbox_id), 40))
    check("  and listed paused", state_via("r1", auto.sandbox_id) == "paused", state_via("r1", auto.sandbox_id))

# --- 2. Its node is SIGKILLed; the lease runs out.
os.kill(int(os.environ[f"CUBICLE_{victim.upper()}_PID"]), signal.SIGKILL)
t_kill = time.monotonic()
check(f"{victim} declared lost", wait_for(lambda: nodes()[victim]["state"] == "lost", 20))
print(f"     {victim} lost {time.monotonic() - t_kill:.1f} s after SIGKILL", flush=True)
if running:
    check("the running sandbox is reported ended (404 on both replicas)",
          wait_for(lambda: state_via("r1", running.sandbox_id) == 404 and state_via("r2", running.sandbox_id) == 404, 10),
          (state_via("r1", running.sandbox_id), state_via("r2", running.sandbox_id)))
check("the paused one stays listed paused, through the other replica", state_via("r2", sid) == "paused",
      state_via("r2", sid))
if auto:
    check("the auto-paused one too", state_via("r2", auto.sandbox_id) == "paused", state_via("r2", auto.sandbox_id))
paused_now = listed("r2", SandboxState.PAUSED)
check("the list through the other replica shows them paused (owned by no node now)",
      paused_now.get(sid) == "paused" and (not auto or paused_now.get(auto.sandbox_id) == "paused"), paused_now)
if running:
    check("  and not the ended one", running.sandbox_id not in listed("r1", SandboxState.RUNNING))

# --- 3. Sandbox.connect through the other replica resumes each on the other node.
t0 = time.monotonic()
sbx2 = connect("r2", sid)
moved_ms = 1000 * (time.monotonic() - t0)
print(f"     connect after {victim} was lost (resume on {other}) took {moved_ms:.0f} ms", flush=True)
check(f"resumed on {other}", owner_of(sid) == other and sbx2.is_running(), owner_of(sid))
check("file came along", sbx2.files.read("/home/user/note.txt") == note)
check("process alive with its pid", sbx2.commands.run(f"kill -0 {pid_before} && echo alive").stdout.strip() == "alive")
check("process memory intact (secret held only in memory)", secret_dump(sbx2) == orig, orig)
check("running through the first replica too", state_via("r1", sid) == "running", state_via("r1", sid))
if auto:
    a2 = connect("r1", auto.sandbox_id)
    check(f"the auto-paused one resumed on {other}", owner_of(auto.sandbox_id) == other
          and a2.files.read("/home/user/auto.txt") == "paused at its end time", owner_of(auto.sandbox_id))
owners = {n["nodeID"]: n["sandboxes"] for n in nodes().values()}
print(f"     sandboxes per node in the database: {owners}")

# --- 4. The lost node comes back (same name): it never resumes them.
restart(victim)
check(f"{victim} active again", wait_for(lambda: nodes()[victim]["state"] == "active", 10))
gone = [s for s in [sid] + ([auto.sandbox_id] if auto else [])
        if os.path.isdir(os.path.join(f"{STATE}-{victim}", "sandboxes", s)) or node_has(victim, s)]
check(f"{victim} released its copies", not gone, gone)
r = httpx.post(f"{NODE_ADDR[victim]}/node/v1/sandboxes/{sid}/resume", json={"timeoutMs": 60000},
               headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
check(f"{victim} refuses to resume it", r.status_code == 404, (r.status_code, r.text[:200]))
time.sleep(1.2)  # replicas poll the node that came back
check(f"still served by {other} through both replicas",
      sbx2.commands.run("cat /home/user/note.txt").stdout == note and owner_of(sid) == other
      and state_via("r1", sid) == "running" and state_via("r2", sid) == "running")

# --- 5. Its new node dies too, and a connect comes before its lease ran out: the move is
# claimed in the database (one owner), and the node's later expiry does not end it.
note2 = sbx2.commands.run("cat /home/user/note.txt").stdout
sbx2.pause()
check(f"published on {other}", wait_for(lambda: published_line(other, sid), 10))
time.sleep(1.2)  # replica 1 polls the node and sees it paused
os.kill(int(os.environ[f"CUBICLE_{other.upper()}_PID"]), signal.SIGKILL)
t0 = time.monotonic()
sbx3 = connect("r1", sid)
print(f"     connect right after {other} was SIGKILLed (before its lease ran out) took "
      f"{1000 * (time.monotonic() - t0):.0f} ms", flush=True)
check(f"resumed on {victim}", owner_of(sid) == victim and sbx3.files.read("/home/user/note.txt") == note2,
      owner_of(sid))
check("same process", sbx3.commands.run(f"kill -0 {pid_before} && echo alive").stdout.strip() == "alive")
check(f"{other} declared lost", wait_for(lambda: nodes()[other]["state"] == "lost", 20))
time.sleep(1.5)  # the replicas' expiry and polls after the loss
check("still running through both replicas after the expiry",
      state_via("r1", sid) == "running" and state_via("r2", sid) == "running",
      (state_via("r1", sid), state_via("r2", sid)))
check(f"owned by {victim} in the database", nodes()[victim]["sandboxes"] >= 1, nodes()[victim])
# (back, so that it releases its copy: the cleanup must not touch the moved sandbox)
restart(other)
check(f"{other} released its copy", not os.path.isdir(os.path.join(f"{STATE}-{other}", "sandboxes", sid)))
check("still served", sbx3.commands.run("echo here").stdout == "here\n")
sbx2 = sbx3

for s in [sbx2] + ([a2] if auto else []) + extra:
    try:
        s.kill()
    except Exception as e:  # noqa: BLE001 (a cleanup)
        print(f"     kill {s.sandbox_id}: {e}")

finish()
