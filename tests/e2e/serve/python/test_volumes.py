"""Volumes through the official Python SDK (issue 17): the control routes, the content
API (found through E2B_VOLUME_API_URL, which `cubicle serve` prints: its own listener),
mounts at create (by name), owners as sandboxes see them, several sandboxes at once,
read-only mounts (Cubicle's `readOnly`), the size limit and what a tenant tries against
it, team isolation, that a mounted volume cannot be deleted, and volumes across pause
and resume (both modes), snapshots, sandboxes made from them, fork and rollback: the
volume is mounted again, idmapped as at create, a process's open file in it still
writable, and its content is the volume's as it is then (never copied into a checkpoint).

Every volume a test makes is deleted in `finally`; every sandbox is killed by the
tracker.
"""

from __future__ import annotations

import os
import time
from typing import Iterator, List

import pytest

from e2b import Sandbox, SandboxState, Volume
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

from conftest import API_KEY, KEY_B, STATE_DIRS, Tracker, api, poll, record_id, template_config, unique

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("E2B_VOLUME_API_URL"),
        reason="E2B_VOLUME_API_URL is not set (run through tests/e2e/serve/run.sh)",
    ),
]


class Volumes:
    """Makes volumes and deletes every one at teardown."""

    def __init__(self) -> None:
        self.made: List[tuple] = []

    def create(self, name: str | None = None, key: str = API_KEY) -> Volume:
        vol = Volume.create(name or f"e2e-{unique()}", api_key=key)
        self.made.append((vol.volume_id, key))
        return vol

    def create_sized(self, size_mb: int) -> Volume:
        """Cubicle's own `sizeMB` (the SDK has no size option)."""
        r = api("POST", "/volumes", json={"name": f"e2e-{unique()}", "sizeMB": size_mb})
        assert r.status_code == 201, r.text
        self.made.append((r.json()["volumeID"], API_KEY))
        return Volume.connect(r.json()["volumeID"])

    def cleanup(self) -> None:
        for vid, key in self.made:
            Volume.destroy(vid, api_key=key)


@pytest.fixture
def volumes() -> Iterator[Volumes]:
    v = Volumes()
    try:
        yield v
    finally:
        v.cleanup()


def test_volume_control_routes(volumes: Volumes):
    name = f"e2e-{unique()}"
    vol = volumes.create(name)
    assert vol.name == name and vol.volume_id and vol.token
    assert any(v.volume_id == vol.volume_id and v.name == name for v in Volume.list())
    info = Volume.get_info(vol.volume_id)
    assert (info.volume_id, info.name, info.token) == (vol.volume_id, name, vol.token)
    assert info.domain is None
    again = Volume.connect(vol.volume_id)
    assert again.token == vol.token
    with pytest.raises(VolumeException) as e:
        Volume.create(name)
    assert "already exists" in str(e.value)
    with pytest.raises(VolumeException):
        Volume.create("not a valid name")
    # Another team sees nothing of it.
    if KEY_B:
        assert all(v.volume_id != vol.volume_id for v in Volume.list(api_key=KEY_B))
        with pytest.raises(VolumeNotFoundException):
            Volume.get_info(vol.volume_id, api_key=KEY_B)
        assert Volume.destroy(vol.volume_id, api_key=KEY_B) is False
    vid = vol.volume_id
    volumes.made.clear()
    assert Volume.destroy(vid) is True
    assert Volume.destroy(vid) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vid)


def test_volume_content_api(volumes: Volumes):
    vol = volumes.create()
    d = vol.make_dir("/d/e", uid=1000, gid=1000, mode=0o755, force=True)
    assert (d.type.value, d.path, d.mode, d.uid, d.gid) == ("directory", "/d/e", 0o755, 1000, 1000)
    assert d.mtime.tzinfo is not None
    f = vol.write_file("/d/e/hello.txt", "hello volume")
    assert (f.type.value, f.size, f.uid) == ("file", 12, 1000)
    assert vol.read_file("/d/e/hello.txt") == "hello volume"
    assert vol.read_file("/d/e/hello.txt", format="bytes") == b"hello volume"
    assert b"".join(vol.read_file("/d/e/hello.txt", format="stream")) == b"hello volume"
    big = os.urandom(3 << 20)
    vol.write_file("/big.bin", big)
    assert vol.read_file("/big.bin", format="bytes") == big
    vol.write_file("/d/e/hello.txt", b"v2")
    assert vol.read_file("/d/e/hello.txt") == "v2"
    assert [e.path for e in vol.list("/")] == ["/big.bin", "/d"]
    deep = {e.path for e in vol.list("/", depth=3)}
    assert {"/d", "/d/e", "/d/e/hello.txt", "/big.bin"} <= deep
    assert vol.exists("/d/e/hello.txt") and not vol.exists("/nope")
    info = vol.get_info("/d/e/hello.txt")
    assert info.name == "hello.txt"
    upd = vol.update_metadata("/d/e/hello.txt", mode=0o600, uid=0, gid=0)
    assert (upd.mode, upd.uid, upd.gid) == (0o600, 0, 0)
    with pytest.raises(VolumePathNotFoundException):
        vol.read_file("/missing")
    with pytest.raises(VolumePathNotFoundException):
        vol.make_dir("/x/y")
    with pytest.raises(NotFoundException):
        vol.list("/missing")
    vol.remove("/d")
    assert not vol.exists("/d/e/hello.txt")
    with pytest.raises(VolumePathNotFoundException):
        vol.remove("/d")
    # Another volume's token opens nothing of this one.
    other = volumes.create()
    stranger = Volume(vol.volume_id, vol.name, token=other.token)
    with pytest.raises(AuthenticationException):
        stranger.list("/")


def test_mounted_in_several_sandboxes_with_owners(volumes: Volumes, sandboxes: Tracker):
    vol = volumes.create()
    vol.write_file("/from-api.txt", "written through the content API")
    a = sandboxes.create(volume_mounts={"/mnt/data": vol}, timeout=300)
    b = sandboxes.create(volume_mounts={"/home/user/shared": vol.name}, timeout=300)
    mounts = Sandbox.get_info(a.sandbox_id).volume_mounts
    assert [(m["name"], m["path"]) for m in mounts] == [(vol.name, "/mnt/data")]
    assert a.files.read("/mnt/data/from-api.txt") == "written through the content API"
    # `user` (the default) and root write; the owners are theirs, inside and on disk.
    a.commands.run("echo by-user > /mnt/data/user.txt")
    a.commands.run("echo by-root > /mnt/data/root.txt", user="root")
    owners = a.commands.run("stat -c '%U %u' /mnt/data/user.txt /mnt/data/root.txt").stdout.split("\n")
    assert owners[:2] == ["user 1000", "root 0"], owners
    assert (vol.get_info("/user.txt").uid, vol.get_info("/root.txt").uid) == (1000, 0)
    # The other sandbox (another host uid range) sees the same files with the same owners.
    out = b.commands.run("cat /home/user/shared/user.txt; stat -c '%u' /home/user/shared/user.txt").stdout
    assert out.split() == ["by-user", "1000"]
    b.commands.run("echo from-b > /home/user/shared/b.txt")
    assert a.files.read("/mnt/data/b.txt") == "from-b\n"
    assert vol.read_file("/b.txt") == "from-b\n"
    # In use: cannot be deleted (409), and stays intact.
    with pytest.raises(VolumeException) as e:
        Volume.destroy(vol.volume_id)
    assert "in use" in str(e.value)
    assert vol.read_file("/b.txt") == "from-b\n"
    a.kill()
    b.kill()
    vid = vol.volume_id
    volumes.made.clear()
    assert Volume.destroy(vid) is True


def test_create_with_unknown_or_foreign_volume_fails(volumes: Volumes, sandboxes: Tracker):
    with pytest.raises(Exception) as e:
        sandboxes.create(volume_mounts={"/mnt/x": f"nope-{unique()}"})
    assert "not found" in str(e.value)
    if KEY_B:
        vol = volumes.create()
        with pytest.raises(Exception) as e:
            sandboxes.create(key=KEY_B, volume_mounts={"/mnt/x": vol.name})
        assert "not found" in str(e.value)
    with pytest.raises(Exception):
        sandboxes.create(volume_mounts={"/proc/x": volumes.create().name})


def test_read_only_mount(volumes: Volumes, sandboxes: Tracker):
    """`readOnly` is Cubicle's own (the SDKs have no option for it): a raw create."""
    vol = volumes.create()
    vol.write_file("/kept.txt", "kept")
    r = api(
        "POST",
        "/v2/sandboxes",
        json={
            "templateID": "base",
            "timeout": 300,
            "volumeMounts": [{"name": vol.name, "path": "/mnt/ro", "readOnly": True}],
        },
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    sandboxes.track(sid)
    sbx = Sandbox.connect(sid)
    assert sbx.files.read("/mnt/ro/kept.txt") == "kept"
    res = sbx.commands.run(
        "echo x > /mnt/ro/new 2>&1; echo rc=$?; sudo sh -c 'echo x > /mnt/ro/new' 2>&1; "
        "sudo mount -o remount,rw /mnt/ro 2>&1; echo mount=$?",
    )
    assert "Read-only file system" in res.stdout, res.stdout
    assert "mount=0" not in res.stdout, res.stdout
    assert not vol.exists("/new")


def test_size_limit_holds_against_the_tenant(volumes: Volumes, sandboxes: Tracker):
    """A 32 MiB volume: writing 64 MiB stops at the limit, for root too; a nested btrfs
    subvolume (its own qgroup, outside the limit) cannot be made from inside; a reflinked
    copy inside the volume is counted once (the disk holds its extents once); the
    sandbox's own disk is not charged."""
    vol = volumes.create_sized(32)
    sbx = sandboxes.create(volume_mounts={"/mnt/q": vol}, timeout=300)
    # First, on the empty volume: a subvolume (which btrfs would give a quota group of
    # its own, outside the volume's limit) or a snapshot cannot be made from inside.
    probe = r"""
import fcntl, os, struct
fd = os.open("/mnt/q", os.O_RDONLY)
# struct btrfs_ioctl_vol_args {s64 fd; char name[4088]}: a new subvolume "nested", and
# a snapshot "snap" of the volume itself (its root is a subvolume).
for name, req, src in [("subvol", 0x5000940e, 0), ("snapshot", 0x50009401, fd)]:
    args = bytearray(4096)
    args[0:8] = struct.pack("q", src)
    args[8:8 + len(name)] = name.encode()
    try:
        fcntl.ioctl(fd, req, args)
        print(name, "created")
    except OSError as e:
        print(name, "refused", e.errno)
"""
    sbx.files.write("/tmp/probe.py", probe)
    out = sbx.commands.run("sudo python3 /tmp/probe.py").stdout
    assert "subvol refused" in out and "snapshot refused" in out, out
    assert "122" not in out, f"refused for lack of space, not by policy: {out}"
    res = sbx.commands.run(
        "sudo dd if=/dev/zero of=/mnt/q/big bs=1M count=64 conv=fsync 2>&1; echo rc=$?",
        timeout=120,
    )
    assert "rc=0" not in res.stdout and "quota" in res.stdout.lower(), res.stdout
    used = api("GET", f"/volumes/{vol.volume_id}").json()["usedBytes"]
    assert used <= 34 << 20, used
    sbx.commands.run("sudo rm -f /mnt/q/big")
    # A tenant's sync(2) is answered without running (it would commit the host's shared
    # filesystem): the host commits, so that the volume's usage is accounted.
    sbx.commands.run("dd if=/dev/urandom of=/mnt/q/a bs=1M count=20 2>/dev/null")
    os.sync()
    res = sbx.commands.run("cp --reflink=always /mnt/q/a /mnt/q/b 2>&1; echo rc=$?")
    assert "rc=0" in res.stdout, res.stdout
    os.sync()
    # A reflinked copy inside the volume shares its extents: counted once, as the disk
    # holds them once (20 MiB, not 40).
    used = api("GET", f"/volumes/{vol.volume_id}").json()["usedBytes"]
    assert 20 << 20 <= used <= 22 << 20, used
    # 20 MiB used: 16 more is past the 32 MiB limit.
    res = sbx.commands.run("dd if=/dev/zero of=/mnt/q/c bs=1M count=16 conv=fsync 2>&1; echo rc=$?")
    assert "rc=0" not in res.stdout, res.stdout


def test_volume_files_survive_the_sandbox(volumes: Volumes, sandboxes: Tracker):
    vol = volumes.create()
    sbx = sandboxes.create(volume_mounts={"/mnt/keep": vol}, timeout=300)
    sbx.commands.run("mkdir -p /mnt/keep/dir && echo persisted > /mnt/keep/dir/f")
    sbx.kill()
    assert vol.read_file("/dir/f") == "persisted\n"
    again = sandboxes.create(volume_mounts={"/data": vol}, timeout=300)
    assert again.files.read("/data/dir/f") == "persisted\n"


def test_volume_on_a_layered_template(volumes: Volumes, sandboxes: Tracker):
    """A template built from base (a stack of layers, each an idmapped lower) with a volume
    mounted over a directory one of its layers made: the volume's bind goes on top of the
    overlay, the layers stay readable, owners are the same as on `base`."""
    from e2b import Template

    name = f"e2e-layered-vol-{unique()}"
    Template.build(
        Template()
        .from_base_image()
        .run_cmd(
            f"mkdir -p /opt/app/data && echo hidden > /opt/app/data/under.txt && echo {name} > /opt/app/mark",
            user="root",
        ),
        name,
    )
    try:
        if STATE_DIRS:
            _, cfg = template_config(name)
            assert cfg is not None, f"template.json of {name} in none of {STATE_DIRS}"
            assert len(cfg["layers"]) >= 2, cfg["layers"]
        vol = volumes.create()
        vol.write_file("/from-api.txt", "through the content API")
        sbx = sandboxes.create(template=name, volume_mounts={"/opt/app/data": vol}, timeout=120)
        assert sbx.files.read("/opt/app/mark") == f"{name}\n"
        # The volume hides what the layer had at its mount point.
        ls = sbx.commands.run("ls /opt/app/data").stdout.split()
        assert ls == ["from-api.txt"], ls
        sbx.commands.run("echo by-user > /opt/app/data/user.txt")
        assert sbx.commands.run("stat -c '%U %u' /opt/app/data/user.txt").stdout.strip() == "user 1000"
        assert vol.read_file("/user.txt") == "by-user\n"
        assert vol.get_info("/user.txt").uid == 1000
        # The layers under the overlay are untouched by the sandbox's writes.
        sbx.commands.run("echo changed > /opt/app/mark", user="root")
        sbx.kill()
        again = sandboxes.create(template=name, timeout=60)
        assert again.files.read("/opt/app/mark") == f"{name}\n"
        assert again.commands.run("cat /opt/app/data/under.txt").stdout == "hidden\n"
        again.kill()
    finally:
        api("DELETE", f"/templates/{name}")


# A process holding a file of the volume open (append mode, as a log): each HTTP request
# appends "line <n>" through that one descriptor and answers "<n> <pid>". Only a process
# restored with its memory and its open file can go on with the next line.
WRITER = r"""
import http.server, itertools, os, sys
log = open(sys.argv[2], "a", buffering=1)
count = itertools.count(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n = next(count)
        log.write(f"line {n}\n")
        body = f"{n} {os.getpid()}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def start_writer(sbx: Sandbox, port: int, path: str) -> None:
    sbx.files.write("/tmp/writer.py", WRITER)
    sbx.commands.run(f"python3 /tmp/writer.py {port} {path}", background=True, timeout=0)
    poll(lambda: sbx.commands.run(f"curl -sf localhost:{port} || true").stdout.strip(), timeout=20)


def read_writer(sbx: Sandbox, port: int) -> tuple[int, int]:
    out = sbx.commands.run(f"curl -sf localhost:{port}").stdout.split()
    return int(out[0]), int(out[1])


def lines(n: int) -> str:
    return "".join(f"line {i}\n" for i in range(1, n + 1))


def test_pause_and_resume_with_a_volume(volumes: Volumes, sandboxes: Tracker):
    vol = volumes.create()
    sbx = sandboxes.create(volume_mounts={"/mnt/data": vol}, timeout=300)
    sbx.files.write("/home/user/rootfs.txt", "on the rootfs")
    sbx.files.write("/mnt/data/vol.txt", "on the volume")
    start_writer(sbx, 8790, "/mnt/data/log.txt")
    n1, pid = read_writer(sbx, 8790)
    assert vol.read_file("/log.txt") == lines(n1)

    assert sbx.pause() is True
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    # A paused sandbox still uses its volume.
    with pytest.raises(VolumeException) as e:
        Volume.destroy(vol.volume_id)
    assert "in use" in str(e.value)
    # The volume is not in the checkpoint: what happens to it meanwhile, the resumed
    # sandbox sees.
    vol.write_file("/while-paused.txt", "written while paused")

    sbx.connect(timeout=300)
    n2, pid2 = read_writer(sbx, 8790)
    assert (pid2, n2) == (pid, n1 + 1), "the writer came back with its memory"
    # ...and its descriptor of the volume's file still writes there.
    assert vol.read_file("/log.txt") == lines(n2)
    assert sbx.files.read("/home/user/rootfs.txt") == "on the rootfs"
    assert sbx.files.read("/mnt/data/vol.txt") == "on the volume"
    assert sbx.files.read("/mnt/data/while-paused.txt") == "written while paused"
    # Mounted again as at create: idmapped (the sandbox's `user` writes as uid 1000,
    # stored as 1000 in the volume) and writable.
    sbx.commands.run("echo after > /mnt/data/after.txt")
    owners = sbx.commands.run("stat -c '%u' /mnt/data/after.txt /mnt/data/log.txt").stdout.split()
    assert owners == ["1000", "1000"], owners
    assert vol.get_info("/after.txt").uid == 1000
    assert vol.read_file("/after.txt") == "after\n"

    # A filesystem pause: the processes go, the volume is mounted at the boot.
    assert sbx.pause(mode="filesystem") is True
    vol.write_file("/fs-paused.txt", "written during a filesystem pause")
    sbx.connect(timeout=300)
    assert sbx.files.read("/mnt/data/fs-paused.txt") == "written during a filesystem pause"
    assert sbx.files.read("/home/user/rootfs.txt") == "on the rootfs"
    assert sbx.commands.run("curl -sf localhost:8790 || echo gone").stdout.strip() == "gone"
    sbx.commands.run("echo by-the-boot >> /mnt/data/log.txt")
    assert vol.read_file("/log.txt") == lines(n2) + "by-the-boot\n"
    assert vol.get_info("/log.txt").uid == 1000


def test_snapshot_fork_and_rollback_with_a_volume(volumes: Volumes, sandboxes: Tracker):
    """A snapshot remembers its source's volume mounts: a sandbox made from it (and a
    fork) mounts the same volumes, whose content is theirs as it is then (shared with
    the source, never copied); a rollback restores the disk and processes, not the
    volume."""
    vol = volumes.create()
    sbx = sandboxes.create(volume_mounts={"/mnt/data": vol}, timeout=300)
    sbx.files.write("/home/user/rootfs.txt", "snapshotted")
    start_writer(sbx, 8791, "/mnt/data/log.txt")
    n0, pid = read_writer(sbx, 8791)
    snap = sbx.create_snapshot()
    try:
        child = sandboxes.create(snap.snapshot_id, timeout=120)
        mounts = Sandbox.get_info(child.sandbox_id).volume_mounts
        assert [(m["name"], m["path"]) for m in mounts] == [(vol.name, "/mnt/data")]
        n1, pid1 = read_writer(child, 8791)
        assert (pid1, n1) == (pid, n0 + 1), "the child starts from the snapshot's memory"
        assert vol.read_file("/log.txt") == lines(n0 + 1)
        child.files.write("/mnt/data/from-child.txt", "child")
        assert sbx.files.read("/mnt/data/from-child.txt") == "child"
        assert child.commands.run("stat -c '%u' /mnt/data/from-child.txt").stdout.strip() == "1000"
        # A snapshot with memory holds processes using those volumes at those paths.
        with pytest.raises(Exception) as e:
            sandboxes.create(snap.snapshot_id, volume_mounts={"/mnt/elsewhere": vol}, timeout=60)
        assert "volumes it was taken with" in str(e.value), e.value

        forks = sbx.fork(count=1, timeout=120)
        assert len(forks) == 1 and isinstance(forks[0], Sandbox), forks
        fork = forks[0]
        sandboxes.track(fork.sandbox_id)
        assert fork.files.read("/mnt/data/from-child.txt") == "child"
        assert read_writer(fork, 8791)[1] == pid

        sbx.files.write("/home/user/rootfs.txt", "changed")
        r = api("POST", f"/sandboxes/{sbx.sandbox_id}/rollback", json={"snapshotID": snap.snapshot_id})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/rootfs.txt") == "snapshotted"
        assert read_writer(sbx, 8791) == (n0 + 1, pid)
        # The volume is not rolled back.
        assert sbx.files.read("/mnt/data/from-child.txt") == "child"
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_pooled_sandbox_with_a_volume_pauses(volumes: Volumes, sandboxes: Tracker):
    """A pooled sandbox gets its volume attached after its start (`attach.rs`), not from
    its spec: the checkpoint finds it and the restore mounts it again all the same."""
    template = "code-interpreter-v1"
    before = api("GET", "/cubicle/pool").json()
    if not before.get("target", {}).get(template):
        pytest.skip("the server runs no code-interpreter pool (CUBICLE_E2E_SERVE_ARGS)")
    vol = volumes.create()
    sbx = sandboxes.create(template, volume_mounts={"/mnt/pooled": vol}, timeout=300)
    # (a replica sums its nodes' pool figures as it last polled them, ≤ 0.5 s old)
    after = poll(lambda: (a := api("GET", "/cubicle/pool").json())["claims"] > before["claims"] and a, timeout=5)
    assert after and after["claims"] == before["claims"] + 1, (before, after)
    start_writer(sbx, 8792, "/mnt/pooled/log.txt")
    n1, pid = read_writer(sbx, 8792)
    assert sbx.pause() is True
    sbx.connect(timeout=300)
    assert read_writer(sbx, 8792) == (n1 + 1, pid)
    assert vol.read_file("/log.txt") == lines(n1 + 1)
    assert vol.get_info("/log.txt").uid == 1000


def test_read_only_volume_stays_read_only_across_a_pause(volumes: Volumes, sandboxes: Tracker):
    """The restore makes the volume's mount with the flags it had: read-only stays."""
    vol = volumes.create()
    vol.write_file("/kept.txt", "kept")
    r = api(
        "POST",
        "/v2/sandboxes",
        json={
            "templateID": "base",
            "timeout": 300,
            "volumeMounts": [{"name": vol.name, "path": "/mnt/ro", "readOnly": True}],
        },
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    sandboxes.track(sid)
    sbx = Sandbox.connect(sid)
    assert sbx.pause() is True
    sbx.connect(timeout=300)
    assert sbx.files.read("/mnt/ro/kept.txt") == "kept"
    res = sbx.commands.run("{ echo x > /mnt/ro/new; } 2>&1; true", user="root")
    assert "Read-only file system" in res.stdout, res
    assert not vol.exists("/new")
