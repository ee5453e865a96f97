"""Uploads the server checks: S3 writers send each part's CRC32C, the server refuses a part
that does not match it (and the part is sent again) and returns the checksum it checked, so
a mirror upload needs no read-back. Bytes are damaged on their way to the real server by the
fault proxy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import asyncstore
from asyncstore.checkpoint import Checkpointer
from asyncstore.stores import CheckedUploads
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("size", [3 * MiB, 12 * MiB])  # one PUT; three parts of 5 MiB
async def test_the_server_checks_every_part_and_a_damaged_one_is_sent_again(
    seaweedfs: SeaweedFS, proxy: FaultProxy, size: int
) -> None:
    data = os.urandom(size)
    options = s3_options(seaweedfs, endpoint_url=proxy.url)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('crc')}", **options) as store:
        writer = store.open_writer("a")
        assert isinstance(writer, CheckedUploads)
        async with writer:
            await writer.write(data)
            assert writer.server_checked is False  # nothing committed yet
        assert writer.server_checked is True
        # One byte flipped on its way to the server: refused (BadDigest), sent again, and
        # what is stored is what was written.
        proxy.corrupt_next(1, match="PUT ")
        writer = store.open_writer("b")
        async with writer:
            await writer.write(data)
        assert proxy.corrupted == 1
        assert writer.server_checked is True
        assert await store.get("b") == data
    # With no checksum sent the server checks nothing, and the writer says so.
    plain = s3_options(seaweedfs, endpoint_url=proxy.url, checksum=None)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('crc')}", **plain) as store:
        writer = store.open_writer("c")
        async with writer:
            await writer.write(data)
        assert isinstance(writer, CheckedUploads)
        assert writer.server_checked is False
        proxy.corrupt_next(1, match="PUT ")
        await store.put("d", data)
        assert proxy.corrupted == 2
        assert await store.get("d") != data  # what the checksum is for


async def test_a_signed_payload_is_stored_as_well(seaweedfs: SeaweedFS) -> None:
    # For a server that refuses UNSIGNED-PAYLOAD: the SHA-256 goes in the signature.
    data = os.urandom(6 * MiB)
    options = s3_options(seaweedfs, sign_payload=True)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('signed')}", **options) as store:
        await store.put("small", data[:1000])
        await store.put("large", data)
        assert await store.get("small") == data[:1000]
        assert await store.get("large") == data


async def test_a_mirror_copy_damaged_on_the_wire_is_uploaded_again(
    tmp_path: Path, seaweedfs: SeaweedFS, proxy: FaultProxy
) -> None:
    # Without reading the copy back: the server refuses the damaged part, the part is sent
    # again, and what the mirror holds loads byte for byte.
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
    assert ckpt.stats().upload_failures == 0  # the store's retry sent the part again
    assert ckpt.stats().uploads == 1
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        loaded = await only_mirror.load()
        assert torch.equal(loaded["w"], weights)
        assert (await only_mirror.verify(1)).ok
