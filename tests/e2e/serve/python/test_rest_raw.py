"""REST and router behaviour the SDKs depend on but do not expose directly, checked with
raw httpx: v1 routes (create, list, connect, refreshes, logs), response headers
(`X-Next-Token`), the default/maximum timeouts, revoked keys, streaming through the
router without buffering, HTTP upgrade pass-through to a sandbox port, and the traffic
access token on non-envd ports."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from datetime import datetime
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import (
    FAST_TEMPLATE,
    SANDBOX_URL,
    Tracker,
    api,
    assert_error_shape,
    poll,
    unique,
)
from e2b import Sandbox
from e2b.exceptions import AuthenticationException, SandboxException


def parse_time(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def test_v1_routes(sandboxes: Tracker):
    tag = unique()
    r = api("POST", "/sandboxes", json={"templateID": FAST_TEMPLATE, "metadata": {"tag": tag}, "timeout": 60})
    assert r.status_code == 201, (r.status_code, r.text)
    sid = r.json()["sandboxID"]
    sandboxes.track(sid)
    for k in ("templateID", "sandboxID", "clientID", "envdVersion"):
        assert isinstance(r.json()[k], str)

    r = api("GET", "/sandboxes", params={"metadata": f"tag={tag}"})
    assert r.status_code == 200, r.text
    assert [s["sandboxID"] for s in r.json()] == [sid]

    r = api("POST", f"/sandboxes/{sid}/connect", json={"timeout": 600})
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.json()["sandboxID"] == sid and r.json().get("envdAccessToken")

    r = api("POST", f"/sandboxes/{sid}/refreshes", json={"duration": 10})
    assert r.status_code == 204, (r.status_code, r.text)

    r = api("GET", f"/sandboxes/{sid}/logs")
    assert r.status_code == 200, (r.status_code, r.text)
    assert isinstance(r.json().get("logs"), list), r.text
    r = api("GET", f"/v2/sandboxes/{sid}/logs")
    assert r.status_code == 200, (r.status_code, r.text)
    assert isinstance(r.json().get("logs"), list), r.text

    r = api("GET", "/sandboxes/metrics", params={"sandbox_ids": sid})
    assert r.status_code == 200, (r.status_code, r.text)

    r = api("DELETE", f"/sandboxes/{sid}")
    assert r.status_code == 204, (r.status_code, r.text)
    assert_error_shape(api("GET", f"/sandboxes/{sid}"), 404, 404, "get after delete")
    assert_error_shape(api("DELETE", f"/sandboxes/{sid}"), 404, 404, "second delete")


def test_v2_list_headers_and_shapes(sandboxes: Tracker):
    tag = unique()
    for _ in range(2):
        sandboxes.create(FAST_TEMPLATE, metadata={"tag": tag})
    q = {"metadata": f"tag={tag}", "limit": 1}
    r = api("GET", "/v2/sandboxes", params=q)
    assert r.status_code == 200
    assert len(r.json()) == 1
    token = r.headers.get("x-next-token")
    assert token, dict(r.headers)
    item = r.json()[0]
    for k in ("templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB",
              "diskSizeMB", "state", "envdVersion"):
        assert k in item, (k, item)
    parse_time(item["startedAt"])
    r2 = api("GET", "/v2/sandboxes", params={**q, "nextToken": token})
    assert r2.status_code == 200 and len(r2.json()) == 1
    assert r2.json()[0]["sandboxID"] != item["sandboxID"]
    r3 = api("GET", "/v2/sandboxes", params={**q, "nextToken": r2.headers.get("x-next-token", "")}) \
        if r2.headers.get("x-next-token") else None
    assert r3 is None or r3.json() == [], "a third page of a 2-item list must be empty or absent"


def test_detail_shape(sandboxes: Tracker):
    s = sandboxes.create(FAST_TEMPLATE, metadata={"k": "v"})
    r = api("GET", f"/sandboxes/{s.sandbox_id}")
    assert r.status_code == 200
    d = r.json()
    for k in ("templateID", "sandboxID", "clientID", "startedAt", "endAt", "envdVersion", "cpuCount",
              "memoryMB", "diskSizeMB", "state"):
        assert k in d, (k, d)
    assert d["state"] == "running" and d["metadata"] == {"k": "v"}
    assert d.get("domain") not in ("e2b.app", "e2b.dev"), "must never return an E2B-owned domain"


def test_timeout_limits(sandboxes: Tracker):
    s = sandboxes.create(FAST_TEMPLATE)
    with pytest.raises(SandboxException) as ei:
        s.set_timeout(86400 * 2)
    assert getattr(ei.value, "status_code", None) == 400, ei.value
    with pytest.raises(SandboxException) as ei:
        Sandbox.create(FAST_TEMPLATE, timeout=86400 * 2)
    assert getattr(ei.value, "status_code", None) == 400, ei.value
    s.set_timeout(86400)  # exactly the default maximum is fine


def _cli(*args) -> str:
    out = subprocess.run([os.environ["CUBICLE_BIN"], *args, "--state-dir", os.environ["CUBICLE_E2E_STATE_DIR"]],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def test_revoked_key_is_401(sandboxes: Tracker):
    """`cubicle apikey create` keys work at once; `cubicle apikey revoke` takes effect at
    once on SQLite, within 2 s on PostgreSQL (another key of the same team still works)."""
    if not (os.environ.get("CUBICLE_BIN") and os.environ.get("CUBICLE_E2E_STATE_DIR")):
        pytest.skip("CUBICLE_BIN / CUBICLE_E2E_STATE_DIR not set (run through run.sh)")
    team = f"rev{unique()}"
    key1 = _cli("apikey", "create", "--team", team).strip().splitlines()[-1].strip()
    key2 = _cli("apikey", "create", "--team", team).strip().splitlines()[-1].strip()
    try:
        s = sandboxes.create(FAST_TEMPLATE, key=key2)
        assert Sandbox.get_info(s.sandbox_id, api_key=key1).sandbox_id == s.sandbox_id
        _cli("apikey", "revoke", key1)
        if os.environ.get("CUBICLE_DATABASE", "").startswith("postgres"):
            # On PostgreSQL a server trusts a key it read for at most 2 s
            # (docs/cluster.md, "Create latency through a replica"): refused by then.
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    Sandbox.get_info(s.sandbox_id, api_key=key1)
                except AuthenticationException:
                    break
                time.sleep(0.2)
        with pytest.raises(AuthenticationException):
            Sandbox.get_info(s.sandbox_id, api_key=key1)
        with pytest.raises(AuthenticationException):
            Sandbox.create(FAST_TEMPLATE, api_key=key1)
        assert Sandbox.get_info(s.sandbox_id, api_key=key2).sandbox_id == s.sandbox_id
        assert Sandbox.kill(s.sandbox_id, api_key=key2) is True
        sandboxes.created.remove((s.sandbox_id, key2))  # gone; key2 is revoked below
    finally:
        try:
            _cli("apikey", "revoke", key2)
        except AssertionError:
            pass


def test_streaming_is_not_buffered(sbx: Sandbox):
    """Output of a running command arrives while it runs (Connect stream through the router)."""
    seen = []
    t0 = time.monotonic()
    sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 1; done",
                     on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    total = time.monotonic() - t0
    assert total >= 2.5
    assert seen, "no stdout callbacks"
    assert seen[0][0] < 1.5, f"first line arrived after {seen[0][0]:.2f}s of {total:.2f}s: buffered? {seen}"


UPGRADE_SERVER = r'''
import socket, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8765)); srv.listen(8)
def serve(c):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(4096)
        if not chunk: return
        data += chunk
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: cubicle-echo\r\nConnection: Upgrade\r\n\r\n")
    rest = data.split(b"\r\n\r\n", 1)[1]
    if rest: c.sendall(rest.upper())
    while True:
        chunk = c.recv(4096)
        if not chunk: break
        c.sendall(chunk.upper())
    c.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


def test_upgrade_pass_through(sbx: Sandbox):
    """An HTTP/1.1 Upgrade to a port in the sandbox (what WebSockets use) is passed through:
    101, then raw bytes both ways."""
    p = f"/tmp/upg-{uuid.uuid4().hex[:6]}.py"
    sbx.files.write(p, UPGRADE_SERVER)
    h = sbx.commands.run(f"exec python3 {p}", background=True)
    try:
        u = urlsplit(SANDBOX_URL)

        def attempt():
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            s.sendall((
                "GET /ws HTTP/1.1\r\n"
                f"Host: {u.hostname}:{u.port}\r\n"
                f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\nE2b-Sandbox-Port: 8765\r\n"
                "Connection: Upgrade\r\nUpgrade: cubicle-echo\r\n\r\n").encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
            if not head.startswith(b"HTTP/1.1 101"):
                s.close()
                return None
            return s, head.split(b"\r\n\r\n", 1)[1]

        res = poll(attempt, timeout=20, interval=0.3)
        assert res, "no 101 from the upgrade server through the router"
        s, extra = res
        with s:
            s.sendall(b"hello upgrade")
            got = extra
            deadline = time.monotonic() + 10
            while b"HELLO UPGRADE" not in got and time.monotonic() < deadline:
                got += s.recv(4096)
            assert b"HELLO UPGRADE" in got, got
            s.sendall(b" again")
            got2 = b""
            while b" AGAIN" not in got2 and time.monotonic() < deadline:
                got2 += s.recv(4096)
            assert b" AGAIN" in got2
    finally:
        h.kill()


def test_traffic_access_token(sandboxes: Tracker):
    """A sandbox created with allowPublicTraffic=false gets a traffic token; non-envd ports
    then require `e2b-traffic-access-token`, envd (49983) does not."""
    s = sandboxes.create(network={"allow_public_traffic": False})
    token = s.traffic_access_token
    assert token, "no trafficAccessToken issued for allowPublicTraffic=false"
    d = f"/tmp/tt-{uuid.uuid4().hex[:6]}"
    s.files.write(f"{d}/t.txt", "token ok")
    h = s.commands.run(f"cd {d} && exec python3 -m http.server 8000", background=True)
    try:
        base = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8000"}

        def with_token():
            r = httpx.get(f"{SANDBOX_URL}/t.txt", headers={**base, "e2b-traffic-access-token": token}, timeout=10)
            return r if r.status_code == 200 else None

        r = poll(with_token, timeout=20, interval=0.3)
        assert r is not None and r.text == "token ok"
        r = httpx.get(f"{SANDBOX_URL}/t.txt", headers=base, timeout=10)
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        r = httpx.get(f"{SANDBOX_URL}/t.txt", headers={**base, "e2b-traffic-access-token": "wrong"}, timeout=10)
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert s.commands.run("echo envd-needs-no-traffic-token").exit_code == 0
    finally:
        h.kill()


def test_envd_log_lines_are_served(sandboxes: Tracker):
    """The sandbox's own log (its envd's output) through `GET /sandboxes/{id}/logs`: on a
    single host the server reads it; through a cluster's replica it is relayed from the
    owning node."""
    s = sandboxes.create(FAST_TEMPLATE, timeout=120)
    sid = s.sandbox_id

    def envd_lines():
        r = api("GET", f"/v2/sandboxes/{sid}/logs")
        assert r.status_code == 200, (r.status_code, r.text)
        return [e for e in r.json()["logs"] if "envd listening" in e["message"]]

    lines = poll(envd_lines, timeout=15, interval=0.5)
    assert lines, f"no envd start line in the logs of {sid}: {api('GET', f'/v2/sandboxes/{sid}/logs').text[:500]}"
    v1 = api("GET", f"/sandboxes/{sid}/logs").json()
    assert any("envd listening" in l["line"] for l in v1["logs"]), v1
    # Asked again: nothing twice.
    again = envd_lines()
    assert len(again) == len(lines), (lines, again)
