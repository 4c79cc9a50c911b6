"""A busy sandbox paused and resumed many times over (CUBICLE_E2E_PAUSE_CYCLES, default
100), through the official Python SDK: a writer appends numbered records to a file all
the time, a background command started through the SDK prints ticks, an HTTP server
counts requests in its memory and is reached through the router, and a shell starts a
command every 10 ms (`dash` starts them with `vfork`: a pause must never hang on one
caught half-started, nor on a task forked while the cgroup freezes).

After every resume the server answers with the next number from the same process, the
writer has gone on writing, and the sandbox is running (no state stuck half-way). At the
end not one record is missing, duplicated or torn (0 lost bytes), the background command
is still the same process and still streams, and the launcher's leak check finds nothing
of the sandbox left once it is killed. Resumes alternate between `connect` (instance and
class) and the router's auto-resume on a request to the paused sandbox."""

from __future__ import annotations

import os
import time

import httpx

from conftest import SANDBOX_URL, Tracker, poll
from e2b import Sandbox, SandboxState

CYCLES = int(os.environ.get("CUBICLE_E2E_PAUSE_CYCLES", "100"))
RECORD = 65  # bytes per record: "%08d " (9) + 55 x "x" + "\n"

WRITER = r"""
import os, signal, time
stop = False
def on_term(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, on_term)
fd = os.open("/home/user/stream.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
n = 0
while not stop:
    os.write(fd, b"%08d %s\n" % (n + 1, b"x" * 55))
    n += 1
    time.sleep(0.005)
with open("/home/user/stream.count", "w") as f:
    f.write(str(n))
"""

CHECK = r"""
import sys
n = int(open("/home/user/stream.count").read())
data = open("/home/user/stream.log", "rb").read()
want = b"".join(b"%08d %s\n" % (i, b"x" * 55) for i in range(1, n + 1))
if data == want:
    print(f"ok {n} {len(data)}")
else:
    k = next((i for i in range(min(len(data), len(want))) if data[i] != want[i]), min(len(data), len(want)))
    print(f"bad records={n} size={len(data)} want={len(want)} first difference at byte {k}: {data[k-70:k+70]!r}")
"""

COUNTER = r"""
import http.server, itertools, os
count = itertools.count(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{next(count)} {os.getpid()}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8790), H).serve_forever()
"""


def via_router(sandbox_id: str, timeout: float = 60) -> tuple[int, int]:
    """A request to the sandbox's HTTP server through the router, as a browser would send
    it; resumes the sandbox if it is paused (auto-resume)."""
    r = httpx.get(
        f"{SANDBOX_URL}/",
        headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8790"},
        timeout=timeout,
    )
    if r.status_code != 200:
        # What the sandbox looks like right then, and whether it is only late.
        sbx = Sandbox.connect(sandbox_id)
        listening = sbx.commands.run("ss -ltn; ps -eo pid,stat,args", timeout=30).stdout
        again = httpx.get(
            f"{SANDBOX_URL}/",
            headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8790"},
            timeout=timeout,
        )
        raise AssertionError(f"{r.status_code} {r.text}; retried: {again.status_code} {again.text}\n{listening}")
    n, pid = r.text.split()
    return int(n), int(pid)


def test_busy_sandbox_survives_many_pause_resume_cycles(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=3600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sid = sbx.sandbox_id
    sbx.files.write("/tmp/writer.py", WRITER)
    sbx.files.write("/tmp/counter.py", COUNTER)
    # timeout=0: no deadline (the SDK's default of 60 s would have envd kill them then).
    sbx.commands.run("python3 /tmp/writer.py", background=True, timeout=0)
    sbx.commands.run("python3 /tmp/counter.py", background=True, timeout=0)
    sbx.commands.run("sh -c 'while :; do sleep 0.01; done'", background=True, timeout=0)
    ticker = sbx.commands.run(
        "bash -c 'i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done'", background=True, timeout=0
    )
    assert poll(lambda: sbx.commands.run("curl -sf localhost:8790 || true").stdout.strip(), timeout=30)
    n, pid = via_router(sid)
    size = 0

    started = time.monotonic()
    for cycle in range(CYCLES):
        where = f"cycle {cycle + 1}/{CYCLES}"
        if cycle % 2 == 0:
            assert sbx.pause() is True, where
        else:
            Sandbox.pause(sid)
        assert Sandbox.get_info(sid).state == SandboxState.PAUSED, where
        if cycle % 3 == 0:
            sbx.connect(timeout=3600)
        elif cycle % 3 == 1:
            Sandbox.connect(sid, timeout=3600)
        # else: the request below finds it paused; the router resumes it.
        n2, pid2 = via_router(sid)
        assert (n2, pid2) == (n + 1, pid), f"{where}: the server lost its memory ({n2}, {pid2}) vs ({n}, {pid})"
        n = n2
        assert Sandbox.get_info(sid).state == SandboxState.RUNNING, where
        # The writer goes on (it is not only alive, it writes after the resume).
        new_size = int(
            poll(
                lambda: (s := sbx.commands.run("stat -c %s /home/user/stream.log").stdout.strip())
                and int(s) > size
                and s,
                timeout=20,
            )
            or 0
        )
        assert new_size > size, f"{where}: the writer stopped at {size} bytes"
        size = new_size
    per_cycle = (time.monotonic() - started) / max(CYCLES, 1)
    print(f"{CYCLES} pause/resume cycles, {per_cycle:.2f} s each (SDK round trips and checks)")

    # The background command started through the SDK is the same process and still streams.
    assert ticker.pid in [p.pid for p in sbx.commands.list()]
    handle = sbx.commands.connect(ticker.pid)
    ticks = []
    for stdout, _, _ in handle:
        if stdout:
            ticks += [int(t) for t in stdout.split()[1::2]]
        if len(ticks) >= 2:
            break
    # Started over, it would count from 1 again (it has run for many seconds).
    assert len(ticks) >= 2 and ticks[0] > 10, f"the ticker restarted or stopped: {ticks}"
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), ticks
    assert sbx.commands.kill(ticker.pid) is True

    # Not one record lost, duplicated or torn.
    sbx.commands.run("pkill -TERM -f '^python3 /tmp/writer.py'")
    assert poll(lambda: sbx.commands.run("test -s /home/user/stream.count && echo y || true").stdout.strip(), timeout=30)
    sbx.files.write("/tmp/check.py", CHECK)
    out = sbx.commands.run("python3 /tmp/check.py", timeout=120).stdout.strip()
    assert out.startswith("ok "), out
    records, nbytes = map(int, out.split()[1:])
    assert nbytes == records * RECORD and nbytes >= size, out

    assert Sandbox.kill(sid) is True
    assert [s for s in Sandbox.list().next_items() if s.sandbox_id == sid] == []
