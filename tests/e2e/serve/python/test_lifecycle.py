"""Sandbox lifecycle through `cubicle serve` with the sync Python SDK, configured only by
E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY: create (template, metadata, envs, timeout),
get_info, list (state + metadata filters, pagination), set_timeout, is_running, connect,
kill, Sandbox.kill(id), get_metrics, timeout expiry."""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone

import pytest

from conftest import FAST_TEMPLATE, Tracker, poll, unique
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import NotFoundException, SandboxException, SandboxNotFoundException

ID_RE = re.compile(r"^[a-z0-9]+$")


def now() -> datetime:
    return datetime.now(timezone.utc)


def list_all(query=None, limit=None, **kw):
    pager = Sandbox.list(query=query, limit=limit, **kw)
    out = []
    while pager.has_next:
        out.extend(pager.next_items())
    return out


def test_create_get_info_fields(sandboxes: Tracker):
    tag = unique()
    before = now()
    sbx = sandboxes.create(metadata={"suite": "serve", "tag": tag}, envs={"CB_ENV": "v1"}, timeout=120)
    assert ID_RE.match(sbx.sandbox_id), sbx.sandbox_id
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == "running"
    assert info.metadata == {"suite": "serve", "tag": tag}
    assert info.template_id, info
    assert info.cpu_count >= 1 and info.memory_mb >= 128, info
    assert info.envd_version and info.envd_version[0].isdigit()
    assert before - timedelta(seconds=5) <= info.started_at <= now() + timedelta(seconds=5), info.started_at
    # end = start + 120 s
    assert abs((info.end_at - info.started_at).total_seconds() - 120) <= 5, (info.started_at, info.end_at)
    # the class-method form answers the same
    info2 = Sandbox.get_info(sbx.sandbox_id)
    assert info2.sandbox_id == sbx.sandbox_id and info2.metadata == info.metadata
    # the create-time envs are visible to commands, as is the sandbox identity
    r = sbx.commands.run('echo "$CB_ENV|$E2B_SANDBOX_ID"')
    assert r.stdout == f"v1|{sbx.sandbox_id}\n"


def test_default_template_and_timeout(sandboxes: Tracker):
    """`Sandbox.create()` with no arguments: the SDK default template `base`, server
    default timeout 300 s."""
    sbx = Sandbox.create()
    sandboxes.track(sbx.sandbox_id)
    info = sbx.get_info()
    assert info.state == "running"
    assert abs((info.end_at - info.started_at).total_seconds() - 300) <= 5, info
    assert sbx.commands.run("cat /etc/os-release").stdout.find("Debian") >= 0


def test_list_filters_and_pagination(sandboxes: Tracker):
    tag = unique()
    made = [
        sandboxes.create(FAST_TEMPLATE, metadata={"tag": tag, "idx": str(i), "odd key&": "v a=l%"})
        for i in range(3)
    ]
    ids = {s.sandbox_id for s in made}
    other = sandboxes.create(FAST_TEMPLATE, metadata={"tag": "not-" + tag})

    q = SandboxQuery(metadata={"tag": tag})
    listed = list_all(q)
    assert {s.sandbox_id for s in listed} == ids
    for s in listed:
        assert s.state == "running"
        assert s.metadata["tag"] == tag and s.metadata["odd key&"] == "v a=l%"
        assert s.started_at and s.end_at and s.cpu_count >= 1

    # two metadata keys (AND), including characters that need the double encoding
    q2 = SandboxQuery(metadata={"tag": tag, "idx": "1"})
    assert [s.sandbox_id for s in list_all(q2)] == [made[1].sandbox_id]
    q3 = SandboxQuery(metadata={"odd key&": "v a=l%", "tag": tag})
    assert {s.sandbox_id for s in list_all(q3)} == ids

    # state filter
    assert {s.sandbox_id for s in list_all(SandboxQuery(metadata={"tag": tag}, state=[SandboxState.RUNNING]))} == ids
    assert list_all(SandboxQuery(metadata={"tag": tag}, state=[SandboxState.PAUSED])) == []

    # pagination: limit 2 → two pages (2 + 1), via X-Next-Token
    pager = Sandbox.list(query=q, limit=2)
    assert pager.has_next
    page1 = pager.next_items()
    assert len(page1) == 2, page1
    assert pager.has_next and pager.next_token, "expected a next token after a full page"
    page2 = pager.next_items()
    assert len(page2) == 1, page2
    assert not pager.has_next
    assert {s.sandbox_id for s in page1 + page2} == ids

    # the unfiltered list contains everything we made (no metadata filter at all)
    everything = {s.sandbox_id for s in list_all()}
    assert ids | {other.sandbox_id} <= everything

    # killed sandboxes disappear from the list
    made[0].kill()
    assert {s.sandbox_id for s in list_all(q)} == ids - {made[0].sandbox_id}


def test_list_order_and_started_after(sandboxes: Tracker):
    tag = unique()
    a = sandboxes.create(FAST_TEMPLATE, metadata={"tag": tag})
    time.sleep(1.1)
    mid = now()
    b = sandboxes.create(FAST_TEMPLATE, metadata={"tag": tag})
    q = SandboxQuery(metadata={"tag": tag})
    assert [s.sandbox_id for s in list_all(q, order="asc")] == [a.sandbox_id, b.sandbox_id]
    assert [s.sandbox_id for s in list_all(q, order="desc")] == [b.sandbox_id, a.sandbox_id]
    q_after = SandboxQuery(metadata={"tag": tag}, started_after=mid)
    assert [s.sandbox_id for s in list_all(q_after)] == [b.sandbox_id]


def test_set_timeout_shortens_and_extends(sandboxes: Tracker):
    sbx = sandboxes.create(FAST_TEMPLATE, timeout=600)
    sbx.set_timeout(60)
    end = sbx.get_info().end_at
    assert abs((end - now()).total_seconds() - 60) <= 5, end
    Sandbox.set_timeout(sbx.sandbox_id, 900)
    end = sbx.get_info().end_at
    assert abs((end - now()).total_seconds() - 900) <= 5, end


def test_is_running_and_kill(sandboxes: Tracker):
    sbx = sandboxes.create()
    assert sbx.is_running() is True
    assert sbx.kill() is True
    assert sbx.is_running() is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_class_kill_true_then_false(sandboxes: Tracker):
    sbx = sandboxes.create(FAST_TEMPLATE)
    assert Sandbox.kill(sbx.sandbox_id) is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert sbx.sandbox_id not in {s.sandbox_id for s in list_all()}


def test_connect(sandboxes: Tracker):
    sbx = sandboxes.create(timeout=60)
    sbx.files.write("/home/user/connect.txt", "hello from the first client")
    other = Sandbox.connect(sbx.sandbox_id)
    assert other.sandbox_id == sbx.sandbox_id
    assert other.files.read("/home/user/connect.txt") == "hello from the first client"
    assert other.commands.run("echo via-connect").stdout == "via-connect\n"
    # connect with a longer timeout extends a running sandbox (never shortens it)
    Sandbox.connect(sbx.sandbox_id, timeout=600)
    end = sbx.get_info().end_at
    assert abs((end - now()).total_seconds() - 600) <= 5, end
    Sandbox.connect(sbx.sandbox_id, timeout=30)
    end2 = sbx.get_info().end_at
    assert end2 >= end - timedelta(seconds=1), (end, end2)
    # instance connect (Python SDK: sbx.connect())
    again = sbx.connect()
    assert again.is_running()


def test_get_metrics(sandboxes: Tracker):
    sbx = sandboxes.create()
    sbx.commands.run("head -c 20000000 /dev/urandom | sha256sum >/dev/null")
    metrics = poll(lambda: sbx.get_metrics(), timeout=20, interval=1)
    assert metrics, "get_metrics returned no samples within 20 s"
    m = metrics[-1]
    assert m.cpu_count >= 1
    assert 0 <= m.cpu_used_pct
    assert 0 < m.mem_used <= m.mem_total, m
    assert m.mem_total >= 64 * 1024 * 1024, m
    assert 0 <= m.disk_used <= m.disk_total and m.disk_total > 0, m
    assert abs((m.timestamp - now()).total_seconds()) < 120, m.timestamp
    # class-method form
    assert Sandbox.get_metrics(sbx.sandbox_id) is not None


@pytest.mark.timeout(120)
def test_timeout_elapsed_kills(sandboxes: Tracker):
    sbx = sandboxes.create(FAST_TEMPLATE, timeout=3)
    assert sbx.is_running()
    assert poll(lambda: not sbx.is_running(), timeout=30, interval=0.5), (
        "sandbox still running 30 s after a 3 s timeout"
    )
    with pytest.raises(SandboxNotFoundException):
        sbx.get_info()
    assert sbx.sandbox_id not in {s.sandbox_id for s in list_all()}
    assert Sandbox.kill(sbx.sandbox_id) is False


@pytest.mark.timeout(120)
def test_set_timeout_short_then_expires(sandboxes: Tracker):
    sbx = sandboxes.create(FAST_TEMPLATE, timeout=600)
    sbx.set_timeout(2)
    assert poll(lambda: not sbx.is_running(), timeout=30, interval=0.5)


def test_idempotency_key(sandboxes: Tracker):
    key = f"cb-e2e-{unique()}"
    a = sandboxes.create(FAST_TEMPLATE, idempotency_key=key)
    b = sandboxes.create(FAST_TEMPLATE, idempotency_key=key)
    assert a.sandbox_id == b.sandbox_id, "same Idempotency-Key must return the same sandbox"


def test_unknown_sandbox_errors():
    missing = "i" + "0" * 20
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(missing)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(missing)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(missing, 30)
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(missing)
    assert Sandbox.kill(missing) is False


def test_unknown_template_is_a_clear_error():
    name = f"no-such-template-{unique()}"
    with pytest.raises(SandboxException) as ei:
        Sandbox.create(name)
    assert name in str(ei.value), f"error does not name the template: {ei.value}"
    assert getattr(ei.value, "status_code", None) in (400, 404), ei.value


def test_wrong_key_is_authentication_error(sandboxes: Tracker):
    from e2b.exceptions import AuthenticationException

    with pytest.raises(AuthenticationException):
        Sandbox.create(FAST_TEMPLATE, api_key="e2b_wrong" + unique())
    sbx = sandboxes.create(FAST_TEMPLATE)
    bad = "e2b_" + "0" * 40
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(sbx.sandbox_id, api_key=bad)
    with pytest.raises(AuthenticationException):
        Sandbox.kill(sbx.sandbox_id, api_key=bad)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=bad).next_items()
    with pytest.raises(AuthenticationException):
        Sandbox.connect(sbx.sandbox_id, api_key=bad)
    with pytest.raises(AuthenticationException):
        Sandbox.set_timeout(sbx.sandbox_id, 30, api_key=bad)
    # the wrong key did nothing
    assert sbx.is_running()


@pytest.mark.parametrize("ref", ["tiny:default", "tiny:latest", "e2b/tiny", "myteam/tiny:default"])
def test_template_references(sandboxes: Tracker, ref):
    """`name:tag` and `namespace/name` references resolve to the built-in template."""
    sbx = sandboxes.create(ref)
    info = sbx.get_info()
    assert info.state == "running"
    assert "tiny" in (info.template_id + " " + (info.name or "")), info


def test_unknown_tag_is_a_clear_error():
    with pytest.raises(SandboxException) as ei:
        Sandbox.create("tiny:v999")
    assert "v999" in str(ei.value), ei.value


def test_list_template_filter(sandboxes: Tracker):
    tag = unique()
    t = sandboxes.create(FAST_TEMPLATE, metadata={"tag": tag})
    b = sandboxes.create(metadata={"tag": tag})
    assert {s.sandbox_id for s in list_all(SandboxQuery(metadata={"tag": tag}, template=FAST_TEMPLATE))} == {t.sandbox_id}
    assert {s.sandbox_id for s in list_all(SandboxQuery(metadata={"tag": tag}, template="base"))} == {b.sandbox_id}
