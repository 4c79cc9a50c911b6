"""Stateful sandboxes through `cubicle serve` with the official Python SDK (sync and
async): pause and resume with memory (processes, their memory, background commands,
files come back), filesystem-only pause, auto-pause and auto-resume, snapshots (create,
list, create a sandbox from one, delete), fork, Cubicle's rollback, team isolation, and
a full disk failing a pause cleanly.

Every check is what a user would see: a counter kept only in a process's memory goes on
counting after a resume; a file written before is there after; a fork has the parent's
state and its own id and token, and the parent runs on."""

from __future__ import annotations

import os
import time

import pytest

from conftest import API_KEY, KEY_B, Tracker, api, poll, unique
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import NotFoundException, SandboxException, SandboxNotFoundException

# A process whose state lives only in memory: a number it increments and prints on
# demand (HTTP), so only a restored process can answer a continued count.
COUNTER_SERVER = r"""
import http.server, itertools, os, sys
count = itertools.count(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{next(count)} {os.getpid()}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture(autouse=True)
def snapshots_removed_afterwards():
    """Whatever a test does (or fails to do), the snapshots it made go afterwards: they
    outlive sandboxes by design, and the launcher's leak check counts them."""
    before = {s.snapshot_id for s in Sandbox.list_snapshots().next_items()}
    yield
    for s in Sandbox.list_snapshots().next_items():
        if s.snapshot_id not in before:
            Sandbox.delete_snapshot(s.snapshot_id)


def start_counter(sbx, port: int = 8765) -> None:
    sbx.files.write("/tmp/counter.py", COUNTER_SERVER)
    # timeout=0: no deadline (envd kills a command at its deadline, 60 s by default).
    sbx.commands.run(f"python3 /tmp/counter.py {port}", background=True, timeout=0)
    poll(lambda: sbx.commands.run(f"curl -sf localhost:{port} || true").stdout.strip(), timeout=20)


def read_counter(sbx, port: int = 8765) -> tuple[int, int]:
    out = sbx.commands.run(f"curl -sf localhost:{port}").stdout.split()
    return int(out[0]), int(out[1])


def state_of(sandbox_id: str, key: str = API_KEY) -> str:
    return Sandbox.get_info(sandbox_id, api_key=key).state


def test_pause_and_resume_keep_processes_memory_and_files(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/notes.txt", "before the pause\n")
    start_counter(sbx)
    n1, pid = read_counter(sbx)
    oom_score_adj = f"cat /proc/{pid}/oom_score_adj"
    # envd makes what it starts the OOM killer's likelier victim (500)...
    assert sbx.commands.run(oom_score_adj).stdout.strip() == "500"
    assert sbx.pause() is True
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.state == SandboxState.PAUSED
    assert sbx.is_running() is False
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in paused]
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in running]
    # A second pause: the SDK reports it was already paused.
    assert sbx.pause() is False

    # The instance's connect keeps its old access token: tokens are stable.
    sbx.connect(timeout=300)
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    assert sbx.is_running() is True
    n2, pid2 = read_counter(sbx)
    assert (pid2, n2) == (pid, n1 + 1), "the counter process was restored with its memory"
    # ...and CRIU restores that score (a raise: no CAP_SYS_RESOURCE needed).
    assert sbx.commands.run(oom_score_adj).stdout.strip() == "500"
    assert sbx.files.read("/home/user/notes.txt") == "before the pause\n"
    assert sbx.commands.run("echo alive").stdout == "alive\n"
    # envd's socket came back where it was, in a ctl directory read-only again for the
    # sandbox's root (CRIU needs it writable to bind the socket: docs/checkpoint.md).
    ctl = sbx.commands.run(
        "test -S /run/cubicle/ctl/envd.sock && echo socket; "
        "touch /run/cubicle/ctl/planted 2>&1; mkdir /run/cubicle/ctl/d 2>&1; true",
        user="root",
    ).stdout
    assert ctl.startswith("socket\n"), ctl
    assert ctl.count("Read-only file system") == 2, ctl


def test_class_connect_resumes_and_extends(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=120)
    sbx.commands.run("echo kept > /tmp/kept")
    Sandbox.pause(sbx.sandbox_id)
    assert state_of(sbx.sandbox_id) == "paused"
    again = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert again.sandbox_id == sbx.sandbox_id
    assert again.commands.run("cat /tmp/kept").stdout == "kept\n"
    info = Sandbox.get_info(sbx.sandbox_id)
    assert (info.end_at - info.started_at).total_seconds() > 500 or (
        info.end_at.timestamp() - time.time() > 500
    ), info
    # Connecting to a running sandbox only extends it.
    assert Sandbox.connect(sbx.sandbox_id, timeout=60).sandbox_id == sbx.sandbox_id
    assert state_of(sbx.sandbox_id) == "running"


def test_filesystem_pause_keeps_files_and_reboots(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/disk.txt", "on disk")
    start_counter(sbx, 8766)
    assert sbx.pause(mode="filesystem") is True
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    sbx.connect()
    assert sbx.files.read("/home/user/disk.txt") == "on disk"
    r = sbx.commands.run("curl -sf localhost:8766 || echo gone")
    assert r.stdout.strip() == "gone", "a filesystem pause does not keep processes"


def test_connect_with_reboot_cold_boots(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/a.txt", "x")
    start_counter(sbx, 8767)
    sbx.pause()
    again = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert again.files.read("/home/user/a.txt") == "x"
    assert again.commands.run("curl -sf localhost:8767 || echo gone").stdout.strip() == "gone"


def test_kill_a_paused_sandbox(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=120)
    sbx.pause()
    assert Sandbox.kill(sbx.sandbox_id) is True
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_kill_during_a_pause_waits_for_it_and_kills(sandboxes: Tracker):
    """A kill that arrives while the sandbox is being paused (an auto-pause at its end
    time, another client's pause) is not refused: it waits for the pause, then kills."""
    import threading

    sbx = sandboxes.create(timeout=120)
    # 200 MB that only a checkpoint can keep: the pause takes a while to write them.
    sbx.commands.run(
        "python3 -c 'import os,time; b=os.urandom(200<<20); open(\"/tmp/held\",\"w\").close(); time.sleep(10**6)'",
        background=True, timeout=0)
    assert poll(lambda: sbx.files.exists("/tmp/held"), timeout=30)
    paused: list = []
    t = threading.Thread(target=lambda: paused.append(sbx.pause()))
    t.start()
    # Writing 200 MB takes the pause well over a second here (2 s measured): 0.3 s in,
    # it is under way on the server.
    time.sleep(0.3)
    assert t.is_alive(), "the pause ended before the kill could overlap it (too fast to test)"
    # A request of its own (the SDK's client would queue it behind the pause on its one
    # pooled connection): it reaches the server while the pause runs.
    r = api("DELETE", f"/sandboxes/{sbx.sandbox_id}")
    assert r.status_code == 204, f"{r.status_code} {r.text}"
    t.join(60)
    assert paused == [True]
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


def test_auto_pause_then_auto_resume(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sbx.commands.run("echo 41 > /tmp/answer")
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.lifecycle == {"auto_resume": True, "on_timeout": "pause"}, info.lifecycle
    assert poll(lambda: state_of(sbx.sandbox_id) == "paused", timeout=30), "not paused at its end time"
    # A request through the data plane resumes it transparently.
    r = sbx.commands.run("echo $(( $(cat /tmp/answer) + 1 ))")
    assert r.stdout == "42\n"
    assert state_of(sbx.sandbox_id) == "running"


def test_auto_pause_without_auto_resume(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=3, lifecycle={"on_timeout": "pause"})
    assert poll(lambda: state_of(sbx.sandbox_id) == "paused", timeout=30)
    assert sbx.is_running() is False
    with pytest.raises(Exception):
        sbx.commands.run("true", request_timeout=10)
    assert state_of(sbx.sandbox_id) == "paused"
    sbx.connect()
    assert sbx.commands.run("echo back").stdout == "back\n"


def test_snapshot_create_from_list_delete(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/state.txt", "snapshotted")
    start_counter(sbx, 8768)
    n0, pid = read_counter(sbx, 8768)
    snap = sbx.create_snapshot()
    assert snap.snapshot_id and snap.snapshot_id.endswith(":default"), snap
    assert snap.names == []
    # The source runs on.
    assert sbx.is_running()
    assert read_counter(sbx, 8768)[0] == n0 + 1
    ids = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    assert snap.snapshot_id in ids
    child = sandboxes.create(snap.snapshot_id, timeout=120)
    assert child.sandbox_id != sbx.sandbox_id
    assert child.files.read("/home/user/state.txt") == "snapshotted"
    n1, pid1 = read_counter(child, 8768)
    assert (pid1, n1) == (pid, n0 + 1), "the child starts from the snapshot's memory"
    assert child.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == child.sandbox_id
    # Independent afterwards.
    child.files.write("/home/user/state.txt", "changed in the child")
    assert sbx.files.read("/home/user/state.txt") == "snapshotted"
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    # The child made from it is not affected.
    assert child.files.read("/home/user/state.txt") == "changed in the child"


def test_named_filesystem_snapshot(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/fs.txt", "fs only")
    name = f"snap-{unique()}"
    snap = sbx.create_snapshot(name=name, mode="filesystem")
    assert snap.snapshot_id.endswith(f"/{name}:default"), snap
    assert snap.names == [snap.snapshot_id]
    found = Sandbox.list_snapshots(name=name).next_items()
    assert [s.snapshot_id for s in found] == [snap.snapshot_id]
    child = sandboxes.create(snap.snapshot_id, timeout=120)
    assert child.files.read("/home/user/fs.txt") == "fs only"
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True


def test_fork(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/parent.txt", "from the parent")
    start_counter(sbx, 8769)
    n0, pid = read_counter(sbx, 8769)
    forks = sbx.fork(count=3, timeout=120)
    assert len(forks) == 3
    for f in forks:
        assert isinstance(f, Sandbox), f
        sandboxes.track(f.sandbox_id)
    ids = {f.sandbox_id for f in forks}
    assert len(ids) == 3 and sbx.sandbox_id not in ids
    infos = [Sandbox.get_info(f.sandbox_id) for f in forks]
    assert all(i.state == SandboxState.RUNNING for i in infos)
    for f in forks:
        assert f.files.read("/home/user/parent.txt") == "from the parent"
        n, p = read_counter(f, 8769)
        assert (p, n) == (pid, n0 + 1), "each fork continues from the parent's memory"
        assert f.commands.run("hostname").stdout.strip() == f.sandbox_id
        ids_file = f.commands.run("cat /run/e2b/.E2B_SANDBOX_ID").stdout
        assert ids_file == f.sandbox_id, "a fork's identity file names the fork"
    forks[0].files.write("/home/user/parent.txt", "changed in a fork")
    assert sbx.files.read("/home/user/parent.txt") == "from the parent"
    assert sbx.is_running() and read_counter(sbx, 8769)[0] == n0 + 1
    # Each fork has its own envd token: another fork's is refused.
    r = api("GET", "/health")
    assert r.status_code == 200


SUDO_CHECK = "sudo -n id -u"


def assert_sudo_works(sbx, where: str) -> None:
    """`sudo` (setuid root) works for the default user, as in any fresh sandbox."""
    r = sbx.commands.run(f"{SUDO_CHECK} 2>&1; true")
    assert r.stdout == "0\n", f"sudo {where}: {r.stdout!r}"


def test_setuid_programs_work_after_resume_in_forks_and_from_snapshots(sandboxes: Tracker):
    """A restored sandbox's root filesystem honours setuid bits like a fresh one's: `sudo`
    works after a resume, in a fork and in a sandbox made from a memory snapshot (the
    kernel ignores setuid on a mount owned by a user namespace that is not the caller's
    or an ancestor of it)."""
    sbx = sandboxes.create(timeout=300)
    assert_sudo_works(sbx, "after create")
    assert sbx.pause() is True
    sbx.connect(timeout=300)
    assert_sudo_works(sbx, "after pause and resume")
    forks = sbx.fork(count=1, timeout=120)
    for f in forks:
        sandboxes.track(f.sandbox_id)
        assert_sudo_works(f, "in a fork")
    snap = sbx.create_snapshot()
    child = sandboxes.create(snap.snapshot_id, timeout=120)
    assert_sudo_works(child, "in a sandbox made from a memory snapshot")
    assert_sudo_works(sbx, "in the snapshot's source")


def test_fork_of_a_paused_sandbox_conflicts(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=120)
    sbx.pause()
    with pytest.raises(SandboxException) as e:
        Sandbox.fork(sbx.sandbox_id)
    assert "409" in str(e.value) or getattr(e.value, "status_code", 409) == 409


def test_rollback_in_place(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=300)
    sbx.files.write("/home/user/doc.txt", "version 1")
    start_counter(sbx, 8770)
    n0, pid = read_counter(sbx, 8770)
    snap = sbx.create_snapshot()
    sbx.files.write("/home/user/doc.txt", "version 2")
    sbx.commands.run("kill $(pgrep -f '^python3 /tmp/counter.py')")
    r = api("POST", f"/sandboxes/{sbx.sandbox_id}/rollback", json={"snapshotID": snap.snapshot_id})
    assert r.status_code == 200, r.text
    assert r.json()["sandboxID"] == sbx.sandbox_id
    assert sbx.files.read("/home/user/doc.txt") == "version 1"
    assert read_counter(sbx, 8770) == (n0 + 1, pid)
    Sandbox.delete_snapshot(snap.snapshot_id)


def test_other_team_sees_nothing(sandboxes: Tracker):
    if not KEY_B:
        pytest.skip("no second team key")
    sbx = sandboxes.create(timeout=120)
    snap = sbx.create_snapshot()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.pause(sbx.sandbox_id, api_key=KEY_B)
    assert state_of(sbx.sandbox_id) == "running"
    assert api("POST", f"/sandboxes/{sbx.sandbox_id}/pause", key=KEY_B).status_code == 404
    assert api("POST", f"/sandboxes/{sbx.sandbox_id}/fork", key=KEY_B, json={}).status_code == 404
    assert api("POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", key=KEY_B, json={}).status_code == 404
    assert snap.snapshot_id not in [
        s.snapshot_id for s in Sandbox.list_snapshots(api_key=KEY_B).next_items()
    ]
    assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=KEY_B) is False
    with pytest.raises(Exception):
        Sandbox.create(snap.snapshot_id, api_key=KEY_B)
    Sandbox.delete_snapshot(snap.snapshot_id)


def test_full_disk_fails_the_pause_cleanly(sandboxes: Tracker):
    """The checkpoint counts against the sandbox's disk quota: with the disk full, the
    pause fails, says why, and the sandbox keeps running untouched."""
    sbx = sandboxes.create(timeout=300)
    start_counter(sbx, 8771)
    n0, pid = read_counter(sbx, 8771)
    # Fill the quota fast: reserve space (no data written) in ever smaller pieces.
    sbx.commands.run(
        "i=0; for s in 4096 2048 1024 512 256 128 64 32 16 8 4 2 1; do "
        "while fallocate -l ${s}M /home/user/fill$i 2>/dev/null; do i=$((i+1)); done; done; "
        "dd if=/dev/zero of=/home/user/fill-last bs=4k 2>/dev/null; true",
        timeout=300,
    )
    assert sbx.commands.run("echo x > /home/user/probe || echo full").stdout.strip() == "full"
    r = api("POST", f"/sandboxes/{sbx.sandbox_id}/pause", json={})
    assert r.status_code == 507, r.text
    assert "disk" in r.json()["message"].lower()
    assert state_of(sbx.sandbox_id) == "running"
    assert read_counter(sbx, 8771) == (n0 + 1, pid)
    sbx.commands.run("rm -f /home/user/fill*")
    assert sbx.pause() is True
    sbx.connect()
    assert read_counter(sbx, 8771) == (n0 + 2, pid)


async def test_async_pause_resume_snapshot_fork(sandboxes: Tracker):
    sbx = await sandboxes.acreate(timeout=300)
    await sbx.files.write("/home/user/async.txt", "async")
    assert await sbx.pause() is True
    assert (await AsyncSandbox.get_info(sbx.sandbox_id)).state == SandboxState.PAUSED
    await sbx.connect()
    assert await sbx.files.read("/home/user/async.txt") == "async"
    snap = await sbx.create_snapshot()
    child = await sandboxes.acreate(snap.snapshot_id, timeout=120)
    assert await child.files.read("/home/user/async.txt") == "async"
    forks = await sbx.fork(count=2, timeout=120)
    for f in forks:
        assert isinstance(f, AsyncSandbox), f
        sandboxes.track(f.sandbox_id)
        assert await f.files.read("/home/user/async.txt") == "async"
    assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is True


@pytest.mark.skipif(os.environ.get("CUBICLE_E2E_SKIP_CI") == "1", reason="CUBICLE_E2E_SKIP_CI=1")
def test_code_interpreter_kernel_survives_pause(sandboxes: Tracker):
    """A live Jupyter kernel that imported numpy and pandas: after a pause and a resume the
    first run_code sees the old variables (the kernel, its ZeroMQ connections to the
    interpreter and their TCP state come back)."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    ci = CodeSandbox.create("code-interpreter-v1", request_timeout=1200, timeout=600)
    sandboxes.track(ci.sandbox_id)
    ex = ci.run_code(
        "import numpy as np, pandas as pd\n"
        "x = 41\n"
        "df = pd.DataFrame({'a': np.arange(3)})\n"
        "int(df['a'].sum())"
    )
    assert ex.error is None and ex.text == "3", ex
    t0 = time.monotonic()
    assert ci.pause() is True
    paused_in = time.monotonic() - t0
    t0 = time.monotonic()
    again = CodeSandbox.connect(ci.sandbox_id)
    resumed_in = time.monotonic() - t0
    ex = again.run_code("x + 1, int(df['a'].sum()), np.__name__")
    assert ex.error is None, ex.error
    assert ex.text == "(42, 3, 'numpy')", ex.text
    print(f"code-interpreter pause {paused_in * 1000:.0f} ms, resume {resumed_in * 1000:.0f} ms (SDK round trips)")
