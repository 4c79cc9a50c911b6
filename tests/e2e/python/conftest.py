"""Fixtures for the envd end-to-end tests with the official E2B Python SDK.

The tests run inside tests/e2e/envd-host.sh: a private network + mount namespace
with a development-mode `cubicle-envd` on localhost:49983, `E2B_DEBUG=true`, a
`user` (uid 1000, home /home/user) and clean /root and /home tmpfs mounts. In
debug mode `Sandbox.create()` talks to localhost:49983 directly (sandbox id
`debug_sandbox_id`, no access token, no control plane).

Tests that need a second envd (access-token and signed-URL tests) start one on
another port from $CUBICLE_ENVD_BIN and point the SDK at it with `sandbox_url`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
import warnings
from typing import Iterator, Optional

import httpx
import pytest

os.environ.setdefault("E2B_DEBUG", "true")

from e2b import AsyncSandbox, ConnectionConfig, Sandbox  # noqa: E402
from e2b.envd.versions import ENVD_DEBUG_FALLBACK  # noqa: E402

import helpers  # noqa: E402

ENVD_URL = os.environ.get("CUBICLE_ENVD_URL", "http://localhost:49983")


def pytest_report_header(config):
    return [
        f"envd: {ENVD_URL} pid={os.environ.get('CUBICLE_ENVD_PID', '?')} "
        f"bin={os.environ.get('CUBICLE_ENVD_BIN', '?')}"
    ]


@pytest.fixture(scope="session")
def envd_url() -> str:
    return ENVD_URL


@pytest.fixture(scope="session")
def envd_pid() -> int:
    """pid of the envd the launcher started (tests that inspect /proc need it)."""
    pid = os.environ.get("CUBICLE_ENVD_PID")
    if not pid:
        pytest.skip("CUBICLE_ENVD_PID not set: run through tests/e2e/envd-host.sh")
    return int(pid)


@pytest.fixture(scope="session")
def scratch_dir() -> str:
    """Disk-backed, world-writable scratch directory (not tmpfs)."""
    d = os.environ.get("CUBICLE_E2E_SCRATCH")
    if not d:
        pytest.skip("CUBICLE_E2E_SCRATCH not set: run through tests/e2e/envd-host.sh")
    return d


@pytest.fixture
def sbx() -> Iterator[Sandbox]:
    """A sync SDK sandbox, created exactly as a user would in debug mode."""
    sandbox = Sandbox.create()
    assert sandbox.sandbox_id == "debug_sandbox_id"
    yield sandbox


@pytest.fixture
async def asbx():
    """An async SDK sandbox, created exactly as a user would in debug mode."""
    sandbox = await AsyncSandbox.create()
    yield sandbox


@pytest.fixture
def home_dir(sbx: Sandbox) -> Iterator[str]:
    """A fresh directory under /home/user owned by `user`; removed afterwards."""
    path = f"/home/user/t-{uuid.uuid4().hex[:12]}"
    assert sbx.files.make_dir(path) is True
    yield path
    try:
        sbx.files.remove(path, user="root")
    except Exception:  # cleanup only; the test already reported
        pass


@pytest.fixture
def root_dir(sbx: Sandbox) -> Iterator[str]:
    """A fresh directory under /tmp created as root; removed afterwards."""
    path = f"/tmp/cubicle-e2e-{uuid.uuid4().hex[:12]}"
    assert sbx.files.make_dir(path, user="root") is True
    yield path
    try:
        sbx.files.remove(path, user="root")
    except Exception:
        pass


# ---------------------------------------------------------------------------
# A second, token-protected envd.


class SecuredEnvd:
    """A second envd process on its own port, given an access token via POST /init."""

    def __init__(self, binary: str, port: int, token: str, init_envs: dict, workdir: str):
        self.port = port
        self.workdir = workdir
        self.url = f"http://localhost:{port}"
        self.token = token
        self.log_path = f"/tmp/cubicle-e2e-envd-{port}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "--dev", "--port", str(port), "--default-user", "user"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": "/root",
                "CUBICLE_ENVD_LOG": os.environ.get("CUBICLE_ENVD_LOG", "info"),
            },
        )
        self.pid = self.proc.pid
        helpers.wait_healthy(self.url, self.proc)
        r = httpx.post(
            f"{self.url}/init",
            json={
                "envVars": init_envs,
                "accessToken": token,
                "defaultUser": "user",
                "defaultWorkdir": workdir,
            },
            timeout=10,
        )
        assert r.status_code == 204, f"POST /init → {r.status_code} {r.text!r}"

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def secured_envd() -> Iterator[SecuredEnvd]:
    binary = os.environ.get("CUBICLE_ENVD_BIN")
    if not binary:
        pytest.skip("CUBICLE_ENVD_BIN not set: run through tests/e2e/envd-host.sh")
    token = "cbtok" + uuid.uuid4().hex + uuid.uuid4().hex[:20]
    # a default workdir other than the home: commands without cwd start there (relative
    # paths still resolve against the acting user's home, as in E2B's envd)
    workdir = f"/tmp/cb-workdir-{uuid.uuid4().hex[:8]}"
    os.makedirs(workdir)
    os.chown(workdir, 1000, 1000)
    envd = SecuredEnvd(binary, _free_port(), token, {"CUBICLE_INIT_VAR": "from-init"}, workdir)
    yield envd
    envd.stop()
    subprocess.run(["rm", "-rf", workdir], check=False)


def sdk_sandbox_for(cls, url: str, token: Optional[str]):
    """Build an SDK sandbox object for envd at `url`, the way the SDK itself builds
    one from a create/connect response that carried `envdAccessToken` (see
    `Sandbox._create` in e2b/sandbox_sync/main.py): same headers, same
    constructor, only the data-plane URL comes from `sandbox_url` (E2B_SANDBOX_URL)."""
    headers = {"E2b-Sandbox-Id": "debug_sandbox_id", "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    config = ConnectionConfig(sandbox_url=url, extra_sandbox_headers=headers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            sandbox_id="debug_sandbox_id",
            sandbox_domain=None,
            envd_version=ENVD_DEBUG_FALLBACK,
            envd_access_token=token,
            traffic_access_token=None,
            connection_config=config,
        )


@pytest.fixture
def secured_sbx(secured_envd: SecuredEnvd) -> Sandbox:
    return sdk_sandbox_for(Sandbox, secured_envd.url, secured_envd.token)


@pytest.fixture
async def secured_asbx(secured_envd: SecuredEnvd):
    return sdk_sandbox_for(AsyncSandbox, secured_envd.url, secured_envd.token)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(autouse=True)
def _envd_alive_after_test(request):
    """Every test must leave the main envd alive and healthy."""
    yield
    pid = os.environ.get("CUBICLE_ENVD_PID")
    if pid and not helpers.pid_alive(int(pid)):
        pytest.fail(f"envd (pid {pid}) died during {request.node.name}")



BASELINE: dict = {}


@pytest.fixture(scope="session", autouse=True)
def _envd_baseline():
    """envd's fd and inotify usage before the first test (read by test_zz_leaks)."""
    pid = os.environ.get("CUBICLE_ENVD_PID")
    if pid and helpers.pid_alive(int(pid)):
        BASELINE["fds"] = helpers.non_socket_fds(int(pid))
        BASELINE["fd_kinds"] = helpers.fd_kinds(int(pid))
        BASELINE["inotify"] = helpers.inotify_watch_count(int(pid))
        BASELINE["rss_kib"] = helpers.rss_kib(int(pid))
    yield BASELINE
