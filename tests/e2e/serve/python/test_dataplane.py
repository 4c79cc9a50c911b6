"""The data plane through `cubicle serve`'s router with the sync Python SDK: commands,
envs, users, files, PTY, watchers, a web server inside the sandbox reached like
`get_host(8000)`, signed download/upload URLs opened without routing headers, and the
router's own error answers."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid

import httpx
import pytest

from conftest import DOMAIN, SANDBOX_URL, Tracker, poll
from e2b import CommandExitException, FilesystemEventType, PtySize, Sandbox
from e2b.exceptions import (
    FileNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)


def test_commands_run_echo(sbx: Sandbox):
    r = sbx.commands.run("echo hi")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "", 0)
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo oops >&2; exit 3")
    assert ei.value.exit_code == 3 and ei.value.stderr == "oops\n"


def test_envs_create_time_and_per_command(sbx: Sandbox):
    r = sbx.commands.run('echo "$CUBICLE_E2E_GLOBAL|$PER_CMD|$E2B_SANDBOX|$E2B_SANDBOX_ID"', envs={"PER_CMD": "x y"})
    assert r.stdout == f"from-create|x y|true|{sbx.sandbox_id}\n"
    r = sbx.commands.run('echo "$CUBICLE_E2E_GLOBAL"', envs={"CUBICLE_E2E_GLOBAL": "overridden"})
    assert r.stdout == "overridden\n"


def test_identity_files(sbx: Sandbox):
    # As upstream envd writes them, naming what the env vars name (envd writes them at
    # its start, and the create's /init with the same ids writes nothing).
    r = sbx.commands.run(
        "cd /run/e2b && cat .E2B_SANDBOX .E2B_SANDBOX_ID .E2B_TEMPLATE_ID && echo \"|$E2B_TEMPLATE_ID\""
    )
    template = r.stdout.rsplit("|", 1)[-1].strip()
    assert template, r.stdout
    assert r.stdout == f"true{sbx.sandbox_id}{template}|{template}\n", r.stdout


def test_user_default_vs_root(sbx: Sandbox):
    assert sbx.commands.run("whoami; pwd").stdout == "user\n/home/user\n"
    assert sbx.commands.run("whoami; id -u", user="root").stdout == "root\n0\n"


def test_background_command_and_kill(sbx: Sandbox):
    h = sbx.commands.run("sleep 300", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_files_write_read_list(sbx: Sandbox):
    d = f"/home/user/f-{uuid.uuid4().hex[:8]}"
    info = sbx.files.write(f"{d}/a.txt", "abc")
    assert info.path == f"{d}/a.txt" and info.name == "a.txt"
    sbx.files.write(f"{d}/b.bin", b"\x00\x01\xff")
    assert sbx.files.read(f"{d}/a.txt") == "abc"
    assert bytes(sbx.files.read(f"{d}/b.bin", format="bytes")) == b"\x00\x01\xff"
    assert sorted(e.name for e in sbx.files.list(d)) == ["a.txt", "b.bin"]
    assert sbx.files.exists(f"{d}/a.txt")
    assert sbx.files.get_info(f"{d}/a.txt").owner == "user"
    sbx.files.write(f"/root/r-{uuid.uuid4().hex[:6]}", "as root", user="root")
    sbx.files.remove(d)
    assert not sbx.files.exists(d)
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{d}/a.txt")


def test_files_large_roundtrip_streams(sbx: Sandbox):
    """48 MiB up and down through the router (chunked upload, streamed download)."""
    data = os.urandom(48 * 1024 * 1024)
    p = f"/tmp/big-{uuid.uuid4().hex[:8]}.bin"
    sbx.files.write(p, data)
    try:
        assert sbx.commands.run(f"sha256sum {p} | cut -d' ' -f1").stdout.strip() == hashlib.sha256(data).hexdigest()
        got = sbx.files.read(p, format="bytes")
        assert hashlib.sha256(bytes(got)).hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        sbx.files.remove(p)


def test_pty_echo(sbx: Sandbox):
    buf = bytearray()
    lock = threading.Lock()
    h = sbx.pty.create(PtySize(rows=24, cols=80))

    def reader():
        try:
            h.wait(on_pty=lambda b: (lock.acquire(), buf.extend(b), lock.release()))
        except Exception:
            pass

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        sbx.pty.send_stdin(h.pid, b"echo pty-$((6*7))-ok; whoami\n")
        assert poll(lambda: b"pty-42-ok" in bytes(buf), timeout=15), bytes(buf)
        assert poll(lambda: b"user" in bytes(buf).split(b"pty-42-ok", 1)[-1], timeout=5), bytes(buf)
        sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(h.pid, b"stty size\n")
        assert poll(lambda: b"30 100" in bytes(buf), timeout=10), bytes(buf)
    finally:
        sbx.pty.kill(h.pid)
        t.join(10)


def test_watch_dir_event(sbx: Sandbox):
    d = f"/home/user/w-{uuid.uuid4().hex[:8]}"
    sbx.files.make_dir(d)
    h = sbx.files.watch_dir(d)
    try:
        sbx.files.write(f"{d}/new.txt", "x")
        events = []

        def seen():
            events.extend(h.get_new_events())
            return any(e.name == "new.txt" and e.type in (FilesystemEventType.CREATE, FilesystemEventType.WRITE) for e in events)

        assert poll(seen, timeout=10), events
    finally:
        h.stop()


def _start_http_server(sbx: Sandbox):
    d = f"/tmp/www-{uuid.uuid4().hex[:6]}"
    sbx.files.write(f"{d}/hello.txt", "hello from inside the sandbox\n")
    return sbx.commands.run(f"cd {d} && exec python3 -m http.server 8000", background=True)


def test_get_host_http_server(sbx: Sandbox):
    """`get_host(8000)` names `8000-<id>.<domain>`; a user reaches the port by sending
    the request to E2B_SANDBOX_URL with the routing headers, or with that Host (what a
    client resolving the name to the server sends; test_fidelity.py resolves it)."""
    host = sbx.get_host(8000)
    assert host.startswith(f"8000-{sbx.sandbox_id}."), host
    handle = _start_http_server(sbx)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}

        def fetch():
            r = httpx.get(f"{SANDBOX_URL}/hello.txt", headers=headers, timeout=10)
            return r if r.status_code == 200 else None

        r = poll(fetch, timeout=20, interval=0.3)
        assert r is not None, "python3 -m http.server 8000 never answered through the router"
        assert r.text == "hello from inside the sandbox\n"
        # directory listing (another path, streamed HTML)
        r = httpx.get(f"{SANDBOX_URL}/", headers=headers, timeout=10)
        assert r.status_code == 200 and "hello.txt" in r.text
        if DOMAIN:
            r = httpx.get(f"{SANDBOX_URL}/hello.txt", headers={"Host": f"8000-{sbx.sandbox_id}.{DOMAIN}"}, timeout=10)
            assert r.status_code == 200 and r.text == "hello from inside the sandbox\n", (r.status_code, r.text)
            assert sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.{DOMAIN}"
    finally:
        handle.kill()


def test_port_not_open_and_unknown_sandbox_answers(sbx: Sandbox):
    r = httpx.get(f"{SANDBOX_URL}/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8999"}, timeout=15)
    assert r.status_code == 502, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == 502 and "port is not open" in body["message"], body
    missing = "i" + "1" * 20
    r = httpx.get(f"{SANDBOX_URL}/health", headers={"E2b-Sandbox-Id": missing, "E2b-Sandbox-Port": "49983"}, timeout=15)
    assert r.status_code == 502, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == 502 and "was not found" in body["message"], body


def test_envd_requires_access_token(sbx: Sandbox):
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    r = httpx.get(f"{SANDBOX_URL}/files", params={"path": "/etc/hostname"}, headers=headers, timeout=15)
    assert r.status_code == 401, (r.status_code, r.text)
    r = httpx.get(f"{SANDBOX_URL}/files", params={"path": "/etc/hostname"},
                  headers={**headers, "X-Access-Token": "wrong"}, timeout=15)
    assert r.status_code == 401, (r.status_code, r.text)


def test_internal_envd_routes_refused(sbx: Sandbox):
    """`/init` (which sets the access token and env) must never be reachable from outside."""
    token = sbx._envd_access_token  # what the SDK sends as X-Access-Token
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = token
    r = httpx.post(f"{SANDBOX_URL}/init", headers=headers, json={"accessToken": "pwned", "envVars": {"X": "1"}}, timeout=15)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    # the token did not change: the SDK still works
    assert sbx.commands.run("echo still-mine").stdout == "still-mine\n"


def test_download_url_plain_http_client(sbx: Sandbox):
    p = f"/home/user/dl-{uuid.uuid4().hex[:8]}.txt"
    sbx.files.write(p, "download me")
    url = sbx.download_url(p)
    assert url.startswith(SANDBOX_URL + "/files?"), url
    assert "signature=" in url
    r = httpx.get(url, timeout=15)  # no routing headers, no token: like curl or a browser
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.text == "download me"
    r = httpx.get(sbx.download_url(p, use_signature_expiration=60), timeout=15)
    assert r.status_code == 200 and r.text == "download me"
    r = httpx.get(url.replace("signature=v1_", "signature=v1_x"), timeout=15)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)


def test_upload_url_plain_http_client(sbx: Sandbox):
    p = f"/home/user/ul-{uuid.uuid4().hex[:8]}/up.txt"
    url = sbx.upload_url(p)
    r = httpx.post(url, files={"file": ("local.txt", b"uploaded without headers")}, timeout=15)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.json()[0]["path"] == p
    assert sbx.files.read(p) == "uploaded without headers"
    assert sbx.files.get_info(p).owner == "user"


def test_dataplane_after_kill(sandboxes: Tracker):
    s = sandboxes.create()
    assert s.commands.run("true").exit_code == 0
    s.kill()
    assert s.is_running() is False
    with pytest.raises((SandboxNotRunningException, TimeoutException)) as ei:
        s.commands.run("echo gone")
    assert isinstance(ei.value, SandboxNotRunningException), repr(ei.value)
    with pytest.raises(SandboxNotRunningException):
        s.files.read("/etc/hostname")


def test_chunked_multipart_uploads_back_to_back(sbx: Sandbox):
    """What the JS SDK (undici) sends for files.write: a chunked multipart body whose
    chunked terminator may come a moment after the closing boundary. 160 uploads back to
    back on one keep-alive client connection must all succeed through the router (envd
    answers as soon as it has seen the closing boundary; the router must not then reuse
    an upstream connection envd is closing)."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
               "Content-Type": "multipart/form-data; boundary=cbBOUNDARY"}
    if sbx._envd_access_token:
        headers["X-Access-Token"] = sbx._envd_access_token
    failures = []
    n = 0
    with httpx.Client(timeout=15) as c:
        for delay in (0, 0.001, 0.002, 0.005):
            for i in range(40):
                n += 1

                def body(i=i, delay=delay):
                    yield (b'--cbBOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n'
                           b"Content-Type: application/octet-stream\r\n\r\n" + f"chunk-{i}".encode() + b"\r\n"
                           b"--cbBOUNDARY--\r\n")
                    if delay:
                        time.sleep(delay)

                try:
                    r = c.post(f"{SANDBOX_URL}/files", params={"path": f"/tmp/chunked-{i}.txt"},
                               content=body(), headers=headers)
                    if r.status_code != 200:
                        failures.append((delay, i, r.status_code, r.text[:160]))
                except httpx.HTTPError as e:
                    failures.append((delay, i, "transport", repr(e)[:160]))
    assert not failures, f"{len(failures)}/{n} uploads failed: {failures[:3]}"


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.timeout(600)
def test_large_transfers_are_streamed(sbx: Sandbox):
    """512 MiB down and 512 MiB up through the router with plain httpx streaming: the
    server's RSS must not grow by anything near the size (no buffering)."""
    import os as _os

    pid = int(_os.environ.get("CUBICLE_E2E_SERVER_PID") or 0)
    if not pid:
        pytest.skip("CUBICLE_E2E_SERVER_PID not set (run through run.sh)")
    size = 512 * 1024 * 1024
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    if sbx._envd_access_token:
        headers["X-Access-Token"] = sbx._envd_access_token
    p = f"/tmp/huge-{uuid.uuid4().hex[:6]}"
    sbx.commands.run(f"head -c {size} /dev/zero > {p}", user="root")
    base = _rss_kib(pid)
    peak = base
    try:
        got = 0
        with httpx.stream("GET", f"{SANDBOX_URL}/files", params={"path": p}, headers=headers, timeout=120) as r:
            assert r.status_code == 200, r.status_code
            for chunk in r.iter_raw(1 << 20):
                got += len(chunk)
                if got % (32 << 20) < (1 << 20):
                    peak = max(peak, _rss_kib(pid))
        assert got == size or r.headers.get("content-encoding"), (got, size)

        def body():
            nonlocal peak
            block = b"\0" * (1 << 20)
            for i in range(size >> 20):
                if i % 32 == 0:
                    peak = max(peak, _rss_kib(pid))
                yield block

        up = f"/tmp/huge-up-{uuid.uuid4().hex[:6]}"
        r = httpx.post(f"{SANDBOX_URL}/files", params={"path": up}, headers={**headers, "Content-Type": "application/octet-stream"},
                       content=body(), timeout=300)
        assert r.status_code == 200, (r.status_code, r.text[:200])
        assert sbx.commands.run(f"stat -c %s {up}").stdout.strip() == str(size)
        sbx.commands.run(f"rm -f {up}", user="root")
    finally:
        sbx.commands.run(f"rm -f {p}", user="root")
    grew_mib = (peak - base) / 1024
    print(f"\nserver RSS {base / 1024:.0f} MiB → peak {peak / 1024:.0f} MiB during 2×512 MiB transfers")
    assert grew_mib < 128, f"server RSS grew by {grew_mib:.0f} MiB while streaming 512 MiB: buffering?"
