"""E2B fidelity (issue 20): the small differences the official SDK trips over.

1. relative paths and cwd-less commands follow the requested user's home, for every
   filesystem call (write/read/list/make_dir/get_info/rename/remove/watch) and for signed
   download/upload URLs;
2. `get_metrics(start, end)` returns only the samples inside the range, from a history
   sampled every few seconds (a range ending before the sandbox existed is empty), and
   the batch route (`GET /sandboxes/metrics`) gives each sandbox's latest sample;
3. the `base` template behaves like E2B's base image where code depends on it
   (`python` is Python 3, `pip install` works without a venv, compilers and the usual
   tools are there);
4. directory sizes are what the filesystem reports (never made up): the size the SDK
   shows equals `stat` inside the sandbox;
5. with `cubicle serve`'s default domain, `get_host(port)` names a host that resolves
   to the server on this machine, and a plain HTTP request to it (no routing headers)
   reaches a server inside the sandbox.
"""

from __future__ import annotations

import datetime as dt
import socket
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from e2b import CommandExitException, Sandbox
from e2b.api.client.api.sandboxes import get_sandboxes_metrics
from e2b.connection_config import ConnectionConfig
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from e2b.sandbox_sync.paginator import get_api_client

from conftest import API_URL, DOMAIN, Tracker, api, poll


def _u() -> str:
    return uuid.uuid4().hex[:8]


# ---------------------------------------------------------------------------
# 1. relative paths follow the requested user


def test_relative_paths_follow_the_requested_user(sbx: Sandbox):
    n = _u()
    info = sbx.files.write(f"rel-{n}.txt", "as root", user="root")
    assert info.path == f"/root/rel-{n}.txt", info.path
    assert sbx.commands.run(f"stat -c %U /root/rel-{n}.txt", user="root").stdout == "root\n"
    assert sbx.files.read(f"rel-{n}.txt", user="root") == "as root"
    assert sbx.files.get_info(f"rel-{n}.txt", user="root").path == f"/root/rel-{n}.txt"
    # the default user's relative path is its own home, where nothing was written
    assert sbx.files.exists(f"rel-{n}.txt") is False
    assert sbx.files.write(f"rel-{n}.txt", "as user").path == f"/home/user/rel-{n}.txt"
    assert sbx.files.read(f"rel-{n}.txt", user="root") == "as root"

    assert sbx.files.make_dir(f"d-{n}/sub", user="root") is True
    assert sbx.commands.run(f"test -d /root/d-{n}/sub", user="root").exit_code == 0
    names = {e.name: e.path for e in sbx.files.list(f"d-{n}", user="root")}
    assert names == {"sub": f"/root/d-{n}/sub"}, names
    moved = sbx.files.rename(f"d-{n}/sub", f"d-{n}/moved", user="root")
    assert moved.path == f"/root/d-{n}/moved", moved.path
    sbx.files.remove(f"d-{n}/moved", user="root")
    assert sbx.commands.run(f"ls -A /root/d-{n}", user="root").stdout == ""
    assert sbx.files.exists(f"d-{n}", user="root") is True
    assert sbx.files.exists(f"d-{n}") is False


def test_watch_relative_dir_follows_the_user(sbx: Sandbox):
    d = f"w-{_u()}"
    sbx.files.make_dir(d, user="root")
    events = []
    h = sbx.files.watch_dir(d, user="root")
    try:
        sbx.commands.run(f"echo x > /root/{d}/seen.txt", user="root")

        def seen():
            events.extend(h.get_new_events())
            return any(e.name == "seen.txt" and e.type == FilesystemEventType.CREATE for e in events)

        assert poll(seen, timeout=10), events
    finally:
        h.stop()


def test_cwdless_commands_start_in_the_users_home(sbx: Sandbox):
    assert sbx.commands.run("pwd", user="root").stdout == "/root\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("pwd", user="root", cwd="/tmp").stdout == "/tmp\n"


def test_signed_urls_resolve_relative_paths_for_the_user(sbx: Sandbox):
    n = _u()
    sbx.commands.run(f"echo -n root-file > /root/dl-{n}.txt", user="root")
    r = httpx.get(sbx.download_url(f"dl-{n}.txt", user="root"), timeout=15)
    assert r.status_code == 200 and r.text == "root-file", (r.status_code, r.text)
    up = sbx.upload_url(f"ul-{n}/up.txt", user="root")
    r = httpx.post(up, files={"file": ("x.txt", b"uploaded")}, timeout=15)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.json()[0]["path"] == f"/root/ul-{n}/up.txt", r.text
    out = sbx.commands.run(f"stat -c %U:%s /root/ul-{n}/up.txt", user="root").stdout
    assert out == "root:8\n", out


# ---------------------------------------------------------------------------
# 2. metrics honour their time range


def test_metrics_history_and_range(sandboxes: Tracker):
    s = sandboxes.create(timeout=300)
    created = dt.datetime.now(dt.timezone.utc)
    s.commands.run("head -c 20000000 /dev/urandom | sha256sum >/dev/null")
    ms = poll(lambda: (lambda m: m if len(m) >= 3 else None)(s.get_metrics()), timeout=30, interval=1)
    assert ms, "fewer than 3 samples within 30 s (one every 5 s expected)"
    ts = [m.timestamp for m in ms]
    assert ts == sorted(ts) and len(set(ts)) == len(ts), ts
    gaps = [(b - a).total_seconds() for a, b in zip(ts, ts[1:])]
    assert all(3 <= g <= 12 for g in gaps), f"samples every ~5 s, got gaps {gaps}"
    for m in ms:
        assert m.cpu_count >= 1 and 0 <= m.cpu_used_pct <= 100
        assert 0 < m.mem_used <= m.mem_total and m.disk_total > 0

    # a range ending before the sandbox existed
    before = s.get_metrics(start=created - dt.timedelta(hours=1), end=created - dt.timedelta(minutes=1))
    assert before == [], before
    # exactly one sample: start == end == its second
    one = s.get_metrics(start=ts[1], end=ts[1])
    assert [m.timestamp for m in one] == [ts[1]], one
    # open end: everything from the second sample on
    later = s.get_metrics(start=ts[1])
    assert [m.timestamp for m in later][: len(ts) - 1] == ts[1:], (later, ts)
    # open start: everything up to the second sample
    assert [m.timestamp for m in s.get_metrics(end=ts[1])] == ts[:2]
    # the future
    assert s.get_metrics(start=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)) == []
    # the class method reads the same history
    assert [m.timestamp for m in Sandbox.get_metrics(s.sandbox_id, start=ts[0], end=ts[-1])] == ts


def test_metrics_batch_route_latest_sample(sandboxes: Tracker):
    a = sandboxes.create(timeout=300)
    b = sandboxes.create(timeout=300)
    poll(lambda: a.get_metrics() and b.get_metrics(), timeout=20, interval=1)
    client = get_api_client(ConnectionConfig())
    res = get_sandboxes_metrics.sync_detailed(client=client, sandbox_ids=[a.sandbox_id, b.sandbox_id, "i" + "0" * 19])
    assert res.status_code == 200, res.content
    got = res.parsed.sandboxes  # the generated model leaves the map as parsed JSON
    assert set(got) == {a.sandbox_id, b.sandbox_id}, got
    history = a.get_metrics()
    ma = got[a.sandbox_id]
    # the latest sample of the history (or one taken in between the two requests)
    assert ma["timestampUnix"] >= int(history[-1].timestamp.timestamp()), (ma, history[-1])
    assert ma["memTotal"] == history[-1].mem_total and ma["cpuCount"] == history[-1].cpu_count
    # Cubicle's range on the batch route: a range before both existed leaves them out
    r = api("GET", "/sandboxes/metrics", params={"sandbox_ids": f"{a.sandbox_id},{b.sandbox_id}", "start": 0, "end": 1000})
    assert r.status_code == 200 and r.json() == {"sandboxes": {}}, r.text


# ---------------------------------------------------------------------------
# 3. the base template behaves like E2B's base image


def test_base_template_like_e2b(sbx: Sandbox):
    r = sbx.commands.run("python --version && python -c 'import sys; print(sys.version_info[0])'")
    assert r.stdout.startswith("Python 3.") and r.stdout.endswith("\n3\n"), r.stdout
    tools = "gcc g++ make cc git curl wget jq node npm yarn gh sudo socat unzip zip bzip2 xz patch file ssh nc less nano ps ip ping gpg pip pip3"
    r = sbx.commands.run(f"for t in {tools}; do command -v $t >/dev/null || echo missing $t; done")
    assert r.stdout == "", r.stdout


def test_base_template_compiles_and_pip_installs(sbx: Sandbox):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("printf 'int main(void){return 7;}' > /tmp/seven.c && gcc -o /tmp/seven /tmp/seven.c && /tmp/seven")
    assert ei.value.exit_code == 7, ei.value
    # pip outside a venv, as the default user, with no network: a local package with a
    # C extension (needs the Python headers and a compiler, as on E2B's image)
    pkg = f"/tmp/pkg-{_u()}"
    sbx.files.write(f"{pkg}/pyproject.toml", "[build-system]\nrequires=['setuptools']\nbuild-backend='setuptools.build_meta'\n"
                    "[project]\nname='cubfid'\nversion='1.0'\n")
    sbx.files.write(f"{pkg}/setup.py", "from setuptools import setup, Extension\nsetup(ext_modules=[Extension('cubfid', ['cubfid.c'])])\n")
    sbx.files.write(f"{pkg}/cubfid.c", "#include <Python.h>\n"
                    "static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"cubfid\", NULL, -1, NULL};\n"
                    "PyMODINIT_FUNC PyInit_cubfid(void){PyObject*o=PyModule_Create(&m); PyModule_AddIntConstant(o, \"X\", 42); return o;}\n")
    r = sbx.commands.run(f"pip install --no-index --no-build-isolation {pkg} 2>&1", timeout=180)
    assert r.exit_code == 0 and "Successfully installed cubfid" in r.stdout, r.stdout[-2000:]
    # installed where root sees it too (as E2B's writable /usr/local)
    assert sbx.commands.run("python -c 'import cubfid; print(cubfid.X)'", user="root").stdout == "42\n"
    assert sbx.commands.run("sudo -n true && touch /code/x /usr/local/bin/.w && echo ok").stdout == "ok\n"


# ---------------------------------------------------------------------------
# 4. directory sizes are the filesystem's


def test_directory_sizes_are_the_filesystems(sbx: Sandbox):
    d = f"/home/user/sz-{_u()}"
    sbx.files.make_dir(f"{d}/empty")
    sbx.files.write(f"{d}/f.txt", "12345")
    stat = dict(
        line.split(" ", 1)[::-1]
        for line in sbx.commands.run(f"stat -c '%s %n' {d} {d}/empty {d}/f.txt").stdout.splitlines()
    )
    assert sbx.files.get_info(d).size == int(stat[d])
    assert sbx.files.get_info(f"{d}/empty").size == int(stat[f"{d}/empty"])
    listed = {e.path: e.size for e in sbx.files.list(d)}
    assert listed == {f"{d}/empty": int(stat[f"{d}/empty"]), f"{d}/f.txt": 5}, (listed, stat)


# ---------------------------------------------------------------------------
# 5. get_host() with the default domain


def test_get_host_reaches_a_server_without_routing_headers(sbx: Sandbox):
    if DOMAIN and not DOMAIN.startswith("localhost"):
        pytest.skip(f"serve runs with --domain {DOMAIN}: this test is about the default")
    api_port = urlsplit(API_URL).port
    assert sbx.sandbox_domain == f"localhost:{api_port}", sbx.sandbox_domain
    host = sbx.get_host(8000)
    assert host == f"8000-{sbx.sandbox_id}.localhost:{api_port}", host
    name = host.rsplit(":", 1)[0]
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(name, api_port, type=socket.SOCK_STREAM)}
    except socket.gaierror as e:
        pytest.fail(f"{name} does not resolve on this host ({e}): names under localhost need "
                    "systemd-resolved or nss-myhostname (apt-get install libnss-myhostname)")
    assert addrs <= {"127.0.0.1", "::1"}, addrs
    d = f"/tmp/www-{_u()}"
    sbx.files.write(f"{d}/hello.txt", "hello via get_host\n")
    handle = sbx.commands.run(f"cd {d} && exec python3 -m http.server 8000", background=True)
    try:
        def fetch():
            try:
                r = httpx.get(f"http://{host}/hello.txt", timeout=10)
            except httpx.HTTPError:
                return None
            return r if r.status_code == 200 else None

        r = poll(fetch, timeout=20, interval=0.3)
        assert r is not None, f"http://{host}/hello.txt never answered"
        assert r.text == "hello via get_host\n"
        assert "e2b-sandbox-id" not in {k.lower() for k in r.request.headers}
        # another port of the same sandbox: nothing listens there
        r = httpx.get(f"http://{sbx.get_host(8001)}/", timeout=10)
        assert r.status_code == 502 and "port is not open" in r.json()["message"], r.text
    finally:
        handle.kill()
