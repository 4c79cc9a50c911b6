"""Last: every sandbox the suite created is gone (404 on get, not listed for either
team) and the server is healthy. The launcher (run.sh) then stops the server and checks
the host (processes, cgroups, mounts, veths, sandbox directories)."""

from __future__ import annotations

from conftest import API_KEY, IDS_FILE, KEY_B, api
from e2b import Sandbox


def test_nothing_left_listed():
    for key in filter(None, (API_KEY, KEY_B)):
        pager = Sandbox.list(api_key=key)
        left = []
        while pager.has_next:
            left.extend(pager.next_items())
        assert left == [], f"sandboxes still listed: {[ (s.sandbox_id, s.metadata) for s in left][:10]}"


def test_every_created_id_is_gone():
    if not IDS_FILE:
        return
    with open(IDS_FILE) as f:
        ids = sorted({line.strip() for line in f if line.strip()})
    alive = []
    for sid in ids:
        for key in filter(None, (API_KEY, KEY_B)):
            r = api("GET", f"/sandboxes/{sid}", key=key)
            if r.status_code != 404:
                alive.append((sid, r.status_code))
    assert not alive, alive[:10]
