"""Wire-protocol details the SDKs depend on (spec §3.2–3.6), checked over raw HTTP
and through the SDK where the SDK exposes them: stream framing and content type,
start-first / end-last ordering, keepalives, deadlines, exited-process retention,
StreamInput, /health, /envs, /metrics, ENOSPC → 507."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import httpx
import pytest
from e2b import CommandExitException, NotEnoughSpaceException, PtySize, Sandbox

from helpers import end_error, stream, unary

ENVD = os.environ.get("CUBICLE_ENVD_URL", "http://localhost:49983")


def events_of(envs):
    return [m["event"] for f, m in envs if not f & 2]


def test_start_stream_framing():
    r, envs = stream(
        ENVD,
        "process.Process/Start",
        {"process": {"cmd": "/bin/sh", "args": ["-c", "echo out; echo err >&2; exit 3"]}, "stdin": False},
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json", "no parameters allowed (Python SDK)"
    assert "content-encoding" not in r.headers or r.headers["content-encoding"] == "identity"
    assert end_error(envs) is None
    assert envs[-1][0] & 2, "end-of-stream envelope last"
    evs = events_of(envs)
    assert list(evs[0]) == ["start"] and evs[0]["start"]["pid"] > 0
    assert list(evs[-1]) == ["end"]
    end = evs[-1]["end"]
    assert end["exitCode"] == 3 and end["exited"] is True
    assert end.get("status") == "exit status 3"
    assert sum(1 for e in evs if "end" in e) == 1
    data = [e["data"] for e in evs if "data" in e]
    assert {"stdout": "b3V0Cg=="} in data and {"stderr": "ZXJyCg=="} in data


def test_exit_zero_omits_default_fields():
    r, envs = stream(ENVD, "process.Process/Start", {"process": {"cmd": "/bin/true"}, "stdin": False})
    end = events_of(envs)[-1]["end"]
    assert end.get("exitCode", 0) == 0 and end["exited"] is True
    assert "error" not in end


def test_keepalive_after_interval():
    r, envs = stream(
        ENVD,
        "process.Process/Start",
        {"process": {"cmd": "/bin/sleep", "args": ["2.6"]}, "stdin": False},
        headers={"Keepalive-Ping-Interval": "1"},
    )
    evs = events_of(envs)
    keepalives = [e for e in evs if "keepalive" in e]
    assert len(keepalives) >= 1, evs
    assert "start" in evs[0] and "end" in evs[-1]


def test_connect_timeout_ms_is_the_process_lifetime():
    t0 = time.monotonic()
    r, envs = stream(
        ENVD,
        "process.Process/Start",
        {"process": {"cmd": "/bin/sleep", "args": ["20"]}, "stdin": False},
        headers={"Connect-Timeout-Ms": "700"},
    )
    assert time.monotonic() - t0 < 5
    err = end_error(envs)
    assert err and err["code"] == "deadline_exceeded", envs
    pid = events_of(envs)[0]["start"]["pid"]
    time.sleep(0.3)
    listed = unary(ENVD, "process.Process/List", {}).json().get("processes", [])
    assert pid not in [p["pid"] for p in listed]


def test_exited_process_can_still_be_connected(sbx: Sandbox):
    h = sbx.commands.run("echo retained; exit 4", background=True)
    with pytest.raises(CommandExitException):
        h.wait()
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.connect(h.pid).wait()
    assert ei.value.exit_code == 4
    assert h.pid not in [p.pid for p in sbx.commands.list()], "exited processes are not listed"


def test_stream_input(sbx: Sandbox):
    h = sbx.commands.run("cat; echo END", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, ["one ", b"two ", "three\n"])
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "one two three\nEND\n"


def test_pty_stream_input(sbx: Sandbox):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    try:
        sbx.pty.stream_input(h.pid, [b"echo $((40", b"+2))-streamed\n", b"exit 0\n"])
        out = bytearray()
        r = h.wait(on_pty=out.extend)
        assert r.exit_code == 0
        assert b"42-streamed" in out
    finally:
        sbx.pty.kill(h.pid)


def test_health_envs_metrics():
    r = httpx.get(f"{ENVD}/health")
    assert r.status_code == 204 and r.content == b""
    envs = httpx.get(f"{ENVD}/envs")
    assert envs.status_code == 200 and isinstance(envs.json(), dict)
    m = httpx.get(f"{ENVD}/metrics")
    assert m.status_code == 200
    body = m.json()
    for k in ("ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "disk_used", "disk_total"):
        assert k in body, k
    assert body["cpu_count"] >= 1 and body["mem_total"] > body["mem_used"] > 0


def test_unary_error_shape():
    r = unary(ENVD, "filesystem.Filesystem/Stat", {"path": f"/nonexistent-{uuid.uuid4().hex}"})
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["code"] == "not_found" and r.json()["message"]


@pytest.fixture
def tiny_fs():
    """A 1 MiB tmpfs (in the test's private mount namespace) to run out of space."""
    path = f"/tmp/cb-tiny-{uuid.uuid4().hex[:8]}"
    os.makedirs(path)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "cb-tiny", path]).returncode != 0:
        os.rmdir(path)
        pytest.skip("cannot mount a tmpfs here (needs root in the test mount namespace)")
    yield path
    subprocess.run(["umount", path], check=False)
    os.rmdir(path)


def test_no_space_is_507(sbx: Sandbox, tiny_fs: str):
    with pytest.raises(NotEnoughSpaceException):
        sbx.files.write(f"{tiny_fs}/big.bin", os.urandom(3 * 1024 * 1024))
    r = httpx.post(
        f"{ENVD}/files",
        params={"path": f"{tiny_fs}/raw.bin"},
        content=b"\0" * (3 * 1024 * 1024),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 507, r.status_code
    assert r.json()["code"] == 507
    assert httpx.get(f"{ENVD}/health").status_code == 204


def test_signal_end_event_fields():
    r, envs = stream(ENVD, "process.Process/Start", {"process": {"cmd": "/bin/sh", "args": ["-c", "kill -TERM $$"]}, "stdin": False})
    end = events_of(envs)[-1]["end"]
    assert end["exitCode"] == -1
    assert end.get("exited", False) is False
    assert end["status"] == "signal: terminated"
