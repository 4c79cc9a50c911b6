"""Runs last (file order): after the whole suite envd must have no leftover
processes, watchers or file descriptors, and still answer."""

from __future__ import annotations

import gc

import httpx
from e2b import Sandbox

from conftest import BASELINE, ENVD_URL
from helpers import cmdline, descendants, fd_kinds, inotify_watch_count, non_socket_fds, poll, rss_kib


def test_no_leaked_processes(sbx: Sandbox, envd_pid: int):
    assert poll(lambda: sbx.commands.list() == [], timeout=10), (
        f"processes still listed after the suite: {sbx.commands.list()}"
    )
    left = poll(lambda: not descendants(envd_pid), timeout=10)
    assert left, f"envd still has child processes: {[(p, cmdline(p)) for p in descendants(envd_pid)]}"


def test_no_leaked_watchers_or_fds(envd_pid: int):
    gc.collect()  # drop SDK clients (and their keep-alive sockets) of finished tests
    base_fds = BASELINE.get("fds")
    base_inotify = BASELINE.get("inotify", (0, 0))
    assert poll(lambda: inotify_watch_count(envd_pid)[1] <= base_inotify[1], timeout=10), (
        f"inotify {base_inotify} → {inotify_watch_count(envd_pid)}"
    )
    if base_fds is not None:
        assert poll(lambda: non_socket_fds(envd_pid) <= base_fds + 2, timeout=10), (
            f"envd non-socket fds {BASELINE.get('fd_kinds')} at start → {fd_kinds(envd_pid)} after the suite"
        )
    print(f"envd after the suite: fds {fd_kinds(envd_pid)} (start {BASELINE.get('fd_kinds')}), "
          f"RSS {rss_kib(envd_pid) / 1024:.1f} MiB (start {BASELINE.get('rss_kib', 0) / 1024:.1f} MiB)")


def test_still_healthy():
    assert httpx.get(f"{ENVD_URL}/health").status_code == 204
