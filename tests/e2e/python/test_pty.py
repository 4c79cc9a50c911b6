"""PTYs through the official Python SDK (sync and async): create, input, output,
resize (seen by `stty size`), kill, exit."""

from __future__ import annotations

import asyncio
import threading

import pytest
from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox

from helpers import pids_with_cmdline, poll


class PtyReader:
    """Collects a sync PTY handle's output on a background thread."""

    def __init__(self, handle):
        self.handle = handle
        self.buf = bytearray()
        self.result = None
        self.error = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.result = self.handle.wait(on_pty=self._on)
        except Exception as e:  # recorded for the test to inspect
            self.error = e

    def _on(self, chunk: bytes):
        with self.lock:
            self.buf.extend(chunk)

    def text(self) -> str:
        with self.lock:
            return self.buf.decode(errors="replace")

    def wait_for(self, needle: str, timeout: float = 10.0) -> bool:
        return bool(poll(lambda: needle in self.text(), timeout=timeout))


def test_pty_sync_input_output_resize_kill(sbx: Sandbox):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    reader = PtyReader(h)
    try:
        assert h.pid in [p.pid for p in sbx.commands.list()], "PTYs are listed"
        sbx.pty.send_stdin(h.pid, b"echo $((6*7))-marker\n")
        assert reader.wait_for("42-marker"), f"no echo output; got {reader.text()!r}"

        sbx.pty.send_stdin(h.pid, b'echo "tty=$(tty) term=$TERM u=$(whoami)"\n')
        assert reader.wait_for("tty=/dev/pts/"), reader.text()
        assert reader.wait_for("term=xterm-256color"), reader.text()
        assert reader.wait_for("u=user"), reader.text()

        sbx.pty.send_stdin(h.pid, b"stty size\n")
        assert reader.wait_for("24 80"), f"initial size; got {reader.text()!r}"

        sbx.pty.resize(h.pid, PtySize(rows=40, cols=123))
        sbx.pty.send_stdin(h.pid, b"stty size\n")
        assert reader.wait_for("40 123"), f"resized size; got {reader.text()!r}"
    finally:
        killed = sbx.pty.kill(h.pid)
    assert killed is True
    reader.thread.join(10)
    assert not reader.thread.is_alive(), "PTY stream did not end after kill"
    assert isinstance(reader.error, CommandExitException)
    assert poll(lambda: h.pid not in [p.pid for p in sbx.commands.list()])


def test_pty_exit_ends_stream(sbx: Sandbox):
    h = sbx.pty.create(PtySize(rows=10, cols=40))
    reader = PtyReader(h)
    sbx.pty.send_stdin(h.pid, b"exit 0\n")
    reader.thread.join(10)
    assert not reader.thread.is_alive()
    assert reader.error is None, reader.error
    assert reader.result.exit_code == 0


def test_pty_as_root_with_cwd_and_envs(sbx: Sandbox):
    h = sbx.pty.create(PtySize(rows=24, cols=80), user="root", cwd="/tmp", envs={"CBPTY": "yes"})
    reader = PtyReader(h)
    try:
        sbx.pty.send_stdin(h.pid, b'echo "[$(whoami)|$(pwd)|$CBPTY]"\n')
        assert reader.wait_for("[root|/tmp|yes]"), reader.text()
    finally:
        sbx.pty.kill(h.pid)
    reader.thread.join(10)


def test_pty_ctrl_c_interrupts(sbx: Sandbox):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    reader = PtyReader(h)
    try:
        sbx.pty.send_stdin(h.pid, b"sleep 30.123\n")
        # Wait until the shell runs it (seeing the line echoed is not enough: a ^C that
        # reaches bash between reading the line and starting `sleep` interrupts nothing).
        # The bracket keeps pgrep's own shell from matching.
        running = poll(
            lambda: sbx.commands.run("pgrep -f 'sleep 30[.]123' || true").stdout.strip(),
            timeout=10,
        )
        assert running, f"sleep did not start: {reader.text()!r}"
        sbx.pty.send_stdin(h.pid, b"\x03")
        sbx.pty.send_stdin(h.pid, b"echo after-$((1+1))\n")
        assert reader.wait_for("after-2", timeout=5), f"Ctrl-C did not interrupt: {reader.text()!r}"
    finally:
        sbx.pty.kill(h.pid)
    reader.thread.join(10)


async def test_pty_async(asbx: AsyncSandbox):
    buf = bytearray()
    h = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=lambda b: buf.extend(b))

    async def wait_for(needle: str, timeout: float = 10.0):
        for _ in range(int(timeout / 0.05)):
            if needle in buf.decode(errors="replace"):
                return True
            await asyncio.sleep(0.05)
        return False

    await asbx.pty.send_stdin(h.pid, b"echo $((7*6))-async\n")
    assert await wait_for("42-async"), buf.decode(errors="replace")
    await asbx.pty.resize(h.pid, PtySize(rows=33, cols=99))
    await asbx.pty.send_stdin(h.pid, b"stty size\n")
    assert await wait_for("33 99"), buf.decode(errors="replace")
    assert await asbx.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        await asyncio.wait_for(h.wait(), 10)


def test_pty_kill_ends_its_children(sbx: Sandbox, unique: str):
    secs = f"31.{int(unique[:6], 16) % 1000000:06d}"
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    reader = PtyReader(h)
    sbx.pty.send_stdin(h.pid, f"sleep {secs}\n".encode())
    assert poll(lambda: pids_with_cmdline(f"sleep {secs}"), timeout=5), "sleep did not start"
    assert sbx.pty.kill(h.pid) is True
    reader.thread.join(10)
    assert poll(lambda: not pids_with_cmdline(f"sleep {secs}"), timeout=5), (
        f"`sleep {secs}` survived the PTY being killed"
    )
