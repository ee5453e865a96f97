"""What only a local directory store has to get right: symlinks, temp files, directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import asyncstore
from asyncstore import NotFound, PermissionDenied, StoreError

pytestmark = pytest.mark.anyio


@pytest.fixture
async def local(tmp_path: Path) -> asyncstore.LocalStore:
    store = asyncstore.open_store(tmp_path / "root")
    assert isinstance(store, asyncstore.LocalStore)
    return store


async def test_files_land_under_the_root(local: asyncstore.LocalStore) -> None:
    await local.put("a/b/c.bin", b"data")
    assert (Path(local.root) / "a" / "b" / "c.bin").read_bytes() == b"data"


async def test_symlink_out_of_the_root_is_refused(
    local: asyncstore.LocalStore, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = Path(local.root)
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "filelink").symlink_to(outside / "secret")
    with pytest.raises(PermissionDenied, match="outside"):
        await local.get("link/secret")
    with pytest.raises(PermissionDenied, match="outside"):
        await local.get("filelink")
    with pytest.raises(PermissionDenied, match="outside"):
        await local.put("link/new", b"x")
    with pytest.raises(PermissionDenied, match="outside"):
        await local.put("filelink", b"x")
    with pytest.raises(PermissionDenied):
        async with local.open_writer("link/streamed") as writer:
            await writer.write(b"x")
    with pytest.raises(PermissionDenied):
        await local.delete("link/secret")
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret"
    assert [i.key async for i in local.list()] == []
    assert [i.key async for i in local.list("link/")] == []


async def test_symlink_inside_the_root_is_followed(local: asyncstore.LocalStore) -> None:
    await local.put("real/file", b"payload")
    (Path(local.root) / "alias").symlink_to(Path(local.root) / "real" / "file")
    assert await local.get("alias") == b"payload"
    assert [i.key async for i in local.list()] == ["alias", "real/file"]


async def test_temp_files_are_invisible(local: asyncstore.LocalStore) -> None:
    async with local.open_writer("dir/obj") as writer:
        await writer.write(b"partial")
        names = os.listdir(Path(local.root) / "dir")
        assert len(names) == 1
        assert names[0].startswith(".asyncstore")
        assert [i.key async for i in local.list()] == []
        with pytest.raises(NotFound):
            await local.get("dir/obj")
    assert os.listdir(Path(local.root) / "dir") == ["obj"]


async def test_stale_temp_file_from_a_crash_is_not_listed(local: asyncstore.LocalStore) -> None:
    await local.put("k", b"v")
    (Path(local.root) / ".asyncstore-tmp-deadbeef-k").write_bytes(b"torn")
    assert [i.key async for i in local.list()] == ["k"]
    assert await local.get("k") == b"v"


async def test_delete_prunes_empty_directories(local: asyncstore.LocalStore) -> None:
    await local.put("a/b/c/d", b"1")
    await local.put("a/keep", b"2")
    await local.delete("a/b/c/d")
    assert sorted(os.listdir(Path(local.root) / "a")) == ["keep"]
    await local.delete("a/keep")
    assert os.listdir(local.root) == []
    assert os.path.isdir(local.root)


async def test_a_directory_removed_by_a_concurrent_delete_is_made_again(
    local: asyncstore.LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A delete of the last key under "leases/" removes the directory; a put under it that
    # runs makedirs in that moment sees mkdir fail with EEXIST, then finds no directory,
    # and makedirs raises FileExistsError (seen in CI: a save's lease put failed).
    real = os.makedirs
    raced: list[str] = []

    def makedirs(name: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        if not raced:
            raced.append(name)
            raise FileExistsError(17, "File exists", name)
        real(name, mode, exist_ok)

    monkeypatch.setattr(os, "makedirs", makedirs)
    await local.put("leases/one.lease", b"x")
    assert raced == [os.path.join(local.root, "leases")]
    assert await local.get("leases/one.lease") == b"x"


async def test_object_and_prefix_conflict(local: asyncstore.LocalStore) -> None:
    await local.put("a", b"file")
    with pytest.raises(StoreError, match="cannot hold both"):
        await local.put("a/b", b"x")
    await local.put("d/e", b"x")
    with pytest.raises(StoreError, match="cannot hold both"):
        await local.put("d", b"x")
    with pytest.raises(NotFound):
        await local.get("d")  # a directory is not an object
    with pytest.raises(NotFound):
        await local.stat("d")


async def test_get_of_missing_root(tmp_path: Path) -> None:
    async with asyncstore.open_store(tmp_path / "absent") as store:
        with pytest.raises(NotFound):
            await store.get("k")
        assert [i async for i in store.list()] == []


async def test_put_without_fsync(tmp_path: Path) -> None:
    async with asyncstore.open_store(tmp_path / "r", fsync=False) as store:
        await store.put("k", b"v")
        assert await store.get("k") == b"v"


async def test_concurrent_writers_of_one_key(local: asyncstore.LocalStore) -> None:
    payloads = [bytes([i]) * 100_000 for i in range(16)]

    async def write(data: bytes) -> None:
        await local.put("same", data)

    async with anyio.create_task_group() as tg:
        for data in payloads:
            tg.start_soon(write, data)
    assert await local.get("same") in payloads
    assert os.listdir(local.root) == ["same"]  # no temp file left behind


async def test_symlink_escape_creates_nothing_outside(
    local: asyncstore.LocalStore, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    Path(local.root).mkdir()
    (Path(local.root) / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied):
        await local.put("link/new/deeper/x", b"x")
    assert list(outside.iterdir()) == []


async def test_long_non_ascii_names(local: asyncstore.LocalStore) -> None:
    key = "dir/" + "数" * 80  # 240 bytes in UTF-8, under the 255-byte name limit
    await local.put(key, b"v")
    async with local.open_writer(key + "x") as writer:
        await writer.write(b"w")
    assert await local.get(key) == b"v"
    assert [i.key async for i in local.list("dir/")] == [key, key + "x"]


def test_short_writes_are_completed() -> None:
    # Unbuffered writes may write less than asked (Linux caps one call near 2 GiB); the
    # store must loop. A file that takes at most 7 bytes per call stands in for that.
    from asyncstore.stores._localwrite import write_all as _write_all

    class Trickle:
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, view: memoryview) -> int:
            self.data += view[:7]
            return min(7, len(view))

    sink = Trickle()
    _write_all(sink, memoryview(bytes(range(100))))  # type: ignore[arg-type]
    assert bytes(sink.data) == bytes(range(100))


KILLED_WRITER = """
import asyncio, os, signal, sys
import asyncstore

async def main():
    async with asyncstore.open_store(sys.argv[1]) as store:
        writer = store.open_writer("ckpt/model.bin")
        await writer.__aenter__()
        await writer.write(b"x" * 100_000)
        print("writing", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_clean_up_writes_removes_only_abandoned_temp_files(
    local: asyncstore.LocalStore,
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, local.root], capture_output=True, timeout=60
    )
    assert b"writing" in result.stdout
    directory = Path(local.root) / "ckpt"
    assert len(list(directory.iterdir())) == 1  # the killed writer's temp file
    async with local.open_writer("ckpt/model.bin") as writer:
        await writer.write(b"live")
        assert await local.clean_up_writes("ckpt/model.bin") == 1  # not the live writer's
        assert len(list(directory.iterdir())) == 1
    assert [p.name for p in directory.iterdir()] == ["model.bin"]
    assert await local.get("ckpt/model.bin") == b"live"
    assert await local.clean_up_writes("ckpt/other.bin") == 0
    # Another key whose name ends the same way keeps its abandoned file until it is cleaned.
    other = directory / ".asyncstore-tmp-0123456789ab-a-model.bin"
    other.write_bytes(b"left by a killed writer of ckpt/a-model.bin")
    assert await local.clean_up_writes("ckpt/model.bin") == 0
    assert other.exists()
    assert await local.clean_up_writes("ckpt/a-model.bin") == 1
    assert not other.exists()


@pytest.mark.parametrize("direct", [False, True])
async def test_a_cleanup_between_creating_and_locking_a_temp_file_is_survived(
    local: asyncstore.LocalStore, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    # Another process's clean_up_writes() can lock and remove a temp file in the instant
    # between its creation and its writer's lock. The writer notices and starts over with
    # a new file, instead of writing into one nobody will see.
    import fcntl

    real_flock = fcntl.flock
    raced: list[int] = []
    racing = False

    def flock_after_a_cleanup(fd: int, operation: int) -> None:
        nonlocal racing
        if not racing:  # the writer's first lock: the real cleanup runs first
            racing = True
            raced.append(local._clean_up_writes("ckpt/model.bin"))
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_cleanup)
    async with local.open_writer("ckpt/model.bin", direct=direct) as writer:
        await writer.write(b"kept" * 5000)
    assert raced == [1]  # the cleanup did take the first temp file
    assert await local.get("ckpt/model.bin") == b"kept" * 5000
    assert [p.name for p in (Path(local.root) / "ckpt").iterdir()] == ["model.bin"]
