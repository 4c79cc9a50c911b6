"""Fixtures for the `cubicle serve` end-to-end tests with the official E2B Python SDK.

The tests run through tests/e2e/serve/run.sh, which starts `cubicle serve` on a free
port with a dedicated state directory and exports exactly what a user would set:
`E2B_API_URL`, `E2B_SANDBOX_URL`, `E2B_API_KEY` (the admin team's key). Nothing else
is configured for the SDK: no debug mode, no domain. The launcher also exports, for
the tests' own use only:

  CUBICLE_E2E_KEY_B          an API key of a second team ("other")
  CUBICLE_E2E_DOMAIN         the sandboxes' domain as SDKs get it (`get_host(p)` is
                             `<p>-<id>.<domain>`): `serve --domain`, else serve's
                             default `localhost:<port>`
  CUBICLE_E2E_IDS_FILE       every sandbox id a test created is appended here (the
                             launcher's leak check looks for each one after the run)
  CUBICLE_E2E_TEMPLATE       realistic template (default `base`, the SDK default)
  CUBICLE_E2E_FAST_TEMPLATE  fast template for load/isolation tests (default `tiny`)

Every fixture that creates sandboxes kills them in `finally`, whatever the test did.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Callable, Dict, Iterator, List, Optional, Tuple, TypeVar
from urllib.parse import urlsplit

import httpx
import pytest

from e2b import AsyncSandbox, Sandbox

T = TypeVar("T")

API_URL = os.environ.get("E2B_API_URL", "")
SANDBOX_URL = os.environ.get("E2B_SANDBOX_URL", "")
API_KEY = os.environ.get("E2B_API_KEY", "")
KEY_B = os.environ.get("CUBICLE_E2E_KEY_B", "")
DOMAIN = os.environ.get("CUBICLE_E2E_DOMAIN", "")
IDS_FILE = os.environ.get("CUBICLE_E2E_IDS_FILE", "")
TEMPLATE = os.environ.get("CUBICLE_E2E_TEMPLATE", "base")
FAST_TEMPLATE = os.environ.get("CUBICLE_E2E_FAST_TEMPLATE", "tiny")
# Cluster mode (tests/e2e/cluster/serve_suite.sh): the SDKs talk to an API replica in
# front of nodes coordinated through PostgreSQL. Tests marked `single_host(why)` need a
# single host's internals (its state directory, SQLite file, restarting it) and tests
# marked `cluster_pending(why)` a feature a replica does not offer yet: both are skipped
# there, with their reason in the report (docs/cluster.md, "Tested").
CLUSTER = os.environ.get("CUBICLE_E2E_CLUSTER") == "1"
# The control plane through one replica and the data plane (E2B_SANDBOX_URL) through
# another (tests/e2e/cluster/serve_suite.sh, CUBICLE_E2E_SPLIT_REPLICAS=1).
SPLIT_REPLICAS = os.environ.get("CUBICLE_E2E_SPLIT_REPLICAS") == "1"
# Where templates live: the server's state directory (CUBICLE_E2E_STATE_DIR) and, against
# a cluster, the nodes' (CUBICLE_E2E_NODE_STATE_DIRS, colon-separated): a template built
# through a replica is on its build node, a copy on any node that pulled it.
STATE_DIRS = [
    d
    for d in [os.environ.get("CUBICLE_E2E_STATE_DIR", "")]
    + os.environ.get("CUBICLE_E2E_NODE_STATE_DIRS", "").split(":")
    if d
]


def template_config(name: str) -> Tuple[Optional[str], Optional[dict]]:
    """(state dir, template.json) of template `name`: of the server's state dir, or of
    the node whose copy was written last (its build node after a rebuild; a copy a node
    pulled before that rebuild is older); (None, None) when no one has it."""
    import json

    found = []
    for d in STATE_DIRS:
        path = os.path.join(d, "templates", name, "template.json")
        try:
            found.append((os.stat(path).st_mtime_ns, d, path))
        except OSError:
            continue
    if not found:
        return None, None
    _, d, path = max(found)
    with open(path) as f:
        return d, json.load(f)


def pytest_configure(config):
    if os.environ.get("E2B_DEBUG", "").lower() == "true":
        raise pytest.UsageError("E2B_DEBUG must not be set for the serve suite")
    if not (API_URL and SANDBOX_URL and API_KEY):
        raise pytest.UsageError(
            "E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY must be set: "
            "run through tests/e2e/serve/run.sh"
        )


def pytest_collection_modifyitems(config, items):
    if not CLUSTER:
        return
    for item in items:
        for name, what in (("single_host", "single host only"), ("cluster_pending", "not through a replica yet")):
            m = item.get_closest_marker(name)
            if m:
                why = m.args[0] if m.args else m.kwargs.get("reason", "")
                assert why, f"{item.nodeid}: @pytest.mark.{name} needs its reason"
                item.add_marker(pytest.mark.skip(reason=f"cluster: {what}: {why}"))


def pytest_report_header(config):
    return [
        f"cubicle serve: E2B_API_URL={API_URL} E2B_SANDBOX_URL={SANDBOX_URL} "
        f"domain={DOMAIN or '-'} template={TEMPLATE} fast={FAST_TEMPLATE}"
        + (" (cluster: through an API replica)" if CLUSTER else "")
    ]


# ---------------------------------------------------------------------------
# helpers


def poll(fn: Callable[[], T], timeout: float = 10.0, interval: float = 0.2) -> T:
    """Call fn until it returns a truthy value or `timeout` seconds pass; return the last value."""
    deadline = time.monotonic() + timeout
    value = fn()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = fn()
    return value


def record_id(sandbox_id: str) -> None:
    if IDS_FILE:
        with open(IDS_FILE, "a") as f:
            f.write(sandbox_id + "\n")


def unique() -> str:
    return uuid.uuid4().hex[:12]


def api(method: str, path: str, key: Optional[str] = API_KEY, **kw) -> httpx.Response:
    """A raw control-plane request (what the SDK would send, or what it never would)."""
    headers = dict(kw.pop("headers", {}) or {})
    if key is not None:
        headers.setdefault("X-API-KEY", key)
    kw.setdefault("timeout", 60)
    return httpx.request(method, f"{API_URL}{path}", headers=headers, **kw)


def assert_error_shape(r, lo: int = 400, hi: int = 499, what: str = "") -> dict:
    """`r` (httpx.Response or RawResponse) is an error in the E2B shape with lo <= status <= hi."""
    status = r.status_code
    body_text = r.text if hasattr(r, "text") else ""
    assert lo <= status <= hi, f"{what}: expected {lo}..{hi}, got {status} {body_text[:300]!r}"
    try:
        body = r.json()
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: {status} body is not JSON: {body_text[:300]!r} ({e})")
    assert isinstance(body, dict), f"{what}: body is not an object: {body!r}"
    assert isinstance(body.get("code"), int) and not isinstance(body.get("code"), bool), (
        f"{what}: `code` is not an integer: {body!r}"
    )
    assert body["code"] == status, f"{what}: code {body['code']} != HTTP status {status}"
    assert isinstance(body.get("message"), str) and body["message"], (
        f"{what}: `message` is not a non-empty string: {body!r}"
    )
    return body


class RawResponse:
    def __init__(self, status_code: int, headers: Dict[str, str], body: bytes):
        self.status_code = status_code
        self.headers = headers
        self.content = body
        self.text = body.decode(errors="replace")

    def json(self):
        import json

        return json.loads(self.content)


def raw_request(base_url: str, request_line_target: str, method: str = "GET",
                headers: Optional[Dict[str, str]] = None, body: bytes = b"",
                timeout: float = 30.0) -> RawResponse:
    """Send one HTTP/1.1 request with the request target exactly as given (no client
    normalization of `..`, `%zz`, …) and read the whole response (Connection: close)."""
    u = urlsplit(base_url)
    host, port = u.hostname, u.port or 80
    h = {"Host": f"{host}:{port}", "Connection": "close", "Accept": "application/json"}
    if body or method in ("POST", "PUT", "PATCH"):
        h["Content-Length"] = str(len(body))
    h.update(headers or {})
    head = f"{method} {request_line_target} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in h.items()
    ) + "\r\n"
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(head.encode("latin-1") + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (and close) before reading everything
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            chunks.append(data)
    raw = b"".join(chunks)
    if not raw:
        raise AssertionError(f"{method} {request_line_target}: connection closed without a response")
    head_b, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_b.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2 :]
        rest = out
    return RawResponse(status, hdrs, rest)


def server_alive() -> bool:
    try:
        r = httpx.get(f"{API_URL}/health", timeout=5)
        return r.status_code < 500
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------------------
# sandbox tracking


class Tracker:
    """Creates sandboxes through the SDK and kills every one of them at teardown."""

    def __init__(self):
        self.created: List[Tuple[str, str]] = []  # (id, api key)

    def track(self, sandbox_id: str, key: str = API_KEY) -> None:
        record_id(sandbox_id)
        self.created.append((sandbox_id, key))

    def create(self, template: Optional[str] = None, key: Optional[str] = None, **kw) -> Sandbox:
        opts = dict(kw)
        if key is not None:
            opts["api_key"] = key
        sbx = Sandbox.create(template or TEMPLATE, **opts)
        self.track(sbx.sandbox_id, key or API_KEY)
        return sbx

    async def acreate(self, template: Optional[str] = None, key: Optional[str] = None, **kw) -> AsyncSandbox:
        opts = dict(kw)
        if key is not None:
            opts["api_key"] = key
        sbx = await AsyncSandbox.create(template or TEMPLATE, **opts)
        self.track(sbx.sandbox_id, key or API_KEY)
        return sbx

    def cleanup(self) -> None:
        errors = []
        for sid, key in self.created:
            try:
                Sandbox.kill(sid, api_key=key)
            except Exception as e:  # noqa: BLE001 - cleanup must try every sandbox
                errors.append(f"{sid}: {e!r}")
        self.created.clear()
        if errors:
            raise AssertionError("cleanup failed to kill: " + "; ".join(errors))


@pytest.fixture
def sandboxes() -> Iterator[Tracker]:
    t = Tracker()
    try:
        yield t
    finally:
        t.cleanup()


@pytest.fixture(scope="module")
def module_sandboxes() -> Iterator[Tracker]:
    t = Tracker()
    try:
        yield t
    finally:
        t.cleanup()


@pytest.fixture(scope="module")
def sbx(module_sandboxes: Tracker) -> Sandbox:
    """One realistic (`base`) sandbox shared by the data-plane tests of a module, with
    create-time envs, as a user would make it: `Sandbox.create(envs=…)`."""
    return module_sandboxes.create(envs={"CUBICLE_E2E_GLOBAL": "from-create"}, timeout=600)


@pytest.fixture
async def asbx(sandboxes: Tracker):
    return await sandboxes.acreate(envs={"CUBICLE_E2E_GLOBAL": "from-create"}, timeout=600)
