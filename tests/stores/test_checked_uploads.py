"""Uploads the server checks: S3 writers send each part's CRC32C, the server refuses a part
that does not match it (and the part is sent again) and returns the checksum it checked, so
a mirror upload needs no read-back. Bytes are damaged on their way to the real server by the
fault proxy."""

from __future__ import annotations

import hashlib
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


def uploads(proxy: FaultProxy) -> list[dict[str, str]]:
    """The headers of every PUT (an object or a part) the proxy saw."""
    return [headers for line, headers in proxy.seen if line.startswith("PUT ")]


def signed_headers(headers: dict[str, str]) -> set[str]:
    return set(headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";"))


@pytest.mark.parametrize("sign_payload", [False, True])
async def test_what_an_upload_sends(
    seaweedfs: SeaweedFS, proxy: FaultProxy, sign_payload: bool
) -> None:
    # The payload's hash is in the signature (what AWS checks, and SeaweedFS does not):
    # UNSIGNED-PAYLOAD, or the SHA-256 of the body for a server that wants signed payloads;
    # never the hash of an empty body. Each body goes with its CRC32C.
    data = os.urandom(12 * MiB)  # three parts of 5 MiB
    options = s3_options(seaweedfs, endpoint_url=proxy.url, sign_payload=sign_payload)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('wire')}", **options) as store:
        await store.put("small", data[:1000])
        await store.put("large", data)
        assert await store.get("small") == data[:1000]
        assert await store.get("large") == data
    bodies = [data[:1000], data[: 5 * MiB], data[5 * MiB : 10 * MiB], data[10 * MiB :]]
    sent = uploads(proxy)
    assert len(sent) == len(bodies)
    for headers in sent:
        assert {"x-amz-content-sha256", "content-length"} <= signed_headers(headers)
        assert headers["x-amz-checksum-crc32c"]
    hashes = sorted(h["x-amz-content-sha256"] for h in sent)
    if sign_payload:
        assert hashes == sorted(hashlib.sha256(body).hexdigest() for body in bodies)
    else:
        assert hashes == ["UNSIGNED-PAYLOAD"] * len(bodies)


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
