"""Damaged disk entries: every byte of an entry file, header included, is checked; a damaged
entry is dropped, counted, and the right bytes come from the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import asyncstore
from asyncstore.cache import TieredCache
from asyncstore.cache._disk import DiskTier
from asyncstore.stores import drop_memory_store

from .conftest import unique

VALUE = bytes(range(48)) * 2


@pytest.fixture
async def store() -> AsyncIterator[asyncstore.Store]:
    name = unique("damage")
    async with asyncstore.open_store(f"memory://{name}") as store:
        await store.put("data/k", VALUE)
        yield store
    drop_memory_store(name)


def test_every_flipped_byte_of_an_entry_is_caught(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, "memory://source/prefix")
    try:
        # A block entry with an ETag: every part of the header is present.
        key = "data/k\x004096.0"
        assert tier.write(key, VALUE, '"0123456789abcdef"')
        path = Path(tier.path_for(tier.name_for(key)))
        pristine = path.read_bytes()
        assert tier.read(key) == (VALUE, '"0123456789abcdef"')
        for position in range(len(pristine)):
            for flip in (0x01, 0x80, 0xFF):  # low bit, high bit (invalid UTF-8), every bit
                damaged = bytearray(pristine)
                damaged[position] ^= flip
                path.write_bytes(bytes(damaged))
                with pytest.raises(asyncstore.IntegrityError):
                    tier.read(key)
                assert not path.exists(), position  # dropped, not left for the next reader
        # And cut short anywhere.
        for length in range(len(pristine)):
            path.write_bytes(pristine[:length])
            with pytest.raises(asyncstore.IntegrityError):
                tier.read(key)
            assert not path.exists(), length
    finally:
        tier.close()


@pytest.mark.anyio
async def test_reads_through_damaged_entries_get_the_stores_bytes(
    store: asyncstore.Store, tmp_path: Path
) -> None:
    options: dict[str, Any] = {"memory_bytes": 1, "disk_dir": tmp_path, "disk_bytes": 1 << 20}
    # validate="etag" keeps the object's ETag in the entry: flips land in it too.
    async with TieredCache(store, validate="etag", ttl=float("inf"), **options) as cache:
        assert await cache.get("data/k") == VALUE
    (path,) = tmp_path.glob("*/*.entry")
    pristine = path.read_bytes()
    for position in range(len(pristine)):
        damaged = bytearray(pristine)
        damaged[position] ^= 0x80  # a high bit: in the ETag, no longer valid UTF-8
        path.write_bytes(bytes(damaged))
        async with TieredCache(store, validate="etag", ttl=float("inf"), **options) as cache:
            assert await cache.get("data/k") == VALUE, position
            stats = cache.stats()
            assert stats.disk.corrupt == 1, position
            assert stats.disk.enabled
        # The damaged file went; the refetch wrote the entry again, whole.
        assert path.read_bytes() == pristine, position
