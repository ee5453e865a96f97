"""Damaged disk entries: every byte of an entry's record, header included, is checked; a
damaged entry is dropped, counted, and the right bytes come from the store."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import asyncstore
from asyncstore.cache import TieredCache
from asyncstore.cache._disk import DiskTier
from asyncstore.cache._record import decode, decode_parts, encode_head
from asyncstore.stores import drop_memory_store

from ..conftest import unique

VALUE = bytes(range(48)) * 2


def located(tier: DiskTier, key: str) -> tuple[str, int, int]:
    found = tier.locate(key)
    assert found is not None, key
    return found


def overwrite(path: str, offset: int, data: bytes) -> None:
    """Damage a record in place, as a bad disk or a stray writer would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


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
        etag = '"0123456789abcdef"'
        assert tier.write(key, VALUE, etag)
        path, offset, size = located(tier, key)
        with open(path, "rb") as f:
            pristine = os.pread(f.fileno(), size, offset)
        assert tier.read(key) == (VALUE, etag)
        for position in range(len(pristine)):
            for flip in (0x01, 0x80, 0xFF):  # low bit, high bit (invalid UTF-8), every bit
                overwrite(path, offset + position, bytes([pristine[position] ^ flip]))
                with pytest.raises(asyncstore.IntegrityError):
                    tier.read(key)
                assert tier.locate(key) is None, position  # dropped, not left for the next reader
                assert tier.write(key, VALUE, etag)  # written again, at a new place
                path, offset, _ = located(tier, key)
        # And cut short anywhere: the record is the last of its segment, so the file ends
        # inside it.
        for length in range(len(pristine)):
            assert os.path.getsize(path) == offset + len(pristine)
            os.truncate(path, offset + length)
            with pytest.raises(asyncstore.IntegrityError):
                tier.read(key)
            assert tier.locate(key) is None, length
            assert tier.write(key, VALUE, etag)
            path, offset, _ = located(tier, key)
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

    def record() -> tuple[str, int, bytes]:
        tier = DiskTier(tmp_path, 1 << 20, store.identity)
        try:
            path, offset, size = located(tier, "data/k")
        finally:
            tier.close()
        with open(path, "rb") as f:
            return path, offset, os.pread(f.fileno(), size, offset)

    path, offset, pristine = record()
    for position in range(len(pristine)):
        overwrite(path, offset + position, bytes([pristine[position] ^ 0x80]))
        # A high bit: in the ETag, no longer valid UTF-8.
        async with TieredCache(store, validate="etag", ttl=float("inf"), **options) as cache:
            assert await cache.get("data/k") == VALUE, position
            stats = cache.stats()
            assert stats.disk.corrupt == 1, position
            assert stats.disk.enabled
        # The damaged record went; the refetch wrote the entry again, whole.
        path, offset, again = record()
        assert again == pristine, position


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("size", 1 << 62),  # would allocate exabytes if believed
        ("size", 2_000_000),  # within the budget, past the end of the segment
        ("size", -1),
        ("offset", -5),
        ("offset", 1 << 40),
        ("segment", -1),
        ("size", "many"),
    ],
)
def test_a_crafted_index_row_is_damage_not_an_allocation(
    tmp_path: Path, column: str, value: object
) -> None:
    tier = DiskTier(tmp_path, 4 << 20, "memory://source/prefix")
    try:
        assert tier.write("data/k", VALUE, None)
        with sqlite3.connect(tmp_path / "index.sqlite") as db:
            db.execute(f"UPDATE entries SET {column} = ?", (value,))  # column from the list
        with pytest.raises(asyncstore.IntegrityError):
            tier.read_cached("data/k")
        with pytest.raises(asyncstore.IntegrityError):
            tier.read("data/k")
        assert tier.read("data/k") is None  # dropped
    finally:
        tier.close()


def test_every_flipped_byte_is_caught_in_a_record_read_in_two_parts() -> None:
    # decode_parts, the read of a large record's payload straight into its bytes: a flipped
    # byte in the head either moves where the payload starts (None: the reader reads the
    # record whole, and decode catches it) or fails a check; one in the payload fails the
    # checksum.
    identity, key, etag = b"memory://source/prefix", "data/k", '"0123456789abcdef"'
    payload = os.urandom(20_000)
    head = encode_head(identity, key, payload, etag)
    assert decode_parts(head, payload, identity, key) == (payload, etag)
    assert decode_parts(head, payload, identity, key)[0] is payload  # type: ignore[index]
    positions = [*range(len(head)), *range(len(head), len(head) + len(payload), 97)]
    positions.append(len(head) + len(payload) - 1)
    for position in positions:
        for flip in (0x01, 0x80, 0xFF):
            raw = bytearray(head + payload)
            raw[position] ^= flip
            parts = bytes(raw[: len(head)]), bytes(raw[len(head) :])
            try:
                got = decode_parts(*parts, identity, key)
            except asyncstore.IntegrityError:
                continue
            assert got is None, (position, flip)
            with pytest.raises(asyncstore.IntegrityError):
                decode(raw, identity, key)
    # Parts of other lengths than the record's: the payload cut short or run long.
    with pytest.raises(asyncstore.IntegrityError, match="payload bytes"):
        decode_parts(head, payload[:-1], identity, key)
    with pytest.raises(asyncstore.IntegrityError, match="payload bytes"):
        decode_parts(head, payload + b"x", identity, key)
    assert decode_parts(head[:-1], head[-1:] + payload, identity, key) is None
    with pytest.raises(asyncstore.IntegrityError, match="another key"):
        decode_parts(head, payload, identity, "data/j")
