"""Uploads checked against the server's ETag: S3 writers compute each part's MD5, and a
mirror upload counts only once the ETag says the server stored exactly what was sent. Bytes
are damaged on their way to the real server by the fault proxy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import asyncstore
from asyncstore import StoreError
from asyncstore.checkpoint import Checkpointer
from asyncstore.stores import CheckedUploads
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("size", [3 * MiB, 12 * MiB])  # one PUT; three parts of 5 MiB
async def test_the_etag_tells_whether_the_server_stored_what_was_sent(
    seaweedfs: SeaweedFS, proxy: FaultProxy, size: int
) -> None:
    data = os.urandom(size)
    options = s3_options(seaweedfs, endpoint_url=proxy.url)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('md5')}", **options) as store:
        writer = store.open_writer("a")
        assert isinstance(writer, CheckedUploads)
        writer.track_md5()
        async with writer:
            await writer.write(data)
        assert writer.md5_matches is True
        # One byte flipped on its way to the server: stored as received, and told.
        proxy.corrupt_next(1, match="PUT ")
        writer = store.open_writer("b")
        assert isinstance(writer, CheckedUploads)
        writer.track_md5()
        async with writer:
            await writer.write(data)
        assert proxy.corrupted == 1
        assert writer.md5_matches is False
        assert await store.get("b") != data  # what the check is for
        # Not tracked: nothing to tell.
        async with store.open_writer("c") as untracked:
            await untracked.write(data)
        assert isinstance(untracked, CheckedUploads)
        assert untracked.md5_matches is None
        late = store.open_writer("d")
        assert isinstance(late, CheckedUploads)
        async with late:
            await late.write(b"x" * 10)
            with pytest.raises(StoreError, match="track_md5"):
                late.track_md5()


async def test_a_mirror_copy_damaged_on_the_wire_is_uploaded_again(
    tmp_path: Path, seaweedfs: SeaweedFS, proxy: FaultProxy
) -> None:
    # Without reading the copy back: the ETag shows the damage, the copy is deleted and
    # uploaded again, and what the mirror holds in the end loads byte for byte.
    from asyncstore.checkpoint import _mirror

    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs, endpoint_url=proxy.url)
    weights = torch.randn(3_000_000)  # 12 MB: a multipart pack
    state = {"w": weights, "step": 1}
    proxy.corrupt_next(1, match="partNumber=2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_mirror, "UPLOAD_RETRY_SECONDS", 0.01)
        async with Checkpointer(tmp_path / "run", mirror=mirror, mirror_options=options) as ckpt:
            await (await ckpt.save(state, 1))
    assert proxy.corrupted == 1
    assert ckpt.stats().upload_failures == 1
    assert ckpt.stats().uploads == 1
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        loaded = await only_mirror.load()
        assert torch.equal(loaded["w"], weights)
        assert (await only_mirror.verify(1)).ok
