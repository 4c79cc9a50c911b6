"""Bad input against envd over raw HTTP (what the SDKs never send): malformed
JSON, unknown fields, invalid enums, wrong types, `..` and NUL bytes in paths,
2 GiB streamed uploads (memory must stay bounded), a gzip bomb, clients that
drop mid-stream (processes survive, watchers are released) and garbage on the
socket. Each case must give a clear error, keep envd alive and leak nothing."""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
import zlib

import httpx
import pytest
from e2b import Sandbox

from helpers import (
    end_error,
    envelope,
    fd_count,
    hwm_kib,
    inotify_watch_count,
    pid_alive,
    poll,
    rss_kib,
    stream,
    unary,
)

ENVD = os.environ.get("CUBICLE_ENVD_URL", "http://localhost:49983")
PORT = urllib.parse.urlsplit(ENVD).port or 49983
ROOT_AUTH = {"Authorization": "Basic cm9vdDo="}  # root, empty password


def assert_connect_error(r: httpx.Response, code: str, status: int):
    assert r.status_code == status, f"want {status}, got {r.status_code} {r.text!r}"
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    body = r.json()
    assert body.get("code") == code, body
    assert isinstance(body.get("message"), str) and body["message"], body


def assert_healthy():
    assert httpx.get(f"{ENVD}/health", timeout=5).status_code == 204


# --- malformed requests ---------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"", b"[]", b'"a string"', b"{\"path\": \"/\"", b"\xff\xfe\x00garbage", b"null"],
    ids=["broken", "empty", "array", "string", "truncated", "binary", "null"],
)
def test_malformed_json_unary(body):
    r = unary(ENVD, "filesystem.Filesystem/Stat", body, raw=True)
    if body == b"" and r.status_code == 200:
        # an empty unary body may be read as the empty message: then it must mean `{}`
        same = unary(ENVD, "filesystem.Filesystem/Stat", {})
        assert same.status_code == 200 and same.json() == r.json()
        return
    assert r.status_code == 400, f"{r.status_code} {r.text!r}"
    body_json = r.json()
    assert isinstance(body_json.get("code"), str) and body_json.get("message"), body_json
    assert_healthy()


def test_malformed_json_stream():
    bad = b"\x00" + len(b"{oops").to_bytes(4, "big") + b"{oops"
    r, envs = stream(ENVD, "process.Process/Start", bad, raw=True)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json"
    err = end_error(envs)
    assert err and err["code"] == "invalid_argument", envs
    assert not [m for f, m in envs if not f & 2], "no data messages for a bad request"
    assert_healthy()


def test_truncated_stream_envelope():
    payload = json.dumps({"process": {"cmd": "/bin/true"}}).encode()
    bad = b"\x00" + (len(payload) + 100).to_bytes(4, "big") + payload
    r, envs = stream(ENVD, "process.Process/Start", bad, raw=True)
    assert r.status_code == 200
    err = end_error(envs)
    assert err and err["code"] in ("invalid_argument", "internal", "unknown"), envs
    assert_healthy()


def test_deeply_nested_json():
    body = b'{"path":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = unary(ENVD, "filesystem.Filesystem/Stat", body, raw=True)
    assert r.status_code == 400, r.status_code
    assert r.json()["code"] == "invalid_argument"
    assert_healthy()


def test_wrong_field_types():
    assert_connect_error(unary(ENVD, "filesystem.Filesystem/Stat", {"path": 123}), "invalid_argument", 400)
    assert_connect_error(
        unary(ENVD, "filesystem.Filesystem/ListDir", {"path": "/", "depth": "deep"}), "invalid_argument", 400
    )
    assert_connect_error(
        unary(ENVD, "process.Process/SendInput", {"process": {"pid": "abc"}, "input": {"stdin": "aGk="}}),
        "invalid_argument",
        400,
    )
    assert_connect_error(
        unary(ENVD, "process.Process/SendInput", {"process": {"pid": 1}, "input": {"stdin": "not base64!"}}),
        "invalid_argument",
        400,
    )


def test_unknown_fields_are_handled_consistently(sbx: Sandbox):
    plain = unary(ENVD, "filesystem.Filesystem/Stat", {"path": "/etc"})
    assert plain.status_code == 200
    r = unary(ENVD, "filesystem.Filesystem/Stat", {"path": "/etc", "bogusField": {"x": [1, 2]}})
    if r.status_code == 200:
        assert r.json()["entry"]["path"] == plain.json()["entry"]["path"], "unknown field changed the answer"
    else:
        assert_connect_error(r, "invalid_argument", 400)
    assert_healthy()


def test_invalid_enum_values(sbx: Sandbox):
    h = sbx.commands.run("sleep 30", background=True)
    try:
        sel = {"process": {"pid": h.pid}}
        assert_connect_error(
            unary(ENVD, "process.Process/SendSignal", {**sel, "signal": "SIGNAL_BOGUS"}), "invalid_argument", 400
        )
        assert_connect_error(
            unary(ENVD, "process.Process/SendSignal", {**sel, "signal": "SIGNAL_UNSPECIFIED"}), "unimplemented", 501
        )
        assert_connect_error(
            unary(ENVD, "process.Process/SendSignal", {**sel, "signal": 12345}), "invalid_argument", 400
        )
        assert h.pid in [p.pid for p in sbx.commands.list()], "bad signals must not kill"
        # enums by number are valid protobuf JSON: 9 = SIGKILL
        r = unary(ENVD, "process.Process/SendSignal", {**sel, "signal": 9})
        assert r.status_code == 200, r.text
        assert poll(lambda: h.pid not in [p.pid for p in sbx.commands.list()])
    finally:
        sbx.commands.kill(h.pid)


def test_missing_required_selectors():
    assert_connect_error(unary(ENVD, "process.Process/SendInput", {}), "invalid_argument", 400)
    assert_connect_error(unary(ENVD, "process.Process/Update", {"process": {"pid": 999999}}), "not_found", 404)
    r, envs = stream(ENVD, "process.Process/Start", {"process": {"cmd": ""}})
    assert r.status_code == 200
    err = end_error(envs)
    assert err and err["code"] == "invalid_argument", envs


def test_unknown_method_and_wrong_http_method():
    r = unary(ENVD, "process.Process/DoesNotExist", {})
    assert r.status_code in (404, 501), r.status_code
    r = httpx.get(f"{ENVD}/process.Process/List")
    assert r.status_code in (404, 405, 415), r.status_code
    r = httpx.post(f"{ENVD}/process.Process/List", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.status_code
    assert_healthy()


# --- paths: `..` and NUL ------------------------------------------------------------


def test_dotdot_paths_resolve_normally(sbx: Sandbox, home_dir: str):
    sbx.files.write(f"{home_dir}/sub/../dd.txt", "dotdot")
    assert sbx.commands.run(f"cat {home_dir}/dd.txt").stdout == "dotdot"
    assert not sbx.files.exists(f"{home_dir}/sub/dd.txt")
    r = httpx.get(f"{ENVD}/files", params={"path": "/home/user/../../etc/hostname"})
    assert r.status_code == 200
    assert r.content == open("/etc/hostname", "rb").read()
    st = unary(ENVD, "filesystem.Filesystem/Stat", {"path": f"{home_dir}/a/b/../../dd.txt"})
    assert st.status_code == 200 and st.json()["entry"]["path"] == f"{home_dir}/dd.txt", st.text


def test_dotdot_in_upload_paths(sbx: Sandbox, root_dir: str):
    """`..` in ?path= and in multipart filenames resolves like any path (no escape
    beyond what the path names, no literal `..` components created)."""
    name = f"dd-{uuid.uuid4().hex[:8]}"
    r = httpx.post(
        f"{ENVD}/files",
        params={"path": f"/home/user/../..{root_dir}/x/../{name}", "username": "root"},
        files={"file": (name, b"one")},
    )
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == f"{root_dir}/{name}"
    # a relative multipart filename resolves against the acting user's home
    rel = "../.." + root_dir + f"/{name}-2"
    r = httpx.post(f"{ENVD}/files", files={"file": (rel, b"two")})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == f"{root_dir}/{name}-2"
    out = sbx.commands.run(f"cat {root_dir}/{name} {root_dir}/{name}-2; ls -a {root_dir}", user="root").stdout
    assert out.startswith("onetwo")
    assert "x" not in out.split()[1:], "no intermediate `x` directory may be created"


@pytest.mark.parametrize("path", ["/etc\x00/passwd", "/home/user/a\x00b", "\x00"], ids=["mid", "file", "only"])
def test_nul_bytes_in_paths(path):
    assert_connect_error(unary(ENVD, "filesystem.Filesystem/Stat", {"path": path}), "invalid_argument", 400)
    assert_connect_error(unary(ENVD, "filesystem.Filesystem/MakeDir", {"path": path}), "invalid_argument", 400)
    assert_connect_error(unary(ENVD, "filesystem.Filesystem/ListDir", {"path": path}), "invalid_argument", 400)
    assert_connect_error(
        unary(ENVD, "filesystem.Filesystem/Move", {"source": path, "destination": "/tmp/x"}), "invalid_argument", 400
    )
    r, envs = stream(ENVD, "filesystem.Filesystem/WatchDir", {"path": path})
    err = end_error(envs)
    assert err and err["code"] == "invalid_argument", envs
    r = httpx.get(f"{ENVD}/files", params={"path": path})
    assert r.status_code == 400, r.status_code
    assert r.json()["code"] == 400
    r = httpx.post(f"{ENVD}/files", params={"path": path}, content=b"x", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400, r.status_code
    assert_healthy()


def test_nul_bytes_in_command():
    for cfg in (
        {"cmd": "/bin/echo", "args": ["a\x00b"]},
        {"cmd": "/bin/ec\x00ho"},
        {"cmd": "/bin/true", "envs": {"A\x00": "b"}},
        {"cmd": "/bin/true", "envs": {"A=B": "c"}},
        {"cmd": "/bin/true", "cwd": "/tm\x00p"},
    ):
        r, envs = stream(ENVD, "process.Process/Start", {"process": cfg})
        assert r.status_code == 200
        err = end_error(envs)
        assert err and err["code"] == "invalid_argument", (cfg, envs)
    assert_healthy()


def test_bad_username():
    r = httpx.get(f"{ENVD}/files", params={"path": "/etc/hostname", "username": "no-such-user"})
    assert r.status_code == 401, r.status_code
    assert r.json()["code"] == 401
    r = unary(ENVD, "filesystem.Filesystem/Stat", {"path": "/"}, headers={"Authorization": "Basic !!!notbase64"})
    assert r.status_code in (400, 401), r.status_code
    assert_healthy()


# --- big and hostile uploads -----------------------------------------------------------

GIB = 1024 * 1024 * 1024
CHUNK = b"\xa5" * (1024 * 1024)


class RssSampler:
    """Samples envd's VmRSS every 100 ms on a thread."""

    def __init__(self, pid: int):
        self.pid = pid
        self.max_kib = rss_kib(pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.1):
            try:
                self.max_kib = max(self.max_kib, rss_kib(self.pid))
            except (OSError, RuntimeError):
                return

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.max_kib


def _gen(total: int):
    sent = 0
    while sent < total:
        n = min(len(CHUNK), total - sent)
        yield CHUNK[:n]
        sent += n


def _upload_2gib(envd_pid: int, scratch_dir: str, multipart: bool):
    path = f"{scratch_dir}/big-{'mp' if multipart else 'raw'}-{uuid.uuid4().hex[:6]}.bin"
    before = rss_kib(envd_pid)
    sampler = RssSampler(envd_pid)
    t0 = time.monotonic()
    try:
        if multipart:
            boundary = "cubicle" + uuid.uuid4().hex
            head = (
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path}\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            tail = f"\r\n--{boundary}--\r\n".encode()

            def body():
                yield head
                yield from _gen(2 * GIB)
                yield tail

            r = httpx.post(
                f"{ENVD}/files",
                params={"username": "root"},
                content=body(),
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
                timeout=600,
            )
        else:
            r = httpx.post(
                f"{ENVD}/files",
                params={"path": path, "username": "root"},
                content=_gen(2 * GIB),
                headers={"Content-Type": "application/octet-stream"},
                timeout=600,
            )
        elapsed = time.monotonic() - t0
        peak = sampler.stop()
        assert r.status_code == 200, f"{r.status_code} {r.text[:300]!r}"
        assert r.json()[0]["path"] == path
        assert os.path.getsize(path) == 2 * GIB
        with open(path, "rb") as f:
            f.seek(GIB + 12345)
            assert f.read(4) == b"\xa5" * 4
        growth_mib = (peak - before) / 1024
        print(f"2 GiB {'multipart' if multipart else 'octet-stream'} upload: {elapsed:.1f}s, "
              f"envd RSS {before / 1024:.1f} → peak {peak / 1024:.1f} MiB (VmHWM {hwm_kib(envd_pid) / 1024:.1f} MiB)")
        assert growth_mib < 128, f"envd RSS grew by {growth_mib:.0f} MiB during a streamed upload"
    finally:
        sampler.stop()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    assert_healthy()


def test_2gib_octet_stream_upload_bounded_memory(envd_pid: int, scratch_dir: str):
    _upload_2gib(envd_pid, scratch_dir, multipart=False)


def test_2gib_multipart_upload_bounded_memory(envd_pid: int, scratch_dir: str):
    _upload_2gib(envd_pid, scratch_dir, multipart=True)


def test_gzip_bomb_upload_streams(envd_pid: int, scratch_dir: str):
    """1 GiB of zeros, ~1 MiB gzipped: must be decompressed while streaming to disk."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz:
        zero = b"\x00" * (1024 * 1024)
        for _ in range(1024):
            gz.write(zero)
    compressed = buf.getvalue()
    path = f"{scratch_dir}/bomb-{uuid.uuid4().hex[:6]}"
    sampler = RssSampler(envd_pid)
    before = sampler.max_kib
    try:
        r = httpx.post(
            f"{ENVD}/files",
            params={"path": path, "username": "root"},
            content=compressed,
            headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
            timeout=300,
        )
        peak = sampler.stop()
        assert r.status_code in (200, 400, 413, 507), r.status_code
        if r.status_code == 200:
            assert os.path.getsize(path) == GIB
        assert (peak - before) / 1024 < 128, f"RSS grew {(peak - before) / 1024:.0f} MiB"
    finally:
        sampler.stop()
        if os.path.exists(path):
            os.unlink(path)
    # a corrupt gzip body is a clear 400, not a 500 or a hang
    r = httpx.post(
        f"{ENVD}/files",
        params={"path": f"{scratch_dir}/corrupt", "username": "root"},
        content=b"\x1f\x8b\x08\x00garbage-not-deflate" * 10,
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 400, r.status_code
    if os.path.exists(f"{scratch_dir}/corrupt"):
        os.unlink(f"{scratch_dir}/corrupt")
    assert_healthy()


def test_upload_dropped_midway(envd_pid: int, scratch_dir: str):
    """A client that dies after 20 MiB of a declared 1 GiB body: envd stays healthy, frees the fd."""
    fds_before = fd_count(envd_pid)
    path = f"{scratch_dir}/dropped-{uuid.uuid4().hex[:6]}"
    s = socket.create_connection(("127.0.0.1", PORT))
    q = urllib.parse.urlencode({"path": path, "username": "root"})
    s.sendall(
        f"POST /files?{q} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {GIB}\r\n\r\n".encode()
    )
    for _ in range(20):
        s.sendall(CHUNK)
    s.close()
    assert poll(lambda: fd_count(envd_pid) <= fds_before + 1, timeout=10), (
        f"envd fds {fds_before} → {fd_count(envd_pid)} after a dropped upload"
    )
    assert_healthy()
    if os.path.exists(path):
        os.unlink(path)


def test_unsupported_upload_content_type():
    r = httpx.post(f"{ENVD}/files", params={"path": "/tmp/x"}, content=b"x", headers={"Content-Type": "text/csv"})
    assert r.status_code == 400, r.status_code
    assert r.json()["code"] == 400


def test_multipart_duplicate_paths_rejected(home_dir: str):
    p = f"{home_dir}/dup.txt"
    r = httpx.post(f"{ENVD}/files", files=[("file", (p, b"1")), ("file", (p, b"2"))])
    assert r.status_code == 400, f"{r.status_code} {r.text!r}"


def test_bad_metadata_rejected(home_dir: str):
    r = httpx.post(
        f"{ENVD}/files",
        params={"path": f"{home_dir}/m"},
        content=b"x",
        headers={"Content-Type": "application/octet-stream", "X-Metadata-" + "k" * 300: "v"},
    )
    assert r.status_code == 400, r.status_code


# --- clients that go away ---------------------------------------------------------------


def _raw_stream_open(path: str, msg: dict, headers: dict | None = None) -> tuple[socket.socket, bytes]:
    body = envelope(msg)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
    s.sendall(
        (
            f"POST /{path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/connect+json\r\n"
            f"Connect-Protocol-Version: 1\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        ).encode()
        + body
    )
    got = b""
    deadline = time.monotonic() + 10
    while b'"start"' not in got and time.monotonic() < deadline:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return s, got


def test_process_survives_client_disconnect(sbx: Sandbox):
    s, got = _raw_stream_open(
        "process.Process/Start",
        {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "sleep 2; echo survived"]}, "stdin": False},
    )
    m = re.search(rb'"pid"\s*:\s*(\d+)', got)
    assert m, got
    pid = int(m.group(1))
    s.close()
    time.sleep(0.3)
    assert pid in [p.pid for p in sbx.commands.list()], "process must survive its client"
    assert pid_alive(pid)
    r = sbx.commands.connect(pid).wait()
    assert r.stdout == "survived\n"


def test_connect_stream_dropped_keeps_process(sbx: Sandbox):
    h = sbx.commands.run("sleep 3; echo ok", background=True)
    h.disconnect()
    s, got = _raw_stream_open("process.Process/Connect", {"process": {"pid": h.pid}})
    assert b'"start"' in got, got
    s.close()
    time.sleep(0.2)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.connect(h.pid).wait().stdout == "ok\n"


def test_watch_dropped_releases_inotify(envd_pid: int, home_dir: str):
    base = inotify_watch_count(envd_pid)
    fds = fd_count(envd_pid)
    socks = []
    for recursive in (False, True) * 5:
        s, got = _raw_stream_open(
            "filesystem.Filesystem/WatchDir", {"path": home_dir, "recursive": recursive}
        )
        assert b'"start"' in got, got
        socks.append(s)
    during = inotify_watch_count(envd_pid)
    assert during[1] > base[1], f"no inotify watches while 10 watches are open: {base} → {during}"
    for s in socks:
        s.close()
    assert poll(lambda: inotify_watch_count(envd_pid)[1] <= base[1], timeout=10), (
        f"inotify watches leaked after clients dropped: {base} → {inotify_watch_count(envd_pid)}"
    )
    assert poll(lambda: fd_count(envd_pid) <= fds + 1, timeout=10), f"fds {fds} → {fd_count(envd_pid)}"


def test_sync_watcher_removed_releases_inotify(sbx: Sandbox, envd_pid: int, home_dir: str):
    base = inotify_watch_count(envd_pid)
    handles = [sbx.files.watch_dir(home_dir, recursive=True) for _ in range(5)]
    assert inotify_watch_count(envd_pid)[1] > base[1]
    for h in handles:
        h.stop()
    assert poll(lambda: inotify_watch_count(envd_pid)[1] <= base[1], timeout=5), (
        f"{base} → {inotify_watch_count(envd_pid)}"
    )


def test_garbage_on_the_socket(envd_pid: int):
    fds = fd_count(envd_pid)
    for payload in (b"\x00\x01\x02garbage\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", os.urandom(4096), b"POST /files HTTP/1.1\r\n"):
        s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
        try:
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
            except socket.timeout:
                pass
            except OSError as e:
                # envd may answer 400 and close before we are done sending or shutting
                # down our side: that is a fine way to refuse garbage.
                assert e.errno in (errno.ENOTCONN, errno.EPIPE, errno.ECONNRESET), e
        finally:
            s.close()
    assert_healthy()
    assert poll(lambda: fd_count(envd_pid) <= fds + 1, timeout=10)


def test_many_idle_connections_do_not_block_service(envd_pid: int):
    socks = [socket.create_connection(("127.0.0.1", PORT)) for _ in range(200)]
    try:
        assert_healthy()
    finally:
        for s in socks:
            s.close()
    assert poll(lambda: fd_count(envd_pid) < 150, timeout=10)
