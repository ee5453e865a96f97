"""Truncated bodies through a middlebox: every read path, every framing, every cut.

The fault proxy re-frames the server's responses to GETs as close-delimited bodies (no
``Content-Length``: the end of the body is the end of the connection) or chunked ones, and cuts
them at every position class. Every read path of the S3 store must then return exactly the
right bytes, or raise an asyncstore error; short bytes are never data (DESIGN.md invariant 8).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import asyncstore
from asyncstore import StoreUnavailable
from asyncstore.testing import FaultProxy, SeaweedFS
from asyncstore.testing._http import CUTS, ENCODINGS

from ..conftest import BUCKET, MiB, s3_options, unique
from .conftest import FAST

pytestmark = pytest.mark.anyio

SMALL = os.urandom(200_000)  # several 64 KiB chunks when chunked
LARGE = os.urandom(5 * MiB + 100_000)  # two parallel ranges at the 5 MiB part size

Read = Callable[[asyncstore.Store], Awaitable[bytes]]


async def _reader(store: asyncstore.Store, key: str) -> bytes:
    async with store.open_reader(key, chunk_bytes=50_000) as reader:
        return b"".join([chunk async for chunk in reader])


# Each read path, with the bytes it must return.
PATHS: dict[str, tuple[Read, bytes]] = {
    "get": (lambda s: s.get("small"), SMALL),
    "get_large": (lambda s: s.get("large"), LARGE),
    "range": (lambda s: s.get("small", 1000, 150_000), SMALL[1000:150_000]),
    "open_range": (lambda s: s.get("small", 70_000), SMALL[70_000:]),
    "past_end": (lambda s: s.get("small", 150_000, 10**9), SMALL[150_000:]),
    "reader": (lambda s: _reader(s, "small"), SMALL),
    "reader_large": (lambda s: _reader(s, "large"), LARGE),
}


@pytest.fixture(scope="module")
def prefix(seaweedfs: SeaweedFS) -> str:
    """A prefix holding the objects every test reads, written once, directly."""
    name = unique("middlebox")

    async def fill() -> None:
        url = f"s3://{BUCKET}/{name}"
        async with asyncstore.open_store(url, **s3_options(seaweedfs)) as store:
            await store.put("small", SMALL)
            await store.put("large", LARGE)

    import anyio

    anyio.run(fill)
    return name


def through(proxy: FaultProxy, server: SeaweedFS, prefix: str) -> asyncstore.Store:
    options = s3_options(server, endpoint_url=proxy.url, **FAST)
    return asyncstore.open_store(f"s3://{BUCKET}/{prefix}", **options)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_honest_middlebox_reads_in_full(
    faults: FaultProxy, seaweedfs: SeaweedFS, prefix: str, encoding: str, path: str
) -> None:
    read, expected = PATHS[path]
    async with through(faults, seaweedfs, prefix) as store:
        faults.middlebox(encoding)
        assert await read(store) == expected
        assert faults.rewritten >= 1
        assert faults.cut == 0


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_one_cut_body_is_retried(
    faults: FaultProxy, seaweedfs: SeaweedFS, prefix: str, encoding: str, cut: str, path: str
) -> None:
    # A cut is transient: the read retries (or resumes) and returns every byte.
    read, expected = PATHS[path]
    async with through(faults, seaweedfs, prefix) as store:
        faults.middlebox(encoding, cut, n=1)
        data = await read(store)
        assert faults.cut == 1
        assert len(data) == len(expected)
        assert data == expected


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_every_body_cut_is_an_error_never_short_bytes(
    faults: FaultProxy, seaweedfs: SeaweedFS, prefix: str, encoding: str, cut: str, path: str
) -> None:
    read = PATHS[path][0]
    async with through(faults, seaweedfs, prefix) as store:
        faults.middlebox(encoding, cut, n=1_000_000)
        # Before the fix, close-delimited cuts came back as short bytes, and readers of
        # bodies without Content-Length ended at once with none.
        with pytest.raises(StoreUnavailable, match="failed 4 time") as caught:
            await read(store)
        assert store.url in str(caught.value)
        assert faults.cut >= 4


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_cache_never_keeps_a_short_copy(
    faults: FaultProxy, seaweedfs: SeaweedFS, prefix: str, encoding: str, tmp_path: Path
) -> None:
    async with (
        through(faults, seaweedfs, prefix) as store,
        asyncstore.TieredCache(
            store, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 24
        ) as cache,
    ):
        faults.middlebox(encoding, "middle", n=1_000_000)
        with pytest.raises(StoreUnavailable):
            await cache.get("small")
        faults.middlebox(None)
        assert await cache.get("small") == SMALL
