"""Around the server: what a local user of the host reaches of a sandbox (issue 10,
item 3), next to what the official SDK reaches through `cubicle serve`.

The sandbox's own address (its veth, routed from the host) answers nothing from the
host: not envd (49983), not a server the tenant started (8000) — whether the attacker
is an unprivileged local user (`setpriv --reuid nobody curl …`) or the host itself.
Inside the sandbox envd answers on loopback only. Through the router, with the SDK's
routing headers, the user's port stays reachable.
"""

from __future__ import annotations

import socket
import subprocess
import time
import uuid

import httpx
import pytest

from conftest import SANDBOX_URL, poll
from e2b import CommandExitException, Sandbox


def _sandbox_ip(sbx: Sandbox) -> str:
    # The source address of the default route: the sandbox's veth address.
    r = sbx.commands.run(
        "python3 -c \"import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
        "s.connect(('192.0.2.1',9));print(s.getsockname()[0])\""
    )
    ip = r.stdout.strip()
    socket.inet_aton(ip)
    return ip


def test_the_sandbox_address_answers_nothing_to_the_host(sbx: Sandbox):
    ip = _sandbox_ip(sbx)
    d = f"/tmp/www-{uuid.uuid4().hex[:6]}"
    sbx.files.write(f"{d}/hello.txt", "hello from inside the sandbox\n")
    handle = sbx.commands.run(f"cd {d} && exec python3 -m http.server 8000", background=True)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}

        def fetch():
            r = httpx.get(f"{SANDBOX_URL}/hello.txt", headers=headers, timeout=10)
            return r if r.status_code == 200 else None

        r = poll(fetch, timeout=20, interval=0.3)
        assert r is not None and r.text == "hello from inside the sandbox\n", "the router must reach port 8000"

        for port in (49983, 8000):
            url = f"http://{ip}:{port}/hello.txt"
            t = time.monotonic()
            out = subprocess.run(
                ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                 "curl", "-sS", "-m", "3", url],
                capture_output=True, text=True,
            )
            assert out.returncode != 0, f"nobody reached {url}: {out.stdout!r}"
            assert time.monotonic() - t < 2.5, f"{url}: the refusal should be immediate ({out.stderr!r})"
            with pytest.raises(OSError):
                socket.create_connection((ip, port), timeout=3).close()

        # Inside: envd on loopback, not on the sandbox's address.
        r = sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:49983/health")
        assert r.stdout == "204", r
        with pytest.raises(CommandExitException):
            sbx.commands.run(f"curl -sS -m 3 http://{ip}:49983/health")
    finally:
        handle.kill()
