"""Files through the official sync Python SDK (`Sandbox.files`): write (str, bytes,
file-like stream, chunk iterator, many), read (text, bytes, stream), list with
depth, exists, get_info, make_dir, rename, remove, metadata, ownership, `~` and
relative paths. Every result is cross-checked against the real file system with
a command (`stat`, `cat`, `getfattr`)."""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from e2b import (
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
)


def stat(sbx: Sandbox, path: str, fmt: str) -> str:
    return sbx.commands.run(f"stat -c '{fmt}' '{path}'", user="root").stdout.strip()


# --- write / read --------------------------------------------------------------


def test_write_str_read_text(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/hello.txt"
    info = sbx.files.write(p, "hello wörld\n")
    assert info.path == p
    assert info.name == "hello.txt"
    assert info.type == FileType.FILE
    assert sbx.files.read(p) == "hello wörld\n"
    assert sbx.commands.run(f"cat {p}").stdout == "hello wörld\n"


def test_write_bytes_read_bytes(sbx: Sandbox, home_dir: str):
    data = bytes(range(256)) * 64 + b"\x00\xff"
    p = f"{home_dir}/bin.dat"
    sbx.files.write(p, data)
    got = sbx.files.read(p, format="bytes")
    assert isinstance(got, bytearray)
    assert bytes(got) == data
    assert stat(sbx, p, "%s") == str(len(data))


def test_write_empty_file(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/empty"
    sbx.files.write(p, "")
    assert sbx.files.read(p) == ""
    assert sbx.files.get_info(p).size == 0


def test_write_file_like_stream_and_read_stream(sbx: Sandbox, home_dir: str):
    data = os.urandom(5 * 1024 * 1024 + 7)
    p = f"{home_dir}/stream.bin"
    info = sbx.files.write(p, io.BytesIO(data))
    assert info.path == p
    chunks = list(sbx.files.read(p, format="stream"))
    assert len(chunks) >= 1
    got = b"".join(chunks)
    assert len(got) == len(data)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()
    assert sbx.commands.run(f"sha256sum {p}").stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_write_chunk_iterator(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/gen.txt"
    sbx.files.write(p, (f"line {i}\n".encode() for i in range(1000)))
    text = sbx.files.read(p)
    assert text.splitlines()[0] == "line 0"
    assert text.splitlines()[-1] == "line 999"
    assert len(text.splitlines()) == 1000


def test_write_octet_stream_and_gzip(sbx: Sandbox, home_dir: str):
    p1 = f"{home_dir}/octet.txt"
    sbx.files.write(p1, "octet body", use_octet_stream=True)
    assert sbx.files.read(p1) == "octet body"
    p2 = f"{home_dir}/gz.txt"
    body = "compress me " * 1000
    sbx.files.write(p2, body, gzip=True)
    assert sbx.commands.run(f"cat {p2}").stdout == body, "gzip body must be stored decompressed"
    assert sbx.files.read(p2, gzip=True) == body


def test_write_overwrites_and_truncates(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/over.txt"
    sbx.files.write(p, "a much longer original content")
    sbx.files.write(p, "short")
    assert sbx.files.read(p) == "short"


def test_write_files_many(sbx: Sandbox, home_dir: str):
    files = [
        {"path": f"{home_dir}/many/{i % 4}/f{i}.txt", "data": f"content {i}"}
        for i in range(20)
    ]
    files.append({"path": f"{home_dir}/many/bytes.bin", "data": b"\x01\x02"})
    infos = sbx.files.write_files(files)
    assert sorted(i.path for i in infos) == sorted(f["path"] for f in files)
    for f in files[:20]:
        assert sbx.files.read(f["path"]) == f["data"]
    assert bytes(sbx.files.read(f"{home_dir}/many/bytes.bin", format="bytes")) == b"\x01\x02"
    listed = sbx.commands.run(f"find {home_dir}/many -type f | wc -l").stdout.strip()
    assert listed == "21"


def test_write_creates_parents_owned_by_user(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/a/b/c/deep.txt"
    sbx.files.write(p, "deep")
    for d in (f"{home_dir}/a", f"{home_dir}/a/b", f"{home_dir}/a/b/c", p):
        assert stat(sbx, d, "%U:%G") == "user:user", d


def test_write_unicode_and_spaces_in_name(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/dir with space/ünï cödé \"q\".txt"
    sbx.files.write(p, "x")
    assert sbx.files.exists(p)
    names = [e.name for e in sbx.files.list(f"{home_dir}/dir with space")]
    assert names == ['ünï cödé "q".txt']
    assert sbx.files.read(p) == "x"


def test_read_missing_raises_file_not_found(sbx: Sandbox, home_dir: str):
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{home_dir}/missing.txt")


def test_read_directory_is_an_error(sbx: Sandbox, home_dir: str):
    with pytest.raises(SandboxException):
        sbx.files.read(home_dir)


def test_write_onto_directory_is_an_error(sbx: Sandbox, home_dir: str):
    with pytest.raises(SandboxException):
        sbx.files.write(home_dir, "x")
    assert stat(sbx, home_dir, "%F") == "directory"


# --- users and paths -----------------------------------------------------------


def test_ownership_user_vs_root(sbx: Sandbox, root_dir: str):
    pu = "/tmp/" + f"cb-user-{uuid.uuid4().hex[:8]}.txt"
    pr = f"{root_dir}/root.txt"
    try:
        sbx.files.write(pu, "u")
        sbx.files.write(pr, "r", user="root")
        assert stat(sbx, pu, "%U:%G") == "user:user"
        assert stat(sbx, pr, "%U:%G") == "root:root"
        assert sbx.files.get_info(pu).owner == "user"
        assert sbx.files.get_info(pr, user="root").owner == "root"
        assert sbx.files.get_info(pr, user="root").group == "root"
    finally:
        sbx.files.remove(pu, user="root")


def test_user_cannot_read_root_only_file(sbx: Sandbox):
    p = f"/root/cb-secret-{uuid.uuid4().hex[:8]}"
    sbx.files.write(p, "secret", user="root")
    try:
        with pytest.raises(SandboxException):
            sbx.files.read(p)
        assert sbx.files.read(p, user="root") == "secret"
    finally:
        sbx.files.remove(p, user="root")


def test_tilde_and_relative_paths(sbx: Sandbox, unique: str):
    name = f"cb-tilde-{unique}.txt"
    try:
        info = sbx.files.write(f"~/{name}", "tilde")
        assert info.path == f"/home/user/{name}"
        assert sbx.commands.run(f"cat /home/user/{name}").stdout == "tilde"
        assert sbx.files.read(name) == "tilde", "relative paths resolve against the home dir"
        assert sbx.files.exists(f"~/{name}")

        sbx.files.write(f"rel-{unique}/x.txt", "rel")
        assert sbx.commands.run(f"cat /home/user/rel-{unique}/x.txt").stdout == "rel"
        assert sbx.files.get_info("~").path == "/home/user"

        sbx.files.write(f"~/{name}", "root tilde", user="root")
        assert sbx.commands.run(f"cat /root/{name}", user="root").stdout == "root tilde"

        # relative paths follow the requested user: root's are under /root
        info = sbx.files.write(f"rel-{name}", "root rel", user="root")
        assert info.path == f"/root/rel-{name}"
        assert sbx.commands.run(f"stat -c %U /root/rel-{name}", user="root").stdout == "root\n"
        assert sbx.files.read(f"rel-{name}", user="root") == "root rel"
        assert not sbx.files.exists(f"rel-{name}"), "not in the default user's home"
        assert sbx.files.make_dir(f"rd-{unique}", user="root")
        assert [e.path for e in sbx.files.list(".", user="root") if e.name == f"rd-{unique}"] == [f"/root/rd-{unique}"]
        assert sbx.files.rename(f"rd-{unique}", f"rd2-{unique}", user="root").path == f"/root/rd2-{unique}"
        sbx.files.remove(f"rd2-{unique}", user="root")
        sbx.files.remove(f"rel-{name}", user="root")
        assert sbx.commands.run("ls -A /root", user="root").stdout.count(unique) == 1  # only ~/{name}
    finally:
        sbx.files.remove(f"/home/user/{name}", user="root")
        sbx.files.remove(f"/home/user/rel-{unique}", user="root")
        sbx.files.remove(f"/root/{name}", user="root")


# --- list / exists / get_info ---------------------------------------------------


def make_tree(sbx: Sandbox, base: str):
    sbx.commands.run(
        f"mkdir -p {base}/d1/d2/d3 && echo a > {base}/f0 && echo bb > {base}/d1/f1 "
        f"&& echo ccc > {base}/d1/d2/f2 && echo dddd > {base}/d1/d2/d3/f3"
    )


def test_list_depth(sbx: Sandbox, home_dir: str):
    make_tree(sbx, home_dir)
    rel = lambda entries: sorted(e.path[len(home_dir) + 1 :] for e in entries)  # noqa: E731

    one = sbx.files.list(home_dir)
    assert rel(one) == ["d1", "f0"]
    types = {e.name: e.type for e in one}
    assert types == {"d1": FileType.DIR, "f0": FileType.FILE}

    assert rel(sbx.files.list(home_dir, depth=2)) == ["d1", "d1/d2", "d1/f1", "f0"]
    assert rel(sbx.files.list(home_dir, depth=3)) == ["d1", "d1/d2", "d1/d2/d3", "d1/d2/f2", "d1/f1", "f0"]
    assert rel(sbx.files.list(home_dir, depth=10)) == [
        "d1", "d1/d2", "d1/d2/d3", "d1/d2/d3/f3", "d1/d2/f2", "d1/f1", "f0",
    ]
    sizes = {e.name: e.size for e in sbx.files.list(home_dir, depth=10)}
    assert sizes["f3"] == 5 and sizes["f0"] == 2


def test_list_depth_zero_rejected_by_sdk(sbx: Sandbox, home_dir: str):
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(home_dir, depth=0)


def test_list_errors(sbx: Sandbox, home_dir: str):
    with pytest.raises(FileNotFoundException):
        sbx.files.list(f"{home_dir}/nope")
    sbx.files.write(f"{home_dir}/file", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(f"{home_dir}/file")


def test_list_symlinks(sbx: Sandbox, home_dir: str):
    sbx.commands.run(
        f"mkdir {home_dir}/real && echo x > {home_dir}/real/in && "
        f"ln -s {home_dir}/real {home_dir}/link && ln -s {home_dir}/real/in {home_dir}/flink"
    )
    entries = {e.name: e for e in sbx.files.list(home_dir)}
    assert entries["flink"].type == FileType.SYMLINK
    assert entries["flink"].symlink_target == f"{home_dir}/real/in"
    assert entries["link"].type == FileType.SYMLINK
    # a symlinked directory is followed, reported under the requested prefix
    inside = sbx.files.list(f"{home_dir}/link")
    assert [e.path for e in inside] == [f"{home_dir}/link/in"]


def test_list_symlink_loop_does_not_hang(sbx: Sandbox, home_dir: str):
    sbx.commands.run(f"mkdir {home_dir}/loop && ln -s {home_dir}/loop {home_dir}/loop/self")
    try:
        entries = sbx.files.list(f"{home_dir}/loop", depth=20, request_timeout=20)
        assert len(entries) < 100
    except SandboxException:
        pass  # failed_precondition for a loop is also fine: the point is a bounded answer


def test_exists(sbx: Sandbox, home_dir: str):
    assert sbx.files.exists(home_dir) is True
    assert sbx.files.exists(f"{home_dir}/nope") is False
    sbx.files.write(f"{home_dir}/yes", "1")
    assert sbx.files.exists(f"{home_dir}/yes") is True


def test_get_info(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/info.txt"
    sbx.files.write(p, "12345")
    sbx.commands.run(f"chmod 640 {p}")
    info = sbx.files.get_info(p)
    assert info.name == "info.txt"
    assert info.path == p
    assert info.type == FileType.FILE
    assert info.size == 5
    assert info.permissions == stat(sbx, p, "%A") == "-rw-r-----"
    assert info.mode & 0o777 == 0o640
    assert info.owner == "user"
    assert info.group == "user"
    assert info.symlink_target is None
    now = datetime.now(timezone.utc)
    assert abs(info.modified_time - now) < timedelta(minutes=1)
    assert int(info.modified_time.timestamp()) == int(stat(sbx, p, "%Y"))

    d = sbx.files.get_info(home_dir)
    assert d.type == FileType.DIR
    assert d.permissions == stat(sbx, home_dir, "%A")
    assert d.permissions.startswith("d")


def test_get_info_missing(sbx: Sandbox, home_dir: str):
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{home_dir}/missing")


# --- make_dir / rename / remove --------------------------------------------------


def test_make_dir(sbx: Sandbox, home_dir: str):
    d = f"{home_dir}/x/y/z"
    assert sbx.files.make_dir(d) is True
    assert sbx.files.make_dir(d) is False
    assert stat(sbx, d, "%F %U") == "directory user"
    assert stat(sbx, f"{home_dir}/x", "%U") == "user"


def test_make_dir_over_file_is_an_error(sbx: Sandbox, home_dir: str):
    sbx.files.write(f"{home_dir}/f", "x")
    with pytest.raises(SandboxException):
        sbx.files.make_dir(f"{home_dir}/f")


def test_rename(sbx: Sandbox, home_dir: str):
    sbx.files.write(f"{home_dir}/old.txt", "moved")
    info = sbx.files.rename(f"{home_dir}/old.txt", f"{home_dir}/sub/dir/new.txt")
    assert info.path == f"{home_dir}/sub/dir/new.txt"
    assert info.name == "new.txt"
    assert not sbx.files.exists(f"{home_dir}/old.txt")
    assert sbx.files.read(f"{home_dir}/sub/dir/new.txt") == "moved"
    # directories move too
    sbx.files.rename(f"{home_dir}/sub", f"{home_dir}/sub2")
    assert sbx.files.read(f"{home_dir}/sub2/dir/new.txt") == "moved"


def test_rename_missing_source(sbx: Sandbox, home_dir: str):
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(f"{home_dir}/nope", f"{home_dir}/other")


def test_remove(sbx: Sandbox, home_dir: str):
    sbx.files.write(f"{home_dir}/r/a/b.txt", "x")
    sbx.files.write(f"{home_dir}/single.txt", "x")
    sbx.files.remove(f"{home_dir}/single.txt")
    assert not sbx.files.exists(f"{home_dir}/single.txt")
    sbx.files.remove(f"{home_dir}/r")
    assert not sbx.files.exists(f"{home_dir}/r")
    sbx.files.remove(f"{home_dir}/never-existed")  # not an error


# --- metadata --------------------------------------------------------------------


def test_metadata_round_trip(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/meta.txt"
    w = sbx.files.write(p, "with metadata", metadata={"Owner": "me", "purpose": "e2e test"})
    assert w.metadata == {"owner": "me", "purpose": "e2e test"}
    info = sbx.files.get_info(p)
    assert info.metadata == {"owner": "me", "purpose": "e2e test"}
    xattrs = sbx.commands.run(f"getfattr --absolute-names -d -m '^user\\.e2b\\.' {p}").stdout
    assert 'user.e2b.owner="me"' in xattrs
    assert 'user.e2b.purpose="e2e test"' in xattrs
    listed = {e.name: e for e in sbx.files.list(home_dir)}
    assert listed["meta.txt"].metadata == {"owner": "me", "purpose": "e2e test"}

    # an upload without metadata clears the previous metadata
    sbx.files.write(p, "no metadata")
    assert not sbx.files.get_info(p).metadata


def test_metadata_octet_stream(sbx: Sandbox, home_dir: str):
    p = f"{home_dir}/meta-octet.bin"
    sbx.files.write(p, io.BytesIO(b"abc"), metadata={"k": "v"})
    assert sbx.files.get_info(p).metadata == {"k": "v"}
