"""Custom templates through the official SDK's `Template.build()`, the CLI's Dockerfile
builds and a local registry (`registry.py`): builds from `base` (RUN + COPY, cached
rebuild, timings), from images (anonymous and with credentials, shared layers stored
once, an image without a shell), failures that name their step (RUN, broken image,
bad credentials, interrupted upload), two builds at once, cancel, tags, delete refused
while in use, and sandboxes of the results driven by the SDK.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from conftest import API_KEY, API_URL, CLUSTER, KEY_B, STATE_DIRS, record_id, template_config
import registry as reg

STATE = os.environ.get("CUBICLE_E2E_STATE_DIR", "")
# Where the builds reach the test registries: 127.0.0.1 on one host; against a cluster
# the address the nodes (in network namespaces of their own) reach this one by.
REGISTRY_ADDR = os.environ.get("CUBICLE_E2E_REGISTRY_ADDR", "127.0.0.1")
CUBICLE = os.environ.get("CUBICLE_BIN", "cubicle")
HERE = Path(__file__).parent


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def headers(key: str = API_KEY) -> dict:
    return {"X-API-KEY": key}


def kill_quietly(sbx) -> None:
    try:
        sbx.kill()
    except Exception:
        pass


def delete_template(name: str) -> None:
    httpx.delete(f"{API_URL}/templates/{name}", headers=headers(), timeout=60)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """An anonymous registry and one with credentials, both seeded with the images."""
    work = tmp_path_factory.mktemp("images")
    # The base template's single layer (on a cluster: a node's).
    pylib = None
    state, cfg = template_config("base")
    if cfg and cfg.get("layers"):
        pylib = Path(state) / "layers" / cfg["layers"][0] / reg.BASE_PYTHON_LIB
    layout = reg.make_images(work, pylib if pylib and pylib.is_dir() else None)
    anon = reg.Registry(addr=REGISTRY_ADDR).start()
    auth = reg.Registry(auth=("e2e", "s3cret-pw"), addr=REGISTRY_ADDR).start()
    try:
        for r in (anon, auth):
            for n in ("sh", "big", "static", "broken"):
                r.push(layout, n)
        yield {"anon": anon, "auth": auth, "layout": layout}
    finally:
        anon.stop()
        auth.stop()


class Logs:
    def __init__(self):
        self.entries = []

    def __call__(self, e):
        self.entries.append(e)

    def text(self) -> str:
        return "\n".join(str(e.message) for e in self.entries)


# --- from base ---------------------------------------------------------------------------


def test_build_from_base_with_run_and_copy_then_cached(tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    name = uniq("e2e-base")
    # Content unique to this run: the first build is never a cache hit.
    (ctx / "app" / "hello.txt").write_text("from the context\n")
    (ctx / "app" / "run.sh").write_text(f"#!/bin/sh\n# {name}\necho script ran\n")
    os.chmod(ctx / "app" / "run.sh", 0o755)
    tpl = (
        Template(file_context_path=str(ctx))
        .from_base_image()
        .copy("app", "/home/user/app/")
        .run_cmd(f"echo built > /home/user/built.txt # {name}")
        .set_envs({"GREETING": "hello there"})
    )
    logs = Logs()
    t0 = time.monotonic()
    info = Template.build(tpl, name, on_build_logs=logs)
    first = time.monotonic() - t0
    try:
        assert info.template_id == name
        sbx = Sandbox.create(name, timeout=120)
        record_id(sbx.sandbox_id)
        try:
            r = sbx.commands.run("cat ~/built.txt ~/app/hello.txt; ~/app/run.sh; echo $GREETING; whoami; pwd")
            assert r.stdout == "built\nfrom the context\nscript ran\nhello there\nuser\n/home/user\n", r.stdout
            assert sbx.files.read("/home/user/app/hello.txt") == "from the context\n"
        finally:
            kill_quietly(sbx)
        logs2 = Logs()
        t1 = time.monotonic()
        Template.build(tpl, name, on_build_logs=logs2)
        cached = time.monotonic() - t1
        print(f"\nbuild from base (RUN + COPY): first {first:.2f}s, cached {cached:.2f}s")
        assert "CACHED" in logs2.text(), logs2.text()
        assert "Skipping upload" in logs2.text(), "the second build must not upload again"
        # Durations are printed, not asserted: under the full suite's parallel load a
        # bound here failed CI without anything being wrong (the cache hit is what the
        # two asserts above check).
    finally:
        delete_template(name)


def test_failing_run_names_its_step():
    name = uniq("e2e-fail")
    tpl = Template().from_base_image().run_cmd("echo fine").run_cmd("echo 'no such thing' >&2; exit 7")
    try:
        with pytest.raises(BuildException) as e:
            Template.build(tpl, name)
        msg = str(e.value)
        assert "exited with code 7" in msg and "no such thing" in msg and "step 2" in msg, msg
        # Nothing half-built is visible.
        assert httpx.get(f"{API_URL}/templates/aliases/{name}", headers=headers()).status_code in (200, 404)
        with pytest.raises(Exception):
            Sandbox.create(name, timeout=30)
    finally:
        delete_template(name)


def test_two_builds_at_once():
    names = [uniq("e2e-par"), uniq("e2e-par")]
    results = {}

    def go(n):
        try:
            t = Template().from_base_image().run_cmd(f"echo {n} > /tmp/which && sleep 1")
            Template.build(t, n)
            results[n] = "ok"
        except Exception as e:  # noqa: BLE001
            results[n] = repr(e)

    threads = [threading.Thread(target=go, args=(n,)) for n in names]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert results == {n: "ok" for n in names}, results
        for n in names:
            sbx = Sandbox.create(n, timeout=60)
            record_id(sbx.sandbox_id)
            try:
                assert sbx.files.read("/tmp/which") == f"{n}\n"
            finally:
                kill_quietly(sbx)
    finally:
        for n in names:
            delete_template(n)


def test_interrupted_upload_is_not_kept(tmp_path):
    name = uniq("e2e-upl")
    r = httpx.post(f"{API_URL}/v3/templates", headers=headers(), json={"name": name})
    assert r.status_code == 202, r.text
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    try:
        h = "ab" * 32
        link = httpx.get(f"{API_URL}/templates/{tid}/files/{h}", headers=headers())
        assert link.status_code == 201 and link.json()["present"] is False, link.text
        url = link.json()["url"]
        assert url.startswith(API_URL.rstrip("/")) or "/cubicle/uploads/" in url
        # Announce 1 MiB, send 1 KiB, hang up.
        import socket
        from urllib.parse import urlsplit

        u = urlsplit(url)
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(
            f"PUT {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Length: 1048576\r\n\r\n".encode() + b"x" * 1024
        )
        s.close()
        time.sleep(0.5)
        again = httpx.get(f"{API_URL}/templates/{tid}/files/{h}", headers=headers())
        assert again.json()["present"] is False, "an interrupted upload must not count as uploaded"
        start = httpx.post(
            f"{API_URL}/v2/templates/{tid}/builds/{bid}",
            headers=headers(),
            json={"fromImage": "e2bdev/base", "force": False, "steps": [
                {"type": "COPY", "args": ["x", "/x", "", ""], "filesHash": h, "force": False}]},
        )
        assert start.status_code == 202, start.text
        deadline = time.monotonic() + 120
        while True:
            st = httpx.get(f"{API_URL}/templates/{tid}/builds/{bid}/status", headers=headers()).json()
            if st["status"] in ("ready", "error") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert st["status"] == "error", st
        assert st["reason"]["step"] == "1" and "never uploaded" in st["reason"]["message"], st
    finally:
        delete_template(name)


def test_other_teams_cannot_see_or_take_a_template():
    if not KEY_B:
        pytest.skip("no second team key")
    name = uniq("e2e-team")
    Template.build(Template().from_base_image().run_cmd("true"), name)
    try:
        assert httpx.get(f"{API_URL}/templates/{name}", headers=headers(KEY_B)).status_code == 404
        taken = httpx.post(f"{API_URL}/v3/templates", headers=headers(KEY_B), json={"name": name})
        assert taken.status_code == 403, taken.text
        with pytest.raises(Exception):
            Sandbox.create(name, api_key=KEY_B, timeout=30)
        mine = [t["templateID"] for t in httpx.get(f"{API_URL}/templates", headers=headers()).json()]
        assert name in mine
        defaults = [t["templateID"] for t in httpx.get(f"{API_URL}/default-templates", headers=headers()).json()]
        assert "base" in defaults and name not in defaults
    finally:
        delete_template(name)


def test_tags_and_delete_refused_while_in_use():
    name = uniq("e2e-tags")
    Template.build(Template().from_base_image().run_cmd("echo v1 > /tmp/v"), f"{name}:v1")
    try:
        Template.build(Template().from_base_image().run_cmd("echo v2 > /tmp/v"), name, tags=["v2"])
        tags = {t.tag for t in Template.get_tags(name)}
        assert {"v1", "v2"} <= tags, tags
        sbx = Sandbox.create(f"{name}:v1", timeout=60)
        record_id(sbx.sandbox_id)
        try:
            assert sbx.files.read("/tmp/v") == "v1\n"
            r = httpx.delete(f"{API_URL}/templates/{name}", headers=headers())
            assert r.status_code == 400 and "used by" in r.json()["message"], r.text
        finally:
            kill_quietly(sbx)
        assert Template.exists(name)
    finally:
        delete_template(name)
    assert not Template.exists(name)


def test_layered_template_pause_resume_snapshot_fork_rollback_on_pinned_layers():
    """A sandbox of a built template (a stack of layers) pauses and resumes with its
    files, snapshots, forks and rolls back; a rebuild of the template in between does not
    change the layers it restores onto, and the template cannot be removed while a paused
    sandbox or a snapshot uses it."""
    name = uniq("e2e-stateful")
    tpl = lambda v: (  # noqa: E731
        Template().from_base_image().run_cmd(f"echo {v} > /tmp/layer-a").run_cmd(f"echo {v}-b > /tmp/layer-b # {name}")
    )
    Template.build(tpl("one"), name)
    sbx = child = fork = snap = None
    try:
        layers = template_config(name)[1]["layers"]
        assert len(layers) >= 3, f"base + two RUN layers expected, got {layers}"
        sbx = Sandbox.create(name, timeout=300)
        record_id(sbx.sandbox_id)
        sbx.files.write("/home/user/state.txt", "before the pause")
        assert sbx.pause() is True
        r = httpx.delete(f"{API_URL}/templates/{name}", headers=headers(), timeout=60)
        assert r.status_code == 400 and sbx.sandbox_id in r.json()["message"], r.text

        # A rebuild publishes other layers; the paused sandbox keeps its own.
        Template.build(tpl("two"), name)
        rebuilt = template_config(name)[1]["layers"]
        assert rebuilt != layers
        sbx.connect(timeout=300)
        assert sbx.files.read("/home/user/state.txt") == "before the pause"
        assert sbx.commands.run("cat /tmp/layer-a /tmp/layer-b").stdout == "one\none-b\n"

        snap = sbx.create_snapshot()
        sbx.files.write("/home/user/state.txt", "after the snapshot")
        child = Sandbox.create(snap.snapshot_id, timeout=120)
        record_id(child.sandbox_id)
        assert child.files.read("/home/user/state.txt") == "before the pause"
        assert child.commands.run("cat /tmp/layer-a").stdout == "one\n"
        [fork] = sbx.fork(count=1, timeout=120)
        record_id(fork.sandbox_id)
        assert fork.files.read("/home/user/state.txt") == "after the snapshot"
        assert fork.commands.run("cat /tmp/layer-b").stdout == "one-b\n"
        r = httpx.post(f"{API_URL}/sandboxes/{sbx.sandbox_id}/rollback", headers=headers(),
                       json={"snapshotID": snap.snapshot_id}, timeout=120)
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/state.txt") == "before the pause"

        # New sandboxes get the rebuilt layers.
        fresh = Sandbox.create(name, timeout=60)
        record_id(fresh.sandbox_id)
        try:
            assert fresh.commands.run("cat /tmp/layer-a").stdout == "two\n"
        finally:
            kill_quietly(fresh)

        for s in (sbx, child, fork):
            kill_quietly(s)
        # Only the snapshot uses the template now: still refused, naming it.
        r = httpx.delete(f"{API_URL}/templates/{name}", headers=headers(), timeout=60)
        assert r.status_code == 400 and "snapshot" in r.json()["message"], r.text
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        for s in (sbx, child, fork):
            if s is not None:
                kill_quietly(s)
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
        delete_template(name)
    assert not Template.exists(name)


# --- from images ------------------------------------------------------------------------


def test_image_from_local_registry_runs_the_sdk(images):
    anon = images["anon"]
    name = uniq("e2e-img")
    logs = Logs()
    t0 = time.monotonic()
    Template.build(
        Template().from_image(f"{anon.host}/big:1").run_cmd("echo from-image > /tmp/mark"),
        name,
        on_build_logs=logs,
    )
    took = time.monotonic() - t0
    print(f"\nbuild from a local-registry image (pull + unpack + RUN): {took:.2f}s")
    try:
        sbx = Sandbox.create(name, timeout=120)
        record_id(sbx.sandbox_id)
        try:
            r = sbx.commands.run("whoami; cat /tmp/mark; ls /opt/pylib | head -1; sudo -n true 2>&1 || echo nosudo")
            assert r.stdout.startswith("user\nfrom-image\n"), r.stdout
            r = sbx.commands.run("id -u", user="root")
            assert r.stdout == "0\n"
            sbx.files.write("/home/user/x.txt", "written")
            assert sbx.files.read("/home/user/x.txt") == "written"
        finally:
            kill_quietly(sbx)
    finally:
        delete_template(name)


def test_image_with_credentials(images):
    auth = images["auth"]
    ok = uniq("e2e-auth")
    bad = uniq("e2e-auth-bad")
    try:
        Template.build(Template().from_image(f"{auth.host}/sh:1", username="e2e", password="s3cret-pw"), ok)
        sbx = Sandbox.create(ok, timeout=60)
        record_id(sbx.sandbox_id)
        try:
            assert sbx.commands.run("echo $0; whoami").stdout.endswith("user\n")
        finally:
            kill_quietly(sbx)
        with pytest.raises(BuildException) as e:
            Template.build(Template().from_image(f"{auth.host}/sh:1", username="e2e", password="wrong"), bad)
        assert "registry" in str(e.value).lower(), str(e.value)
        with pytest.raises(BuildException):
            Template.build(Template().from_image(f"{auth.host}/sh:1"), bad)
    finally:
        delete_template(ok)
        delete_template(bad)


def test_broken_image_fails_the_base_step(images):
    name = uniq("e2e-broken")
    try:
        with pytest.raises(BuildException) as e:
            Template.build(Template().from_image(f"{images['anon'].host}/broken:1"), name)
        assert "diff id" in str(e.value), str(e.value)
    finally:
        delete_template(name)


def test_image_without_a_shell_still_runs_envd(images):
    name = uniq("e2e-static")
    failing = uniq("e2e-static-run")
    try:
        Template.build(Template().from_image(f"{images['anon'].host}/static:1"), name)
        sbx = Sandbox.create(name, timeout=60)
        record_id(sbx.sandbox_id)
        try:
            sbx.files.write("/tmp/note.txt", "no shell here")
            assert sbx.files.read("/tmp/note.txt") == "no shell here"
            names = {e.name for e in sbx.files.list("/")}
            assert "hello" in names, names
        finally:
            kill_quietly(sbx)
        with pytest.raises(BuildException) as e:
            Template.build(Template().from_image(f"{images['anon'].host}/static:1").run_cmd("true"), failing)
        assert "no /bin/sh" in str(e.value)
    finally:
        delete_template(name)
        delete_template(failing)  # its failed build's record


def test_two_images_share_layers_once(images):
    """sh:1 and big:1 share their first layer: the layer store holds it once."""
    if not STATE_DIRS:
        pytest.skip("no state dir")
    a, b = uniq("e2e-sh"), uniq("e2e-big")
    anon = images["anon"]
    try:
        t0 = time.monotonic()
        Template.build(Template().from_image(f"{anon.host}/sh:1"), a)
        t1 = time.monotonic()
        Template.build(Template().from_image(f"{anon.host}/big:1"), b)
        t2 = time.monotonic()
        # (against a cluster each may be built on another node: each node's layer store
        # holds a shared layer once)
        (sa, ca), (sb, cb) = template_config(a), template_config(b)
        la, lb = ca["layers"], cb["layers"]
        shared = set(la) & set(lb)
        assert shared, (la, lb)
        for l in shared:
            assert (Path(sa) / "layers" / l).is_dir() and (Path(sb) / "layers" / l).is_dir()
        print(f"\nsh:1 {t1 - t0:.2f}s, big:1 {t2 - t1:.2f}s; shared layers: {len(shared)}")
    finally:
        delete_template(a)
        delete_template(b)


# --- the CLI ------------------------------------------------------------------------------


def cli(*args, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    # Always this run's state directory: the default (/var/lib/cubicle) is the operator's.
    state = ["--state-dir", STATE] if STATE else []
    return subprocess.run([CUBICLE, *args, *state], capture_output=True, text=True, env=env, timeout=600)


def test_cli_dockerfile_build(tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "greet.txt").write_text("hello from a Dockerfile\n")
    (ctx / "Dockerfile").write_text(
        "FROM e2bdev/base\n"
        "ARG WHO=docker\n"
        "ENV WHO=${WHO} PORT=8123\n"
        "RUN mkdir -p /srv && echo built-by-$WHO > /srv/who\n"
        "COPY --chown=user:user greet.txt /srv/greet.txt\n"
        "WORKDIR /srv\n"
        "USER user\n"
        "CMD [\"python3\", \"-m\", \"http.server\", \"8123\"]\n"
    )
    name = uniq("e2e-df")
    r = cli("template", "build", name, "-f", str(ctx / "Dockerfile"), str(ctx), "--build-arg", "WHO=cli",
            "--ready-cmd", "curl -sf http://127.0.0.1:8123/ >/dev/null")
    try:
        assert r.returncode == 0, r.stderr
        sbx = Sandbox.create(name, timeout=120)
        record_id(sbx.sandbox_id)
        try:
            out = sbx.commands.run("cat /srv/who /srv/greet.txt; stat -c %U /srv/greet.txt; pwd; curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8123/").stdout
            assert out == "built-by-cli\nhello from a Dockerfile\nuser\n/srv\n200", out
        finally:
            kill_quietly(sbx)
    finally:
        delete_template(name)


def test_cli_dockerfile_errors_say_what(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM e2bdev/base AS one\nFROM e2bdev/base\n")
    r = cli("template", "build", uniq("e2e-df-bad"), "-f", str(tmp_path / "Dockerfile"))
    assert r.returncode != 0 and "multi-stage" in r.stderr, r.stderr
    (tmp_path / "Dockerfile").write_text("FROM e2bdev/base\nRUN false\n")
    name = uniq("e2e-df-fail")
    try:
        r = cli("template", "build", name, "-f", str(tmp_path / "Dockerfile"))
        assert r.returncode == 1 and "step 3" in r.stderr and "exited with code 1" in r.stderr, r.stderr
    finally:
        delete_template(name)


def test_layer_gc_answers_what_it_removed():
    """`POST /cubicle/templates/gc` (Cubicle's own): removes what nothing needs and says
    so; through a replica every node collects its own layers (each one's answer under
    `nodes`)."""
    r = httpx.post(f"{API_URL}/cubicle/templates/gc", headers=headers(), timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["removed"], dict) and body["freedBytes"] >= 0 and body["kept"] >= 1, body
    if CLUSTER:
        assert len(body["nodes"]) >= 2 and all("error" not in n for n in body["nodes"].values()), body
    # The templates the suite uses are kept.
    sbx = Sandbox.create("tiny", timeout=30)
    record_id(sbx.sandbox_id)
    kill_quietly(sbx)
