"""The official Python SDK against an API replica whose sandboxes live on a `cubicle
node` (tests/e2e/cluster/run.sh sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
CUBICLE_NODE_PID). Core paths: create, commands.run with streamed output, files
write/read, presigned upload/download URLs (no routing headers), list, kill; then, with
the node stopped, the replica's errors keep E2B's shape."""

import os
import signal
import sys
import time
import uuid

import httpx
from e2b import Sandbox

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f": {detail}" if detail and not cond else ""))
    if not cond:
        failures.append(name)


t0 = time.monotonic()
sbx = Sandbox.create("base", timeout=120, metadata={"suite": "cluster"})
check("create", sbx.is_running(), sbx.sandbox_id)
print(f"     create took {1000 * (time.monotonic() - t0):.1f} ms")

out = []
r = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done; echo err >&2",
                     on_stdout=lambda m: out.append((time.monotonic(), m)))
check("commands.run exit code", r.exit_code == 0, r)
check("commands.run stdout", r.stdout == "line1\nline2\nline3\n", repr(r.stdout))
check("commands.run stderr", r.stderr == "err\n", repr(r.stderr))
# streamed: the lines arrived spread over the 0.4 s the command took, not at once
spread = out[-1][0] - out[0][0] if len(out) >= 2 else 0
check("commands.run streams", len(out) >= 2 and spread > 0.25, f"{len(out)} chunks over {spread:.2f}s")

p = f"/home/user/c-{uuid.uuid4().hex[:8]}.txt"
sbx.files.write(p, "written through the replica")
check("files write/read", sbx.files.read(p) == "written through the replica")
blob = os.urandom(3 << 20)
sbx.files.write("/tmp/blob.bin", blob)
check("files 3 MiB round trip", sbx.files.read("/tmp/blob.bin", format="bytes") == blob)

url = sbx.download_url(p)
r = httpx.get(url, timeout=15)
check("presigned download", r.status_code == 200 and r.text == "written through the replica",
      (r.status_code, r.text))
r = httpx.get(url.replace("signature=v1_", "signature=v1_x"), timeout=15)
check("presigned download, bad signature refused", 400 <= r.status_code < 500, r.status_code)
up = f"/home/user/u-{uuid.uuid4().hex[:8]}/up.txt"
r = httpx.post(sbx.upload_url(up), files={"file": ("f.txt", b"uploaded via url")}, timeout=15)
check("presigned upload", r.status_code == 200 and sbx.files.read(up) == "uploaded via url",
      (r.status_code, r.text))

host = sbx.get_host(8000)
check("get_host names the sandbox", sbx.sandbox_id in host, host)

ids = [s.sandbox_id for s in Sandbox.list().next_items()]
check("list", sbx.sandbox_id in ids, ids)
info = sbx.get_info()
check("info metadata", info.metadata.get("suite") == "cluster", info.metadata)

sbx.set_timeout(300)
check("set_timeout", sbx.is_running())

sbx.kill()
check("kill", not sbx.is_running())
ids = [s.sandbox_id for s in Sandbox.list().next_items()]
check("list after kill", sbx.sandbox_id not in ids, ids)

# The node goes away: a create must fail with an E2B-shaped body naming the node.
sbx2 = Sandbox.create("base", timeout=60)
os.kill(int(os.environ["CUBICLE_NODE_PID"]), signal.SIGKILL)
time.sleep(0.5)
r = httpx.post(f"{API}/sandboxes", headers={"X-API-KEY": KEY}, json={"templateID": "base"}, timeout=30)
body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
check("create with the node down: E2B error shape",
      r.status_code >= 500 and body.get("code") == r.status_code and "node" in body.get("message", ""),
      (r.status_code, r.text))
r = httpx.get(f"{API}/health", headers={"E2b-Sandbox-Id": sbx2.sandbox_id, "E2b-Sandbox-Port": "49983"},
              timeout=30)
body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
check("data plane with the node down: 502, E2B shape, names the node",
      r.status_code == 502 and body.get("code") == 502 and "unreachable" in body.get("message", ""),
      (r.status_code, r.text))

print(f"{len(failures)} failure(s)" + (": " + ", ".join(failures) if failures else ""))
sys.exit(1 if failures else 0)
