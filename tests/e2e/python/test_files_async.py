"""Files through the official async Python SDK (`AsyncSandbox.files`)."""

from __future__ import annotations

import hashlib
import io
import os
import uuid

import pytest
from e2b import AsyncSandbox, FileNotFoundException, FileType


@pytest.fixture
async def adir(asbx: AsyncSandbox):
    path = f"/home/user/at-{uuid.uuid4().hex[:12]}"
    assert await asbx.files.make_dir(path) is True
    assert await asbx.files.make_dir(path) is False
    yield path
    await asbx.files.remove(path, user="root")


async def test_write_read_variants(asbx: AsyncSandbox, adir: str):
    await asbx.files.write(f"{adir}/t.txt", "text ✓")
    assert await asbx.files.read(f"{adir}/t.txt") == "text ✓"

    await asbx.files.write(f"{adir}/b.bin", b"\x00\x01\x02")
    assert bytes(await asbx.files.read(f"{adir}/b.bin", format="bytes")) == b"\x00\x01\x02"

    data = os.urandom(3 * 1024 * 1024)
    await asbx.files.write(f"{adir}/s.bin", io.BytesIO(data))
    stream = await asbx.files.read(f"{adir}/s.bin", format="stream")
    got = b""
    async for chunk in stream:
        got += chunk
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()

    async def gen():
        for i in range(100):
            yield f"{i}\n".encode()

    await asbx.files.write(f"{adir}/gen.txt", gen())
    assert (await asbx.files.read(f"{adir}/gen.txt")).split() == [str(i) for i in range(100)]


async def test_write_files_list_info_rename_remove(asbx: AsyncSandbox, adir: str):
    infos = await asbx.files.write_files(
        [{"path": f"{adir}/m/{i}.txt", "data": str(i)} for i in range(5)]
    )
    assert len(infos) == 5
    entries = await asbx.files.list(f"{adir}/m")
    assert sorted(e.name for e in entries) == [f"{i}.txt" for i in range(5)]
    assert all(e.type == FileType.FILE for e in entries)
    deep = await asbx.files.list(adir, depth=2)
    assert sorted(e.path for e in deep) == sorted([f"{adir}/m"] + [f"{adir}/m/{i}.txt" for i in range(5)])

    info = await asbx.files.get_info(f"{adir}/m/3.txt")
    assert (info.size, info.owner, info.type) == (1, "user", FileType.FILE)

    moved = await asbx.files.rename(f"{adir}/m/3.txt", f"{adir}/moved.txt")
    assert moved.path == f"{adir}/moved.txt"
    assert await asbx.files.exists(f"{adir}/m/3.txt") is False
    assert await asbx.files.read(f"{adir}/moved.txt") == "3"

    await asbx.files.remove(f"{adir}/m")
    assert await asbx.files.exists(f"{adir}/m") is False
    with pytest.raises(FileNotFoundException):
        await asbx.files.get_info(f"{adir}/m")


async def test_metadata(asbx: AsyncSandbox, adir: str):
    p = f"{adir}/meta"
    await asbx.files.write(p, "m", metadata={"Key": "Value"})
    assert (await asbx.files.get_info(p)).metadata == {"key": "Value"}


async def test_user_root(asbx: AsyncSandbox):
    p = f"/tmp/cb-async-root-{uuid.uuid4().hex[:8]}"
    await asbx.files.write(p, "r", user="root")
    try:
        assert (await asbx.files.get_info(p)).owner == "root"
    finally:
        await asbx.files.remove(p, user="root")
