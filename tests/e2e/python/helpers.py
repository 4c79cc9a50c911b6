"""Helpers shared by the envd end-to-end tests: polling, /proc inspection of envd
(RSS, open fds, inotify instances, child processes), health waits and raw
Connect-protocol framing for the bad-input tests (which must not go through the
SDK because they send what the SDK never would)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple, TypeVar

import httpx

T = TypeVar("T")


def poll(fn: Callable[[], T], timeout: float = 5.0, interval: float = 0.05) -> T:
    """Call fn until it returns a truthy value or `timeout` seconds pass; return the last value."""
    deadline = time.monotonic() + timeout
    value = fn()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = fn()
    return value


def wait_healthy(url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"envd exited with {proc.returncode} before becoming healthy")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 204:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise RuntimeError(f"envd at {url} not healthy after {timeout}s (last: {last!r})")


# --- /proc ------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def fd_targets(pid: int) -> List[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def fd_count(pid: int) -> int:
    return len(fd_targets(pid))


def fd_kinds(pid: int) -> Dict[str, int]:
    """envd's open fds by kind: socket, pipe, anon_inode:<x>, /dev/pts, /dev/ptmx, file."""
    kinds: Dict[str, int] = {}
    for t in fd_targets(pid):
        if t.startswith("socket:"):
            k = "socket"
        elif t.startswith("pipe:"):
            k = "pipe"
        elif t.startswith("anon_inode:"):
            k = t
        elif t.startswith("/dev/pts/"):
            k = "/dev/pts"
        elif t.startswith("/dev/"):
            k = t
        else:
            k = "file"
        kinds[k] = kinds.get(k, 0) + 1
    return kinds


def non_socket_fds(pid: int) -> int:
    """Open fds that are not sockets (sockets include idle keep-alive connections
    that SDK clients in this process still hold, so they are not envd's to close)."""
    return sum(n for k, n in fd_kinds(pid).items() if k != "socket")


def inotify_watch_count(pid: int) -> Tuple[int, int]:
    """(number of inotify instances, total inotify watches) held by `pid`."""
    instances = 0
    watches = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                continue
            instances += 1
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                watches += sum(1 for line in f if line.startswith("inotify wd:"))
        except OSError:
            pass
    return instances, watches


def children(pid: int) -> List[int]:
    """Direct children of `pid` (from /proc/*/stat)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def descendants(pid: int) -> List[int]:
    out = []
    todo = [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pids_with_cmdline(fragment: str) -> List[int]:
    """Live (non-zombie) processes whose command line contains `fragment`."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        if fragment in cmdline(int(name)) and pid_alive(int(name)):
            out.append(int(name))
    return out


# --- raw Connect protocol ---------------------------------------------------


def envelope(msg: dict, flags: int = 0) -> bytes:
    payload = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def parse_envelopes(data: bytes) -> List[Tuple[int, dict]]:
    """Split a Connect stream body into (flags, json) messages."""
    out = []
    i = 0
    while i + 5 <= len(data):
        flags, n = struct.unpack(">BI", data[i : i + 5])
        payload = data[i + 5 : i + 5 + n]
        if len(payload) < n:
            raise ValueError(f"truncated envelope: want {n} bytes, have {len(payload)}")
        out.append((flags, json.loads(payload) if payload else {}))
        i += 5 + n
    if i != len(data):
        raise ValueError(f"{len(data) - i} trailing bytes after the last envelope")
    return out


STREAM_HEADERS = {
    "Content-Type": "application/connect+json",
    "Connect-Protocol-Version": "1",
}
UNARY_HEADERS = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}


def unary(url: str, method: str, body, headers: Optional[dict] = None, raw: bool = False) -> httpx.Response:
    """POST a unary Connect call; `body` is JSON-encoded unless raw=True (bytes/str sent as is)."""
    h = dict(UNARY_HEADERS)
    h.update(headers or {})
    content = body if raw else json.dumps(body)
    return httpx.post(f"{url}/{method}", content=content, headers=h, timeout=15)


def stream(url: str, method: str, msg, headers: Optional[dict] = None, raw: bool = False, timeout: float = 15) -> Tuple[httpx.Response, List[Tuple[int, dict]]]:
    """POST a server-streaming Connect call with one request envelope; read the whole response."""
    h = dict(STREAM_HEADERS)
    h.update(headers or {})
    content = msg if raw else envelope(msg)
    r = httpx.post(f"{url}/{method}", content=content, headers=h, timeout=timeout)
    envs = parse_envelopes(r.content) if r.status_code == 200 else []
    return r, envs


def end_error(envs: Iterable[Tuple[int, dict]]) -> Optional[dict]:
    """The `error` of the end-of-stream envelope (None on success); asserts one exists."""
    ends = [m for f, m in envs if f & 0x02]
    assert len(ends) == 1, f"expected exactly one end-of-stream envelope, got {envs!r}"
    return ends[0].get("error")
