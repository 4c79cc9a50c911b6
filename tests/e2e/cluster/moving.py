"""The official Python SDK against an API replica over two `cubicle node`s that share an
object store (tests/e2e/cluster/moving.sh sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY
and CUBICLE_*). A paused sandbox resumes on the other node when its node is gone
(SIGKILL) or drained with migration; its files and its processes' memory come along; the
old node never runs it again."""

import os
import shlex
import signal
import statistics
import subprocess
import time
import uuid

import httpx
from e2b import Sandbox

from checks import check, finish, secret_dump, start_holder, wait_for

STATE_A = os.environ["CUBICLE_STATE_A"]
STATE_B = os.environ["CUBICLE_STATE_B"]
WORK = os.environ["CUBICLE_MOVING_WORK"]
TOKEN = open(os.environ["CUBICLE_NODE_TOKEN_FILE"]).read().strip()
NODE_A = "http://127.0.0.2:3100/node/v1"


def on(state, sid):
    return os.path.isdir(os.path.join(state, "sandboxes", sid))


def where(sid):
    # (B first: a SIGKILLed node A keeps its directories until it restarts.)
    return "B" if on(STATE_B, sid) else "A" if on(STATE_A, sid) else "nowhere"


# --- 1. Node A is SIGKILLed while the sandbox is paused: connect resumes it on B.
sbx = Sandbox.create("base", timeout=300)
sid = sbx.sandbox_id
check("created on node A (its warm pool)", where(sid) == "A", where(sid))
note = f"moved with its disk {uuid.uuid4()}"
sbx.files.write("/home/user/note.txt", note)
orig, pid_before = start_holder(sbx)

t0 = time.monotonic()
sbx.pause()
print(f"     pause (with the publish to the object store) took {1000 * (time.monotonic() - t0):.0f} ms")
os.kill(int(os.environ["CUBICLE_NODE_A_PID"]), signal.SIGKILL)

t0 = time.monotonic()
sbx2 = Sandbox.connect(sid, timeout=300)
moved_ms = 1000 * (time.monotonic() - t0)
print(f"     connect after node A was SIGKILLed (resume on node B) took {moved_ms:.0f} ms")
check("resumed on node B", where(sid) == "B" and sbx2.is_running(), where(sid))
check("file came along", sbx2.files.read("/home/user/note.txt") == note)
check("process alive with its pid", sbx2.commands.run(f"kill -0 {pid_before} && echo alive").stdout.strip() == "alive")
check("process memory intact (secret held only in memory)", secret_dump(sbx2) == orig, orig)

# --- 2. Node A comes back: it releases its stale copy before it serves, never resumes it.
with open(os.path.join(WORK, "a.log"), "ab") as log, open(os.path.join(WORK, "a2.out"), "wb") as out:
    a2 = subprocess.Popen(shlex.split(os.environ["CUBICLE_NODE_A_CMD"]), stdout=out, stderr=log)
with open(os.path.join(WORK, "a2.pid"), "w") as f:
    f.write(str(a2.pid))
check("node A restarted", wait_for(lambda: "ready" in open(os.path.join(WORK, "a2.out")).read(), 120))
check("node A released the moved sandbox", not on(STATE_A, sid))
r = httpx.post(f"{NODE_A}/sandboxes/{sid}/resume", json={"timeoutMs": 60000},
               headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
check("node A refuses to resume it", r.status_code == 404, (r.status_code, r.text))
time.sleep(1.2)  # a few polls of the replica over both nodes
check("still served by node B through the replica",
      sbx2.commands.run("cat /home/user/note.txt").stdout == note and where(sid) == "B")
sbx2.kill()

# --- 3. Drain node A with migration: its idle sandboxes resume on B at their next connect.
check("node A up for the replica", wait_for(lambda: httpx.get(
    f"{NODE_A}/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).status_code == 200, 30))
time.sleep(1.0)
idle = [Sandbox.create("base", timeout=300) for _ in range(4)]
on_a = [s for s in idle if where(s.sandbox_id) == "A"]
check("some idle sandboxes on node A", len(on_a) >= 1, [where(s.sandbox_id) for s in idle])
for s in idle:
    s.commands.run("true")  # booted and idle
drain = subprocess.run([os.environ["CUBICLE_BIN"], "node", "evacuate", "--node",
                        "http://127.0.0.2:3100", "--node-token-file", os.environ["CUBICLE_NODE_TOKEN_FILE"]],
                       capture_output=True, text=True, timeout=300)
print("     " + drain.stdout.strip().replace("\n", "\n     "))
check("cubicle node evacuate (drain with migration)", drain.returncode == 0, drain.stderr)
time.sleep(1.0)  # the replica sees the drain in its next poll
z = Sandbox.create("base", timeout=60)
check("no create lands on the draining node", where(z.sandbox_id) == "B", where(z.sandbox_id))
z.kill()
times = []
for s in on_a:
    t0 = time.monotonic()
    c = Sandbox.connect(s.sandbox_id, timeout=300)
    times.append(1000 * (time.monotonic() - t0))
    check(f"{s.sandbox_id} resumed on node B", where(s.sandbox_id) == "B" and
          c.commands.run("echo here").stdout == "here\n", where(s.sandbox_id))
if times:
    print(f"     resume on another node, idle base sandbox (connect through the replica, {len(times)} runs): "
          f"p50 {statistics.median(times):.0f} ms, max {max(times):.0f} ms (target <= 500 ms): "
          + ", ".join(f"{t:.0f}" for t in times))
check("node A keeps none of them", not any(on(STATE_A, s.sandbox_id) for s in on_a))
for s in idle:
    s.kill()
# Undrain and stop the restarted node A (the script cleans up the rest).
httpx.delete(f"{NODE_A}/drain", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)

finish()
