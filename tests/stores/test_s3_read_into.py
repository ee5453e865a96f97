"""``S3Store.get_pinned_into``: a range of one version of an object read straight into the
caller's buffers (how a checkpoint load fills its tensors), against SeaweedFS through the
fault proxy: bytes land in place across part boundaries, a cut or reset response is read
again rather than left short, and an object replaced since its ETag was taken is reported."""

from __future__ import annotations

import os

import pytest

import asyncstore
from asyncstore.stores import PinnedReads
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique

pytestmark = pytest.mark.anyio

DATA = os.urandom(12 * MiB + 123)  # parts of 5 MiB: three ranges


def views_for(sizes: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    buffers = [bytearray(size) for size in sizes]
    return buffers, [memoryview(b) for b in buffers]


@pytest.mark.parametrize(
    ("fault", "arg"),
    [
        (None, None),
        ("middlebox", "close"),  # a close-delimited body cut in the middle, once
        ("middlebox", "chunked"),
        ("reset", None),  # the connection reset 100 KB into a body, once
    ],
)
async def test_bytes_land_in_place(
    seaweedfs: SeaweedFS, proxy: FaultProxy, fault: str | None, arg: str | None
) -> None:
    options = s3_options(seaweedfs, endpoint_url=proxy.url)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('into')}", **options) as store:
        await store.put("obj", DATA)
        etag = (await store.stat("obj")).etag
        assert isinstance(store, PinnedReads)
        start = 1000
        sizes = [7, 3 * MiB, 1, 6 * MiB + 5, 2 * MiB]  # crossing 5 MiB boundaries unevenly
        buffers, views = views_for(sizes)
        if fault == "middlebox":
            proxy.middlebox(arg, cut="middle", n=1)
        elif fault == "reset":
            proxy.reset_next(1, after_bytes=100_000, match="GET ")
        await store.get_pinned_into("obj", start, views, etag)
        assert b"".join(buffers) == DATA[start : start + sum(sizes)]
        if fault == "middlebox":
            assert proxy.cut == 1
        elif fault == "reset":
            assert proxy.resets == 1


async def test_a_replaced_object_is_reported_not_mixed(seaweedfs: SeaweedFS) -> None:
    options = s3_options(seaweedfs)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique('into')}", **options) as store:
        await store.put("obj", DATA)
        etag = (await store.stat("obj")).etag
        await store.put("obj", DATA[::-1])
        assert isinstance(store, PinnedReads)
        _, views = views_for([len(DATA)])
        with pytest.raises(asyncstore.StoreError, match="replaced by another writer"):
            await store.get_pinned_into("obj", 0, views, etag)
