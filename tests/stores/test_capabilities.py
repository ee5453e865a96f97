"""What each store can do beyond the Store interface, as the layers above ask for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import asyncstore
from asyncstore import NotFound, PermissionDenied, StoreError
from asyncstore.stores import CleansUpWrites, LocalFiles, PinnedReads, Store
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique

pytestmark = pytest.mark.anyio

EXPECTED = {
    "memory": {"remote": False, "CleansUpWrites": False, "LocalFiles": False, "PinnedReads": False},
    "local": {"remote": False, "CleansUpWrites": True, "LocalFiles": True, "PinnedReads": False},
    "s3": {"remote": True, "CleansUpWrites": True, "LocalFiles": False, "PinnedReads": True},
}


async def test_each_store_declares_its_capabilities(store: Store, store_kind: str) -> None:
    assert isinstance(store, Store)
    found = {
        "remote": store.remote,
        "CleansUpWrites": isinstance(store, CleansUpWrites),
        "LocalFiles": isinstance(store, LocalFiles),
        "PinnedReads": isinstance(store, PinnedReads),
    }
    assert found == EXPECTED[store_kind]


async def test_reopen_args_open_the_same_objects(store: Store, store_kind: str) -> None:
    await store.put("a/b", b"payload")
    url, options = store.reopen_args()
    assert isinstance(options, dict)
    # What a DataLoader worker does: open the store anew from plain values.
    async with asyncstore.open_store(url, **options) as again:
        assert again.identity == store.identity
        assert await again.get("a/b") == b"payload"


async def test_reopen_args_keep_a_local_directory_with_url_characters(tmp_path: Path) -> None:
    odd = tmp_path / "100% #1 run"
    async with asyncstore.open_store(str(odd)) as store:
        await store.put("k", b"v")
        url, options = store.reopen_args()
    async with asyncstore.open_store(url, **options) as again:
        assert await again.get("k") == b"v"


async def test_local_files_capability(tmp_path: Path) -> None:
    async with asyncstore.open_store(str(tmp_path / "s")) as store:
        assert isinstance(store, LocalFiles)
        await store.put("dir/k", b"local bytes")
        path = store.local_path("dir/k")
        assert Path(path).read_bytes() == b"local bytes"
        fd = store.open_local_file("dir/k")
        try:
            assert os.pread(fd, 5, 6) == b"bytes"
        finally:
            os.close(fd)
        with pytest.raises(NotFound):
            store.open_local_file("dir")  # a directory of keys is not an object
        os.symlink("/etc", tmp_path / "s" / "escape")
        with pytest.raises(PermissionDenied, match="outside the store's directory"):
            store.local_path("escape/passwd")
        error = store.local_error(PermissionError(13, "Permission denied"), "dir/k", "read")
        assert isinstance(error, PermissionDenied)
        assert "dir/k" in str(error)
        writer = store.open_direct_writer("big")
        async with writer:
            await writer.write(b"x" * 10_000)
        assert await store.get("big") == b"x" * 10_000


@pytest.mark.s3
async def test_pinned_reads_refuse_another_version(seaweedfs: SeaweedFS) -> None:
    url = f"s3://{BUCKET}/{unique()}"
    async with asyncstore.open_store(url, **s3_options(seaweedfs)) as store:
        assert isinstance(store, PinnedReads)
        await store.put("k", b"first version")
        etag = (await store.stat("k")).etag
        assert await store.get_pinned("k", 0, 5, etag) == b"first"
        await store.put("k", b"second version")
        with pytest.raises(StoreError, match="replaced"):
            await store.get_pinned("k", 0, 5, etag)


KILLED_WRITER = """
import asyncio, os, signal, sys
import asyncstore

async def main():
    async with asyncstore.open_store(sys.argv[1]) as store:
        async with store.open_writer("runs/step-7.ckpt") as writer:
            await writer.write(b"half of a checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_abandoned_writes_of_a_local_store(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    root = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(root)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    async with asyncstore.open_store(str(root)) as store:
        assert isinstance(store, CleansUpWrites)
        # A live writer's temp file is not abandoned.
        async with store.open_writer("runs/step-8.ckpt") as live:
            await live.write(b"being written")
            assert await store.abandoned_writes("runs/step-") == ["runs/step-7.ckpt"]
            assert await store.abandoned_writes("runs/other") == []
            assert await store.abandoned_writes("step-") == []  # another directory
            assert await store.clean_up_writes("runs/step-7.ckpt") == 1
            assert await store.abandoned_writes("runs/") == []
        assert await store.get("runs/step-8.ckpt") == b"being written"


@pytest.mark.s3
async def test_abandoned_writes_of_an_s3_store(seaweedfs: SeaweedFS) -> None:
    url = f"s3://{BUCKET}/{unique()}"
    async with asyncstore.open_store(url, **s3_options(seaweedfs)) as store:
        assert isinstance(store, CleansUpWrites)
        writer = store.open_writer("ckpt/step-1.ckpt")
        await writer.__aenter__()
        await writer.write(bytes(6 << 20))  # past one part: a multipart upload starts
        await writer.write(bytes(1))
        assert await store.abandoned_writes("ckpt/") == ["ckpt/step-1.ckpt"]
        assert await store.abandoned_writes("other/") == []
        assert await store.clean_up_writes("ckpt/step-1.ckpt") == 1
        assert await store.abandoned_writes("ckpt/") == []
        await writer.aclose()
