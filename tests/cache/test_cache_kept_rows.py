"""The rows a disk tier keeps from one stretch of lookups to the next, valid while the
index's count of removed entries stays the same."""

from __future__ import annotations

import multiprocessing
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncstore.cache import TieredCache, _disk, _index
from asyncstore.cache._disk import DiskTier, RowReader

from .conftest import CountingStore, KiB

SOURCE = "memory://source"


def value(key: str, version: int, size: int = 3000) -> bytes:
    return (f"{key}:{version}:".encode() * size)[:size]


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many names each of the index's lookups of many entries asked for."""
    sizes: list[int] = []
    find_many = _index.find_many

    def many(db: sqlite3.Connection, names: list[str], least: int, most: int) -> object:
        sizes.append(len(names))
        return find_many(db, names, least, most)

    monkeypatch.setattr(_index, "find_many", many)
    return sizes


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[DiskTier, DiskTier]]:
    """A reader and a writer on one directory, each with its own connections to the index
    (as two processes have)."""
    reader = DiskTier(tmp_path, 1 << 20, SOURCE)
    writer = DiskTier(tmp_path, 1 << 20, SOURCE)
    try:
        yield reader, writer
    finally:
        reader.close()
        writer.close()


def read(tier: DiskTier, keys: list[str], key: str) -> bytes | None:
    """``key``'s payload as a warm run reads it: its stretch looked up, then read from the
    page cache."""
    tier.expect(keys, 0, len(keys), ())
    try:
        hit = tier.read_cached(key)
    finally:
        tier.expect(keys, 0, 0, ())
    assert not isinstance(hit, _disk.WouldBlock)
    return None if hit is None else hit[0]


def test_rows_found_once_are_not_asked_for_again(
    tiers: tuple[DiskTier, DiskTier], asked: list[int]
) -> None:
    reader, writer = tiers
    keys = [f"k/{i}" for i in range(10)]
    writer.write_many([(key, value(key, 0), None) for key in keys[:8]])
    assert [read(reader, keys, key) for key in keys] == [value(k, 0) for k in keys[:8]] + [
        None,
        None,
    ]
    assert asked == [10]  # the first stretch; the rest were kept (or known absent)
    writer.flush_touches()  # a write to the index that removes nothing
    writer.write("k/8", value("k/8", 0), None)  # nor does an insert
    asked.clear()
    reader._absent_until = 0.0  # absent keys are asked for again after a while
    assert read(reader, keys, "k/8") == value("k/8", 0)
    assert asked == [2]  # only the keys not kept


@pytest.mark.parametrize("change", ["replace", "remove", "clear", "evict"])
def test_a_row_removed_since_is_not_served(
    tiers: tuple[DiskTier, DiskTier], asked: list[int], change: str
) -> None:
    reader, writer = tiers
    keys = [f"k/{i}" for i in range(4)]
    writer.write_many([(key, value(key, 0), None) for key in keys])
    assert read(reader, keys, "k/0") == value("k/0", 0)  # segment 1's descriptor kept open
    asked.clear()
    if change == "replace":
        writer.write("k/0", value("k/0", 1), None)  # same size: the same shape of record
        expected: bytes | None = value("k/0", 1)
    elif change == "remove":
        writer.remove("k/0")
        expected = None
    elif change == "clear":
        writer.clear()
        expected = None
    else:
        big = value("big", 0, 600 * KiB)
        for i in range(2):  # each one evicts everything before it
            assert writer.write(f"big/{i}", big, None)
        assert writer.locate("k/0") is None
        expected = None
    assert read(reader, keys, "k/0") == expected
    assert asked, "the kept rows were used after an entry was removed"


def test_rows_found_again_are_the_ones_kept_until_an_entry_is_removed(
    tiers: tuple[DiskTier, DiskTier], asked: list[int]
) -> None:
    reader, writer = tiers
    keys = [f"k/{i}" for i in range(6)]
    writer.write_many([(key, value(key, 0), None) for key in keys[:4]])
    first = reader.rows_now(keys)
    assert [row.key if row else None for row in first] == [*keys[:4], None, None]
    assert asked == [6]
    asked.clear()
    again = reader.rows_now(keys[1:4])
    assert asked == []  # nothing asked: the rows kept
    assert all(row is kept for row, kept in zip(again, first[1:4], strict=True))
    writer.write("k/4", value("k/4", 0), None)  # an insert removes nothing
    reader._absent_until = 0.0  # absent keys are asked for again after a while
    kept, new = reader.rows_now(keys[3:5])
    assert asked == [1]  # only the key not kept
    assert kept is first[3]
    assert new is not None
    assert new.key == "k/4"
    writer.write("k/0", value("k/0", 1), None)  # replaced: a removal
    asked.clear()
    replaced, other = reader.rows_now(keys[:2])
    assert asked == [2]  # every row kept before is dropped
    assert replaced is not None
    assert replaced is not first[0]
    assert reader.read(keys[0]) == (value("k/0", 1), None)
    assert other is not None
    assert other is not first[1]
    assert other.key == "k/1"


def test_an_index_made_anew_is_not_taken_for_the_one_the_rows_came_from(
    tiers: tuple[DiskTier, DiskTier], asked: list[int], tmp_path: Path
) -> None:
    # Another release makes the index anew (dropping a table fires no trigger): its count
    # starts from 0 again, as the old one's was. Its token tells them apart.
    reader, writer = tiers
    keys = ["k/0", "k/1"]
    writer.write_many([(key, value(key, 0), None) for key in keys])
    assert read(reader, keys, "k/0") == value("k/0", 0)
    with sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None) as db:
        db.execute("BEGIN IMMEDIATE")
        _index.create_tables(db)
        db.execute("COMMIT")
    asked.clear()
    assert read(reader, keys, "k/0") is None  # not in the new index
    assert asked == [2]


def test_an_index_made_before_the_count_gets_one_on_open(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, SOURCE)
    tier.write("k/0", value("k/0", 0), None)
    tier.close()
    with sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None) as db:
        db.execute("DROP TRIGGER entries_removed")
        db.execute("DROP TABLE removals")
        assert not _index.has_removals(db)
    tier = DiskTier(tmp_path, 1 << 20, SOURCE)
    try:
        assert tier.read("k/0") == (value("k/0", 0), None)  # the entries stay
        first = _index.removals(tier._rdb)
        tier.remove("k/0")
        second = _index.removals(tier._rdb)
        assert first is not None
        assert second == (first[0], first[1] + 1)
    finally:
        tier.close()


def test_an_index_that_cannot_get_the_count_opens_and_keeps_no_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: list[int]
) -> None:
    # A full disk, or an index this process may read but not write: the release before
    # the count served it, so this one must too.
    tier = DiskTier(tmp_path, 1 << 20, SOURCE)
    tier.write_many([(key, value(key, 0), None) for key in ("k/0", "k/1")])
    tier.close()
    with sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None) as db:
        db.execute("DROP TRIGGER entries_removed")
        db.execute("DROP TABLE removals")

    def full(db: sqlite3.Connection) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(_index, "create_removals", full)
    tier = DiskTier(tmp_path, 1 << 20, SOURCE)
    try:
        keys = ["k/0", "k/1"]
        assert read(tier, keys, "k/0") == value("k/0", 0)
        assert read(tier, keys, "k/1") == value("k/1", 0)
        assert asked == [2, 2]  # no count to go by: every stretch asks
    finally:
        tier.close()


def _replace_in_child(directory: str, key: str) -> None:
    tier = DiskTier(directory, 1 << 20, SOURCE)
    try:
        tier.write(key, value(key, 1), None)
    finally:
        tier.close()


def test_another_process_replacing_an_entry_is_seen(tmp_path: Path) -> None:
    reader = DiskTier(tmp_path, 1 << 20, SOURCE)
    try:
        keys = ["k/0", "k/1"]
        reader.write_many([(key, value(key, 0), None) for key in keys])
        assert read(reader, keys, "k/0") == value("k/0", 0)
        child = multiprocessing.get_context("fork").Process(
            target=_replace_in_child, args=(str(tmp_path), "k/0")
        )
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert read(reader, keys, "k/0") == value("k/0", 1)
        row = reader.row_now("k/1")  # kept, and still true
        assert row is not None
        assert RowReader(reader).read(row) == value("k/1", 0)
    finally:
        reader.close()


@pytest.mark.anyio
async def test_a_warm_run_through_the_cache_asks_once_per_key_over_two_epochs(
    source: CountingStore, tmp_path: Path, asked: list[int]
) -> None:
    keys = [f"obj/{i:03d}" for i in range(20)]
    async with TieredCache(source, memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 22) as cache:
        await cache.warm(keys)
        await cache.flush()
        asked.clear()
        for _ in range(2):
            assert cache.get_ready(keys) == [bytes([i]) * (10 * KiB) for i in range(20)]
        assert asked == [20]
        assert cache.stats().disk.hits == 40


# Each step: what, and the key it writes or removes. The reader's reads must give each key's
# latest value or a miss, never an older one, whatever the writer did in between.
_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["write", "remove", "clear", "evict", "read", "row"]), st.integers(0, 2)
    ),
    min_size=4,
    max_size=30,
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=_STEPS)
def test_kept_rows_never_serve_an_older_value(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, int]]
) -> None:
    directory = tmp_path_factory.mktemp("kept")
    reader = DiskTier(directory, 256 * KiB, SOURCE)
    writer = DiskTier(directory, 256 * KiB, SOURCE)
    rows = RowReader(reader)
    keys = [f"k/{i}" for i in range(3)]
    latest: dict[str, int] = {}  # key -> the version the writer last wrote
    versions = 0
    try:
        for what, index in steps:
            key = keys[index]
            if what == "write":
                versions += 1
                latest[key] = versions
                writer.write(key, value(key, versions), None)
            elif what == "remove":
                writer.remove(key)
            elif what == "clear":
                writer.clear()
            elif what == "evict":
                writer.write("big", value("big", 0, 150 * KiB), None)
            if what in ("write", "remove", "clear", "evict"):
                # What the index holds now (a write may evict others, or not be kept).
                latest = {k: v for k, v in latest.items() if writer.locate(k) is not None}
            else:
                reader._absent_until = 0.0  # keys found absent are asked for again
                reader.expect(keys, 0, len(keys), ())
                for key in keys:  # every key, as a warm run reads its stretch
                    if what == "read":
                        hit = reader.read_cached(key)
                        bad = hit is None or isinstance(hit, _disk.WouldBlock)
                        got = None if bad else hit[0]  # type: ignore[index]
                    else:
                        row = reader.row_now(key)
                        got = None if row is None else rows.read(row)
                    if got is not None:
                        assert key in latest, f"{key} served after it was removed"
                        assert got == value(key, latest[key]), f"{key} served an older value"
                reader.expect(keys, 0, 0, ())
    finally:
        rows.close()
        reader.close()
        writer.close()
