"""Stateful sandboxes across server restarts and crashes, through the official Python SDK.

run.sh calls this in steps around stopping and starting `cubicle serve`:

    durability.py setup STATE_FILE IDS_FILE   a paused sandbox (a process counting in its
                                              memory, logging each count to a file it
                                              holds open in a volume the sandbox mounts)
                                              and a snapshot of another one
    durability.py check STATE_FILE            both still there, as they were
    durability.py finish STATE_FILE           resume the paused one (the count goes on,
                                              its open file in the volume still written),
                                              a sandbox from the snapshot, then remove all

STATE_FILE carries the ids (and what the counter said) from one step to the next."""

from __future__ import annotations

import json
import sys
import time

from e2b import Sandbox, SandboxState, Volume

COUNTER = r"""
import http.server, itertools, os
count = itertools.count(1)
log = open("/mnt/vol/log.txt", "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n = next(count)
        log.write(f"{n}\n")
        body = f"{n} {os.getpid()}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8780), H).serve_forever()
"""


def counter(sbx: Sandbox) -> tuple[int, int]:
    for _ in range(100):
        out = sbx.commands.run("curl -sf localhost:8780 || true").stdout.split()
        if out:
            return int(out[0]), int(out[1])
        time.sleep(0.2)
    raise AssertionError("the counter process does not answer")


def setup(state_file: str, ids_file: str) -> None:
    vol = Volume.create(f"durability-{int(time.time() * 1000)}")
    paused = Sandbox.create(
        "base",
        metadata={"e2e": "durability"},
        timeout=600,
        volume_mounts={"/mnt/vol": vol},
    )
    source = Sandbox.create("base", timeout=600)
    with open(ids_file, "a") as f:
        f.write(f"{paused.sandbox_id}\n{source.sandbox_id}\n")
    paused.files.write("/home/user/kept.txt", "paused with me")
    paused.files.write("/tmp/counter.py", COUNTER)
    paused.commands.run("python3 /tmp/counter.py", background=True, timeout=0)
    n, pid = counter(paused)
    assert paused.pause() is True
    source.files.write("/home/user/snap.txt", "in the snapshot")
    snap = source.create_snapshot()
    source.kill()
    json.dump(
        {
            "paused": paused.sandbox_id,
            "n": n,
            "pid": pid,
            "snapshot": snap.snapshot_id,
            "volume": vol.volume_id,
        },
        open(state_file, "w"),
    )
    print(f"durability: paused {paused.sandbox_id} (counter at {n}), snapshot {snap.snapshot_id}")


def check(state_file: str) -> None:
    s = json.load(open(state_file))
    info = Sandbox.get_info(s["paused"])
    assert info.state == SandboxState.PAUSED, info
    assert info.metadata == {"e2e": "durability"}, info.metadata
    ids = [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
    assert s["snapshot"] in ids, (s["snapshot"], ids)
    print("durability: the paused sandbox and the snapshot are there")


def finish(state_file: str) -> None:
    s = json.load(open(state_file))
    sbx = Sandbox.connect(s["paused"])
    assert Sandbox.get_info(s["paused"]).state == SandboxState.RUNNING
    assert counter(sbx) == (s["n"] + 1, s["pid"]), "the process came back with its memory"
    assert sbx.files.read("/home/user/kept.txt") == "paused with me"
    # The counter's log in the volume, written before the pause and, through the same
    # restored descriptor, after the resume.
    vol = Volume.connect(s["volume"])
    assert vol.read_file("/log.txt") == "".join(f"{i}\n" for i in range(1, s["n"] + 2))
    child = Sandbox.create(s["snapshot"], timeout=120)
    try:
        assert child.files.read("/home/user/snap.txt") == "in the snapshot"
    finally:
        child.kill()
    assert Sandbox.kill(s["paused"]) is True
    assert Sandbox.delete_snapshot(s["snapshot"]) is True
    assert Volume.destroy(s["volume"]) is True
    print("durability: resumed, counted on, sandbox from the snapshot works, all removed")


if __name__ == "__main__":
    step, args = sys.argv[1], sys.argv[2:]
    {"setup": setup, "check": check, "finish": finish}[step](*args)
