"""Commands through the official sync Python SDK (`Sandbox.commands`) against envd:
output, exit codes, envs, cwd, users, timeouts, background handles, stdin,
list, connect and output callbacks."""

from __future__ import annotations

import time
import uuid

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    TimeoutException,
)

from helpers import pids_with_cmdline, poll


def test_stdout_and_exit_code_zero(sbx: Sandbox):
    r = sbx.commands.run("echo hello")
    assert r.stdout == "hello\n"
    assert r.stderr == ""
    assert r.exit_code == 0
    assert r.error is None


def test_stderr_is_separate(sbx: Sandbox):
    r = sbx.commands.run("echo out; echo oops >&2")
    assert r.stdout == "out\n"
    assert r.stderr == "oops\n"
    assert r.exit_code == 0


def test_nonzero_exit_raises_command_exit_exception(sbx: Sandbox):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    e = ei.value
    assert e.exit_code == 3
    assert e.stdout == "out\n"
    assert e.stderr == "err\n"
    assert e.error and "3" in e.error, f"error should describe the exit status, got {e.error!r}"


def test_exit_code_of_failing_binary(sbx: Sandbox):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("/definitely/not/a/command")
    assert ei.value.exit_code == 127
    assert "not/a/command" in ei.value.stderr


def test_envs_are_passed(sbx: Sandbox):
    r = sbx.commands.run('echo "$FOO|$BAR"', envs={"FOO": "a", "BAR": "b c=d"})
    assert r.stdout == "a|b c=d\n"


def test_default_env_of_user(sbx: Sandbox):
    r = sbx.commands.run('echo "$HOME|$USER|$LOGNAME"; echo "$PATH"')
    first, path = r.stdout.splitlines()
    assert first == "/home/user|user|user"
    assert "/usr/bin" in path.split(":")


def test_per_call_envs_override_user_env(sbx: Sandbox):
    r = sbx.commands.run("echo $USER", envs={"USER": "someone"})
    assert r.stdout == "someone\n"


def test_cwd_default_is_home(sbx: Sandbox):
    assert sbx.commands.run("pwd").stdout == "/home/user\n"


def test_cwd_explicit(sbx: Sandbox, root_dir: str):
    assert sbx.commands.run("pwd", cwd=root_dir).stdout == f"{root_dir}\n"
    assert sbx.commands.run("pwd", cwd="/").stdout == "/\n"


def test_cwd_missing_is_invalid_argument(sbx: Sandbox):
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("pwd", cwd=f"/nonexistent-{uuid.uuid4().hex}")


def test_default_user_and_root(sbx: Sandbox):
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("id -u; id -g").stdout == "1000\n1000\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"
    assert sbx.commands.run("echo $HOME", user="root").stdout == "/root\n"
    assert sbx.commands.run("pwd", user="root").stdout == "/root\n"


def test_unknown_user_is_rejected(sbx: Sandbox):
    with pytest.raises(AuthenticationException):
        sbx.commands.run("whoami", user="no-such-user-cb")


def test_timeout_kills_the_process(sbx: Sandbox, unique: str):
    marker = f"cbtimeout{unique}"
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run(f"sleep 10; echo {marker}", timeout=1)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"timeout=1 took {elapsed:.1f}s"

    def gone():
        listed = [p for p in sbx.commands.list() if marker in " ".join(p.args)]
        return not listed and not pids_with_cmdline(marker)

    assert poll(gone, timeout=5), "process still running after its timeout"


def test_timeout_kills_the_whole_process_group(sbx: Sandbox, unique: str):
    # the child `sleep` has its own unique command line; it must not outlive the timeout
    secs = f"30.{int(unique[:6], 16) % 1000000:06d}"
    with pytest.raises(TimeoutException):
        sbx.commands.run(f"sleep {secs}; true", timeout=1)
    assert poll(lambda: not pids_with_cmdline(f"sleep {secs}"), timeout=5), (
        f"child `sleep {secs}` survived the command timeout"
    )


def test_background_wait(sbx: Sandbox):
    h = sbx.commands.run("sleep 0.5; echo done", background=True)
    assert isinstance(h.pid, int) and h.pid > 0
    assert h.pid in [p.pid for p in sbx.commands.list()]
    r = h.wait()
    assert r.stdout == "done\n"
    assert r.exit_code == 0
    assert poll(lambda: h.pid not in [p.pid for p in sbx.commands.list()])


def test_background_kill(sbx: Sandbox):
    h = sbx.commands.run("sleep 30", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    t0 = time.monotonic()
    assert h.kill() is True
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert time.monotonic() - t0 < 5
    assert ei.value.exit_code != 0
    assert poll(lambda: h.pid not in [p.pid for p in sbx.commands.list()])
    # killing a finished process reports "not found" as False
    assert sbx.commands.kill(h.pid) is False


def test_kill_by_pid(sbx: Sandbox):
    h = sbx.commands.run("sleep 30", background=True)
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_kill_unknown_pid_is_false(sbx: Sandbox):
    assert sbx.commands.kill(999_999) is False


def test_send_stdin(sbx: Sandbox):
    h = sbx.commands.run("read a; read b; echo \"got:$a,$b\"", background=True, stdin=True)
    h.send_stdin("one\n")
    sbx.commands.send_stdin(h.pid, b"two\n")
    r = h.wait()
    assert r.stdout == "got:one,two\n"


def test_close_stdin_ends_cat(sbx: Sandbox):
    h = sbx.commands.run("cat; echo END", background=True, stdin=True)
    h.send_stdin("abc")
    h.send_stdin("def\n")
    time.sleep(0.2)
    assert h.pid in [p.pid for p in sbx.commands.list()], "cat must wait for EOF"
    h.close_stdin()
    r = h.wait()
    assert r.stdout == "abcdef\nEND\n"


def test_stdin_defaults_to_closed(sbx: Sandbox):
    # without stdin=True the command's stdin is /dev/null: `cat` ends at once
    t0 = time.monotonic()
    r = sbx.commands.run("cat; echo after", timeout=10)
    assert r.stdout == "after\n"
    assert time.monotonic() - t0 < 5


def test_send_stdin_unknown_pid(sbx: Sandbox):
    with pytest.raises(NotFoundException):
        sbx.commands.send_stdin(999_999, "x")


def test_list_reports_config(sbx: Sandbox, root_dir: str):
    h = sbx.commands.run("sleep 30", background=True, envs={"CB_LIST": "1"}, cwd=root_dir)
    try:
        infos = {p.pid: p for p in sbx.commands.list()}
        assert h.pid in infos
        info = infos[h.pid]
        assert info.cmd == "/bin/bash"
        assert info.args == ["-l", "-c", "sleep 30"]
        assert info.envs.get("CB_LIST") == "1"
        assert info.cwd == root_dir
    finally:
        h.kill()


def test_connect_reattaches_to_running_process(sbx: Sandbox):
    h = sbx.commands.run(
        "for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.3; done", background=True
    )
    time.sleep(0.4)
    h.disconnect()
    h2 = sbx.commands.connect(h.pid)
    assert h2.pid == h.pid
    r = h2.wait()
    assert r.exit_code == 0
    assert "tick6\n" in r.stdout
    # live data only: everything seen after re-attaching is a suffix of the full run
    full = "".join(f"tick{i}\n" for i in range(1, 7))
    assert full.endswith(r.stdout)


def test_connect_survives_client_going_away(sbx: Sandbox, unique: str):
    h = sbx.commands.run(f"sleep 1; echo {unique}", background=True)
    h.disconnect()
    assert h.pid in [p.pid for p in sbx.commands.list()]
    r = sbx.commands.connect(h.pid).wait()
    assert r.stdout == f"{unique}\n"


def test_connect_unknown_pid(sbx: Sandbox):
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999)


def test_callbacks_in_order(sbx: Sandbox):
    events = []
    r = sbx.commands.run(
        "echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c; sleep 0.2; echo d >&2",
        on_stdout=lambda s: events.append(("out", s)),
        on_stderr=lambda s: events.append(("err", s)),
    )
    assert events == [("out", "a\n"), ("err", "b\n"), ("out", "c\n"), ("err", "d\n")]
    assert r.stdout == "a\nc\n"
    assert r.stderr == "b\nd\n"


def test_large_output(sbx: Sandbox):
    r = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' x; echo")
    assert len(r.stdout) == 3_000_001
    assert set(r.stdout[:-1]) == {"x"}


def test_utf8_output(sbx: Sandbox):
    r = sbx.commands.run("printf 'h\\xc3\\xa9llo w\\xc3\\xb6rld \\xe2\\x9c\\x93\\n'")
    assert r.stdout == "héllo wörld ✓\n"


def test_login_shell(sbx: Sandbox):
    # the SDK runs `/bin/bash -l -c CMD`: a login shell
    assert sbx.commands.run("shopt -q login_shell && echo login").stdout == "login\n"


def test_concurrent_commands(sbx: Sandbox):
    handles = [sbx.commands.run(f"sleep 0.5; echo {i}", background=True) for i in range(8)]
    assert len({h.pid for h in handles}) == 8
    outs = [h.wait().stdout for h in handles]
    assert outs == [f"{i}\n" for i in range(8)]


def _fds_of_listing(out: str) -> dict:
    return dict(line.split()[-3:][0::2] for line in out.splitlines() if " -> " in line)


def test_child_sees_only_stdio(sbx: Sandbox):
    """Commands (stdin closed or open) and PTYs must not inherit envd's descriptors:
    neither envd's own sockets nor fds envd itself inherited (the launcher hands envd
    an extra fd 7 on purpose). `ls` (a child) lists the fds of the shell envd started;
    `; true` keeps bash from exec'ing ls in its place."""
    listings = {
        "stdin closed": sbx.commands.run("ls -l /proc/$$/fd; true", user="root").stdout,
        "stdin open": sbx.commands.run("ls -l /proc/$$/fd; true", stdin=True, background=True).wait().stdout,
    }
    pty = sbx.pty.create(PtySize(rows=24, cols=250))
    sbx.pty.send_stdin(pty.pid, b"ls -l /proc/$$/fd; exit\n")
    out = bytearray()
    pty.wait(on_pty=out.extend)
    listings["pty"] = out.decode(errors="replace").replace("\r", "")
    for kind, listing in listings.items():
        fds = _fds_of_listing(listing)
        assert {"0", "1", "2"} <= set(fds), (kind, listing)
        extra = {
            n: t for n, t in fds.items()
            if n.isdigit() and int(n) > 2 and not t.startswith("/proc/") and not t.startswith("/dev/pts/")
        }
        assert not extra, f"{kind}: command inherited fds from envd: {extra}"


def test_killed_by_signal_end_event(sbx: Sandbox):
    """Killed by a signal: exit code -1 and error "signal: killed" (Go's process state,
    what upstream envd reports)."""
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("kill -9 $$")
    assert ei.value.exit_code == -1
    assert ei.value.error == "signal: killed"
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("exit 255")
    assert ei.value.exit_code == 255
    assert ei.value.error == "exit status 255"
