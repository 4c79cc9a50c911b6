"""Commands through the official async Python SDK (`AsyncSandbox.commands`)."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    NotFoundException,
    TimeoutException,
)

from helpers import pids_with_cmdline


async def test_run_stdout_stderr(asbx: AsyncSandbox):
    r = await asbx.commands.run("echo hi; echo there >&2")
    assert (r.stdout, r.stderr, r.exit_code, r.error) == ("hi\n", "there\n", 0, None)


async def test_exit_exception(asbx: AsyncSandbox):
    with pytest.raises(CommandExitException) as ei:
        await asbx.commands.run("echo partial; exit 42")
    assert ei.value.exit_code == 42
    assert ei.value.stdout == "partial\n"


async def test_envs_cwd_user(asbx: AsyncSandbox):
    r = await asbx.commands.run('echo "$X $(pwd) $(whoami)"', envs={"X": "y"}, cwd="/tmp")
    assert r.stdout == "y /tmp user\n"
    r = await asbx.commands.run("whoami", user="root")
    assert r.stdout == "root\n"


async def test_timeout(asbx: AsyncSandbox, unique: str):
    marker = f"cbatimeout{unique}"
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        await asbx.commands.run(f"sleep 10; echo {marker}", timeout=1)
    assert time.monotonic() - t0 < 5
    for _ in range(100):
        listed = [p for p in await asbx.commands.list() if marker in " ".join(p.args)]
        if not listed and not pids_with_cmdline(marker):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("timed-out command still running")


async def test_background_wait_and_callbacks(asbx: AsyncSandbox):
    seen = []
    h = await asbx.commands.run(
        "echo one; sleep 0.3; echo two >&2",
        background=True,
        on_stdout=lambda s: seen.append(("out", s)),
        on_stderr=lambda s: seen.append(("err", s)),
    )
    assert h.pid > 0
    r = await h.wait()
    assert r.stdout == "one\n" and r.stderr == "two\n"
    assert seen == [("out", "one\n"), ("err", "two\n")]


async def test_async_callbacks_are_awaited(asbx: AsyncSandbox):
    seen = []

    async def on_out(s):
        await asyncio.sleep(0)
        seen.append(s)

    await asbx.commands.run("echo a; sleep 0.1; echo b", on_stdout=on_out)
    assert "".join(seen) == "a\nb\n"


async def test_background_kill(asbx: AsyncSandbox):
    h = await asbx.commands.run("sleep 30", background=True)
    assert h.pid in [p.pid for p in await asbx.commands.list()]
    assert await h.kill() is True
    with pytest.raises(CommandExitException):
        await h.wait()
    for _ in range(100):
        if h.pid not in [p.pid for p in await asbx.commands.list()]:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("killed process still listed")
    assert await asbx.commands.kill(h.pid) is False


async def test_send_and_close_stdin(asbx: AsyncSandbox):
    h = await asbx.commands.run("cat; echo EOF", background=True, stdin=True)
    await h.send_stdin("hello ")
    await asbx.commands.send_stdin(h.pid, "world\n")
    await asyncio.sleep(0.2)
    assert h.exit_code is None, "cat must still be running before close_stdin"
    await asbx.commands.close_stdin(h.pid)
    r = await h.wait()
    assert r.stdout == "hello world\nEOF\n"


async def test_connect(asbx: AsyncSandbox):
    h = await asbx.commands.run("for i in 1 2 3 4 5; do echo n$i; sleep 0.3; done", background=True)
    await asyncio.sleep(0.4)
    await h.disconnect()
    h2 = await asbx.commands.connect(h.pid)
    r = await h2.wait()
    assert r.exit_code == 0
    assert r.stdout.endswith("n5\n")


async def test_connect_unknown(asbx: AsyncSandbox):
    with pytest.raises(NotFoundException):
        await asbx.commands.connect(999_999)


async def test_parallel_runs(asbx: AsyncSandbox):
    results = await asyncio.gather(*(asbx.commands.run(f"sleep 0.3; echo {i}") for i in range(10)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]
