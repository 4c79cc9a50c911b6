"""watch_dir through the official Python SDK: sync (CreateWatcher / GetWatcherEvents /
RemoveWatcher) and async (WatchDir stream); recursive and include_entry."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from e2b import (
    AsyncSandbox,
    FileNotFoundException,
    FilesystemEventType as ET,
    FileType,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
)


def collect_until(handle, want, timeout=8.0):
    """Poll a sync WatchHandle until every (name, type) in `want` was seen."""
    events = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events.extend(handle.get_new_events())
        seen = {(e.name, e.type) for e in events}
        if want <= seen:
            return events
        time.sleep(0.1)
    return events


def test_watch_sync_basic_events(sbx: Sandbox, home_dir: str):
    h = sbx.files.watch_dir(home_dir)
    try:
        sbx.files.write(f"{home_dir}/a.txt", "1")
        sbx.commands.run(f"echo more >> {home_dir}/a.txt")
        sbx.files.rename(f"{home_dir}/a.txt", f"{home_dir}/b.txt")
        sbx.commands.run(f"chmod 600 {home_dir}/b.txt")
        sbx.files.remove(f"{home_dir}/b.txt")
        want = {
            ("a.txt", ET.CREATE),
            ("a.txt", ET.WRITE),
            ("a.txt", ET.RENAME),
            ("b.txt", ET.CREATE),
            ("b.txt", ET.CHMOD),
            ("b.txt", ET.REMOVE),
        }
        events = collect_until(h, want)
        seen = {(e.name, e.type) for e in events}
        assert want <= seen, f"missing {want - seen}; got {sorted((n, t.value) for n, t in seen)}"
        assert all(e.entry is None for e in events), "no entry without include_entry"
        # events are consumed by polling: nothing new without new activity
        assert h.get_new_events() == []
    finally:
        h.stop()


def test_watch_sync_non_recursive_ignores_subdirs(sbx: Sandbox, home_dir: str):
    sbx.files.make_dir(f"{home_dir}/sub")
    h = sbx.files.watch_dir(home_dir)
    try:
        sbx.files.write(f"{home_dir}/sub/inner.txt", "x")
        sbx.files.write(f"{home_dir}/top.txt", "x")
        events = collect_until(h, {("top.txt", ET.CREATE)})
        names = {e.name for e in events}
        assert "top.txt" in names
        time.sleep(0.3)
        names |= {e.name for e in h.get_new_events()}
        assert not any("inner" in n for n in names), names
    finally:
        h.stop()


def test_watch_sync_recursive(sbx: Sandbox, home_dir: str):
    sbx.files.make_dir(f"{home_dir}/pre/existing")
    h = sbx.files.watch_dir(home_dir, recursive=True)
    try:
        sbx.files.write(f"{home_dir}/pre/existing/deep.txt", "x")
        sbx.files.make_dir(f"{home_dir}/newdir")
        time.sleep(0.5)  # a new directory is watched once its CREATE is processed
        sbx.files.write(f"{home_dir}/newdir/later.txt", "y")
        want = {
            ("pre/existing/deep.txt", ET.CREATE),
            ("newdir", ET.CREATE),
            ("newdir/later.txt", ET.CREATE),
        }
        events = collect_until(h, want)
        seen = {(e.name, e.type) for e in events}
        assert want <= seen, f"missing {want - seen}; got {seen}"
    finally:
        h.stop()


def test_watch_sync_include_entry(sbx: Sandbox, home_dir: str):
    h = sbx.files.watch_dir(home_dir, include_entry=True)
    try:
        sbx.files.write(f"{home_dir}/e.txt", "12345")
        events = collect_until(h, {("e.txt", ET.CREATE), ("e.txt", ET.WRITE)})
        creates = [e for e in events if e.type == ET.CREATE and e.name == "e.txt"]
        assert creates and creates[0].entry is not None
        entry = creates[0].entry
        assert entry.name == "e.txt"
        assert entry.path == f"{home_dir}/e.txt"
        assert entry.type == FileType.FILE
        writes = [e for e in events if e.type == ET.WRITE and e.name == "e.txt"]
        assert writes and writes[-1].entry is not None
        # (the CREATE entry may still show root: envd creates, then chowns)
        assert writes[-1].entry.owner == "user"
        assert writes[-1].entry.size == 5
    finally:
        h.stop()


def test_watch_sync_stop_then_poll_fails(sbx: Sandbox, home_dir: str):
    h = sbx.files.watch_dir(home_dir)
    h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()


def test_watch_errors(sbx: Sandbox, home_dir: str):
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir(f"{home_dir}/missing")
    sbx.files.write(f"{home_dir}/plain", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.watch_dir(f"{home_dir}/plain")


async def test_watch_async_stream(asbx: AsyncSandbox):
    d = f"/home/user/aw-{uuid.uuid4().hex[:10]}"
    await asbx.files.make_dir(d)
    events = []
    exits = []
    h = await asbx.files.watch_dir(d, on_event=events.append, on_exit=exits.append)
    try:
        await asbx.files.write(f"{d}/x.txt", "1")
        await asbx.files.remove(f"{d}/x.txt")
        want = {("x.txt", ET.CREATE), ("x.txt", ET.REMOVE)}
        for _ in range(160):
            if want <= {(e.name, e.type) for e in events}:
                break
            await asyncio.sleep(0.05)
        assert want <= {(e.name, e.type) for e in events}, events
        assert all(e.entry is None for e in events)
        assert exits == [], f"watch ended early: {exits}"
    finally:
        await h.stop()
        await asbx.files.remove(d, user="root")


async def test_watch_async_recursive_include_entry(asbx: AsyncSandbox):
    d = f"/home/user/awr-{uuid.uuid4().hex[:10]}"
    await asbx.files.make_dir(f"{d}/sub")
    events = []
    h = await asbx.files.watch_dir(d, on_event=events.append, recursive=True, include_entry=True)
    try:
        await asbx.files.write(f"{d}/sub/deep.txt", "abc")
        for _ in range(160):
            if any(e.name == "sub/deep.txt" and e.type == ET.CREATE for e in events):
                break
            await asyncio.sleep(0.05)
        created = [e for e in events if e.name == "sub/deep.txt" and e.type == ET.CREATE]
        assert created, events
        assert created[0].entry is not None
        assert created[0].entry.path == f"{d}/sub/deep.txt"
        assert created[0].entry.type == FileType.FILE
    finally:
        await h.stop()
        await asbx.files.remove(d, user="root")


async def test_watch_async_missing_dir(asbx: AsyncSandbox):
    with pytest.raises(FileNotFoundException):
        await asbx.files.watch_dir(f"/home/user/missing-{uuid.uuid4().hex}", on_event=lambda e: None)


async def test_watch_async_timeout_ends_stream(asbx: AsyncSandbox):
    d = f"/home/user/awt-{uuid.uuid4().hex[:10]}"
    await asbx.files.make_dir(d)
    exits = []
    h = await asbx.files.watch_dir(d, on_event=lambda e: None, on_exit=exits.append, timeout=1)
    try:
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.05)
        assert exits, "watch with timeout=1 did not end"
        assert exits[0] is not None, "a deadline ends the watch with an error"
    finally:
        await h.stop()
        await asbx.files.remove(d, user="root")
