"""The same user paths with `AsyncSandbox` (async Python SDK) through `cubicle serve`:
lifecycle, list, connect, kill, metrics, commands, files, PTY, watch, error paths."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone

import httpx
import pytest

from conftest import FAST_TEMPLATE, SANDBOX_URL, Tracker, unique
from e2b import AsyncSandbox, FilesystemEventType, PtySize, SandboxQuery, SandboxState
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    SandboxException,
    SandboxNotFoundException,
)


async def alist_all(query=None, limit=None, **kw):
    pager = AsyncSandbox.list(query=query, limit=limit, **kw)
    out = []
    while pager.has_next:
        out.extend(await pager.next_items())
    return out


async def test_async_lifecycle(sandboxes: Tracker):
    tag = unique()
    sbx = await sandboxes.acreate(metadata={"tag": tag}, envs={"A_ENV": "async"}, timeout=90)
    info = await sbx.get_info()
    assert info.state == "running" and info.metadata == {"tag": tag}
    assert abs((info.end_at - info.started_at).total_seconds() - 90) <= 5
    assert (await sbx.commands.run('echo "$A_ENV"')).stdout == "async\n"
    assert await sbx.is_running() is True

    listed = await alist_all(SandboxQuery(metadata={"tag": tag}, state=[SandboxState.RUNNING]))
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]

    await sbx.set_timeout(45)
    end = (await sbx.get_info()).end_at
    assert abs((end - datetime.now(timezone.utc)).total_seconds() - 45) <= 5

    other = await AsyncSandbox.connect(sbx.sandbox_id)
    assert (await other.commands.run("echo c")).stdout == "c\n"

    assert await AsyncSandbox.kill(sbx.sandbox_id) is True
    assert await AsyncSandbox.kill(sbx.sandbox_id) is False
    assert await sbx.is_running() is False
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(sbx.sandbox_id)


async def test_async_pagination(sandboxes: Tracker):
    tag = unique()
    made = await asyncio.gather(*[sandboxes.acreate(FAST_TEMPLATE, metadata={"tag": tag}) for _ in range(3)])
    pager = AsyncSandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=2)
    p1 = await pager.next_items()
    assert len(p1) == 2 and pager.has_next
    p2 = await pager.next_items()
    assert len(p2) == 1 and not pager.has_next
    assert {s.sandbox_id for s in p1 + p2} == {s.sandbox_id for s in made}


async def test_async_dataplane(asbx: AsyncSandbox):
    r = await asbx.commands.run('echo "$CUBICLE_E2E_GLOBAL $(whoami)"')
    assert r.stdout == "from-create user\n"
    assert (await asbx.commands.run("whoami", user="root")).stdout == "root\n"

    d = f"/home/user/a-{uuid.uuid4().hex[:8]}"
    await asbx.files.make_dir(d)
    events = []
    h = await asbx.files.watch_dir(d, on_event=events.append)
    try:
        await asbx.files.write(f"{d}/x.txt", "async data")
        assert await asbx.files.read(f"{d}/x.txt") == "async data"
        assert [e.name for e in await asbx.files.list(d)] == ["x.txt"]
        for _ in range(200):
            if any(e.name == "x.txt" and e.type == FilesystemEventType.CREATE for e in events):
                break
            await asyncio.sleep(0.05)
        assert any(e.name == "x.txt" and e.type == FilesystemEventType.CREATE for e in events), events
    finally:
        await h.stop()

    out = bytearray()
    pty = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=out.extend)
    try:
        await asbx.pty.send_stdin(pty.pid, b"echo apty-$((7*6))\n")
        for _ in range(200):
            if b"apty-42" in out:
                break
            await asyncio.sleep(0.05)
        assert b"apty-42" in out, bytes(out)
    finally:
        await asbx.pty.kill(pty.pid)

    metrics = []
    for _ in range(40):
        metrics = await asbx.get_metrics()
        if metrics:
            break
        await asyncio.sleep(0.5)
    assert metrics and metrics[-1].mem_total > 0


async def test_async_get_host_and_urls(asbx: AsyncSandbox):
    d = f"/tmp/awww-{uuid.uuid4().hex[:6]}"
    await asbx.files.write(f"{d}/i.txt", "async web")
    handle = await asbx.commands.run(f"cd {d} && exec python3 -m http.server 8000", background=True)
    try:
        headers = {"E2b-Sandbox-Id": asbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
        async with httpx.AsyncClient(timeout=10) as c:
            ok = None
            for _ in range(60):
                r = await c.get(f"{SANDBOX_URL}/i.txt", headers=headers)
                if r.status_code == 200:
                    ok = r
                    break
                await asyncio.sleep(0.3)
            assert ok is not None and ok.text == "async web"
            p = f"/home/user/adl-{uuid.uuid4().hex[:6]}.txt"
            await asbx.files.write(p, "async download")
            r = await c.get(asbx.download_url(p))
            assert r.status_code == 200 and r.text == "async download", (r.status_code, r.text)
    finally:
        await handle.kill()


async def test_async_errors():
    missing = "i" + "2" * 20
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(missing)
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.connect(missing)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.set_timeout(missing, 10)
    assert await AsyncSandbox.kill(missing) is False
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(FAST_TEMPLATE, api_key="e2b_" + "f" * 40)
    name = f"missing-template-{unique()}"
    with pytest.raises(SandboxException) as ei:
        await AsyncSandbox.create(name)
    assert name in str(ei.value)


@pytest.mark.timeout(120)
async def test_async_timeout_elapsed(sandboxes: Tracker):
    sbx = await sandboxes.acreate(FAST_TEMPLATE, timeout=3)
    assert await sbx.is_running()
    for _ in range(60):
        if not await sbx.is_running():
            break
        await asyncio.sleep(0.5)
    assert await sbx.is_running() is False
