"""Load: 200 sandboxes created and killed by 20 concurrent SDK clients (threads, sync
SDK, template `tiny` to keep it quick): every create and kill succeeds, the list shows
all 200 while they live (paginated, 100 per page) and none afterwards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import API_KEY, FAST_TEMPLATE, Tracker, record_id, unique
from e2b import Sandbox, SandboxQuery
from e2b.exceptions import SandboxNotFoundException

CLIENTS = 20
PER_CLIENT = 10


@pytest.mark.timeout(1200)
def test_200_sandboxes_20_clients(sandboxes: Tracker):
    tag = unique()
    created: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(CLIENTS)

    def client(n: int) -> list[str]:
        mine = []
        barrier.wait()
        for i in range(PER_CLIENT):
            try:
                s = Sandbox.create(FAST_TEMPLATE, metadata={"tag": tag, "client": str(n)}, timeout=900,
                                   request_timeout=180)
                record_id(s.sandbox_id)
                with lock:
                    created.append(s.sandbox_id)
                    sandboxes.created.append((s.sandbox_id, API_KEY))
                mine.append(s.sandbox_id)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                with lock:
                    errors.append(f"create client {n} #{i}: {e!r}")
        return mine

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        per_client = list(pool.map(client, range(CLIENTS)))
    t_create = time.monotonic() - t0
    assert not errors, f"{len(errors)} creates failed: {errors[:5]}"
    assert len(created) == CLIENTS * PER_CLIENT
    assert len(set(created)) == len(created), "duplicate sandbox ids"

    # all 200 listed (two pages of 100)
    pager = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=100)
    listed = []
    pages = 0
    while pager.has_next:
        listed.extend(s.sandbox_id for s in pager.next_items())
        pages += 1
    assert pages >= 2
    assert sorted(listed) == sorted(created), f"listed {len(listed)} of {len(created)}"

    kill_errors: list[str] = []

    def killer(ids: list[str]):
        for sid in ids:
            try:
                ok = Sandbox.kill(sid, request_timeout=180)
                if ok is not True:
                    kill_errors.append(f"{sid}: kill returned {ok}")
            except Exception as e:  # noqa: BLE001
                kill_errors.append(f"{sid}: {e!r}")

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(killer, per_client))
    t_kill = time.monotonic() - t0
    print(f"\n200 creates by 20 clients: {t_create:.1f}s; 200 kills: {t_kill:.1f}s")
    assert not kill_errors, kill_errors[:5]

    pager = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}))
    left = []
    while pager.has_next:
        left.extend(pager.next_items())
    assert left == [], f"{len(left)} sandboxes still listed after kill"
    for sid in created[:: len(created) // 10]:
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sid)


@pytest.mark.timeout(300)
def test_mass_expiry(sandboxes: Tracker):
    """40 sandboxes with a 2 s timeout, created concurrently, all end by themselves: gone
    from the list and 404 within 30 s of their end."""
    tag = unique()

    def make(_):
        s = Sandbox.create(FAST_TEMPLATE, metadata={"tag": tag}, timeout=2)
        record_id(s.sandbox_id)
        return s.sandbox_id

    with ThreadPoolExecutor(10) as pool:
        ids = list(pool.map(make, range(40)))
    sandboxes.created.extend((i, API_KEY) for i in ids)

    def listed():
        pager = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}))
        out = []
        while pager.has_next:
            out.extend(pager.next_items())
        return out

    deadline = time.monotonic() + 40
    left = listed()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = listed()
    assert left == [], f"{len(left)} of 40 still listed 40 s after a 2 s timeout"
    for sid in ids[::8]:
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sid)
