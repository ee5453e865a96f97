"""Warm reads without a wait: runs of keys served in one call (``TieredCache.get_ready``),
and the disk tier's reads from the page cache through descriptors kept open."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

import asyncstore
from asyncstore.cache import Prefetcher, TieredCache
from asyncstore.cache._disk import DiskTier
from asyncstore.cache._segments import SegmentReader

from .conftest import CountingStore, KiB

pytestmark = pytest.mark.anyio

VALUE = bytes(range(200)) * 15


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_run_is_served_from_memory_then_from_disk_and_stops_at_a_fetch(
    source: CountingStore, tmp_path: Path
) -> None:
    keys = [f"obj/{i:03d}" for i in range(6)]
    async with TieredCache(
        source, memory_bytes=100 * KiB, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        for key in keys[:4]:
            await cache.get(key)
        await cache.flush()
    # A new cache over the same directory: nothing in memory, the first four on disk.
    async with TieredCache(
        source, memory_bytes=100 * KiB, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        await cache.get(keys[0])  # in memory now
        source.gets.clear()
        got = cache.get_ready(keys)
        assert got == [bytes([i]) * (10 * KiB) for i in range(4)]
        assert source.gets == []  # never the store
        stats = cache.stats()
        assert (stats.memory.hits, stats.disk.hits) == (1, 4)  # keys[0] twice from memory
        assert stats.memory.bytes_served == 10 * KiB
        # Promoted: the same run now comes from memory alone.
        assert cache.get_ready(keys, 1, 3) == got[1:3]
        assert cache.stats().memory.hits == 3
        assert cache.get_ready(keys, 4) == []  # keys[4] needs the store


async def test_a_run_stops_before_keys_that_are_no_object_s(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=1 << 20, block_bytes=4 * KiB) as cache:
        await cache.get("obj/000")
        await cache.get("obj/001", 0, 10)  # a block entry: "obj/001\x00..." in memory
        block = next(k for k in cache._memory.keys() if "\x00" in k)  # noqa: SIM118
        first = bytes(10 * KiB)
        assert cache.get_ready(["obj/000", block]) == [first]
        assert cache.get_ready(["obj/000", "../x"]) == [first]
        assert cache.get_ready(["obj/000", ["unhashable"]]) == [first]  # type: ignore[list-item]
        assert cache.get_ready([b"obj/000"]) == []  # type: ignore[list-item]
        assert cache.get_ready([block]) == []
        # One key at a time, a bad key is an error.
        with pytest.raises(asyncstore.InvalidKey):
            cache.get_nowait(block)


async def test_the_prefetcher_keeps_order_and_errors_over_warm_runs(
    source: CountingStore,
) -> None:
    plan = [f"obj/{i:03d}" for i in range(20)]
    async with TieredCache(source, memory_bytes=1 << 20, policy="plan") as cache:
        for key in plan[::3]:
            await cache.get(key)  # every third is warm: runs of one between fetches
        async with Prefetcher(cache, [*plan, "bad//key", "obj/000"]) as prefetcher:
            got = []
            with pytest.raises(asyncstore.InvalidKey):
                while items := await prefetcher.take(7):
                    got += items
        assert [key for key, _ in got] == plan  # in order, up to the bad key
        assert all(data == bytes([int(key[4:])]) * (10 * KiB) for key, data in got)


async def test_warm_runs_stay_within_max_bytes(source: CountingStore) -> None:
    plan = [f"obj/{i:03d}" for i in range(20)]
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        await cache.warm(plan)
        async with Prefetcher(cache, plan, lookahead=20, max_bytes=35 * KiB) as prefetcher:
            first = await prefetcher.take(1)
            assert len(first) == 1
            # The window was filled with warm items, bound by bytes: at most 4 of 10 KiB.
            assert prefetcher._ready_bytes <= 40 * KiB
            rest = [item async for item in prefetcher]
        assert [key for key, _ in first + rest] == plan


def test_descriptors_are_kept_within_a_bound_and_closed_with_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SegmentReader, "KEEP", 4)
    before = open_fds()
    value = VALUE * 4  # 12 KB: one entry per segment of 16 KiB (a 256 KiB budget's)
    tier = DiskTier(tmp_path, 256 * KiB, "memory://source")
    try:
        keys = [f"k/{i}" for i in range(SegmentReader.KEEP + 4)]
        for key in keys:
            assert tier.write(key, value, None)
        assert len({tier.locate(key)[0] for key in keys}) == len(keys)  # type: ignore[index]
        opened = open_fds()
        for _ in range(2):
            for key in keys:
                hit = tier.read_cached(key)
                assert isinstance(hit, tuple)
                assert hit[0] == value
        assert open_fds() - opened == SegmentReader.KEEP
    finally:
        tier.close()
    assert open_fds() == before


def test_an_entry_appended_after_its_segment_was_opened_is_read(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, "memory://source")
    try:
        assert tier.write("k/0", VALUE, None)
        assert tier.read_cached("k/0") == (VALUE, None)  # its segment's descriptor kept
        assert tier.write("k/1", VALUE[::-1], None)  # appended to the same segment
        assert tier.locate("k/1")[0] == tier.locate("k/0")[0]  # type: ignore[index]
        assert tier.read_cached("k/1") == (VALUE[::-1], None)
        # A row naming bytes past the segment's end is damage, kept descriptor or not.
        with sqlite3.connect(tmp_path / "index.sqlite") as db:
            db.execute("UPDATE entries SET size = size + 100")
        with pytest.raises(asyncstore.IntegrityError):
            tier.read_cached("k/1")
    finally:
        tier.close()


def test_a_descriptor_kept_from_before_the_index_was_made_anew_is_not_damage(
    tmp_path: Path,
) -> None:
    reader = DiskTier(tmp_path, 1 << 20, "memory://source")
    try:
        assert reader.write("k/old", VALUE, None)
        assert reader.read_cached("k/old") == (VALUE, None)  # segment 1's descriptor kept
        old = reader.locate("k/old")
        # Another process makes the index anew (another format): ids start again at 1.
        with sqlite3.connect(tmp_path / "index.sqlite") as db:
            db.execute("DELETE FROM entries")
            db.execute("DELETE FROM segments")
            db.execute("DELETE FROM sqlite_sequence")
        for name in os.listdir(tmp_path / "segments"):
            os.unlink(tmp_path / "segments" / name)
        writer = DiskTier(tmp_path, 1 << 20, "memory://source")
        try:
            assert writer.write("k/new", VALUE[::-1], None)
        finally:
            writer.close()
        # Same segment id, same offset, another file: the kept descriptor reads the old
        # record, which fails its checks; the read goes again through a fresh descriptor.
        new = reader.locate("k/new")
        assert old is not None
        assert new is not None
        assert (new[1], new[2]) == (old[1], old[2])
        assert new[0].endswith("/1.seg")
        assert reader.read_cached("k/new") == (VALUE[::-1], None)
        assert reader.read("k/new") == (VALUE[::-1], None)  # not dropped as damaged
    finally:
        reader.close()


async def test_a_run_of_disk_hits_asks_the_index_once_a_stretch(
    source: CountingStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstore.cache import _index

    keys = [f"obj/{i:03d}" for i in range(20)]
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 22
    ) as c:
        await c.warm(keys[:10] + keys[11:])  # keys[10] only in the store
        await c.flush()
    queries: list[str] = []
    find, find_many = _index.find, _index.find_many

    def one(*args: object) -> object:
        queries.append("one")
        return find(*args)  # type: ignore[arg-type]

    def many(db: object, names: list[str], *args: object) -> object:
        queries.append(f"many {len(names)}")
        return find_many(db, names, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_index, "find", one)
    monkeypatch.setattr(_index, "find_many", many)
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 22
    ) as cache:
        await cache.get(keys[3])  # in memory: not asked for
        queries.clear()
        got = cache.get_ready(keys)
        assert got == [bytes([i]) * (10 * KiB) for i in range(10)]  # up to the one not cached
        assert queries == ["many 19"]
        assert cache.stats().disk.hits == 10  # keys[3] came from disk too, first
        # The rows were for that call only: a later read asks the index again.
        queries.clear()
        assert await cache.get(keys[15]) == bytes([15]) * (10 * KiB)
        assert queries == ["one"]


async def test_keys_found_absent_are_not_asked_again_until_written_or_a_while_passes(
    source: CountingStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cold epoch: the prefetcher looks ahead over the same uncached keys at every fill.
    from asyncstore.cache import _disk, _index

    keys = [f"obj/{i:03d}" for i in range(20)]
    asked: list[int] = []
    find_many = _index.find_many

    def many(db: object, names: list[str], *args: object) -> object:
        asked.append(len(names))
        return find_many(db, names, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_index, "find_many", many)
    options: dict[str, object] = {"disk_dir": tmp_path, "disk_bytes": 1 << 22}
    async with TieredCache(source, memory_bytes=1 << 20, **options) as cache:  # type: ignore[arg-type]
        assert cache.get_ready(keys) == []
        assert cache.get_ready(keys, 1) == []
        assert cache.get_ready(keys, 2) == []
        assert asked == [20]  # the later calls knew their keys absent
        # Written by this process: asked again, found.
        async with TieredCache(source, memory_bytes=1, **options) as other:  # type: ignore[arg-type]
            await other.warm(keys[5:8])
            await other.flush()
        assert cache.get_ready(keys, 5) == []  # another cache's writes: not seen yet
        assert asked == [20]
        monkeypatch.setattr(_disk, "_ABSENT_SECONDS", 0.0)  # once a while has passed
        cache._disk._absent_until = 0.0  # type: ignore[union-attr]
        assert cache.get_ready(keys, 5) == [bytes([i]) * (10 * KiB) for i in (5, 6, 7)]
        assert asked[1:] == [15]
        monkeypatch.setattr(_disk, "_ABSENT_SECONDS", 3600.0)
        asked.clear()
        assert cache.get_ready(keys, 8) == []  # keys 8-19: none cached, all noted absent
        assert asked == [12]
        await cache.get(keys[9])  # fetched, and written to disk by this cache
        await cache.flush()
        cache._memory.clear()
        assert cache.get_ready(keys, 8) == []  # keys[8] is still not cached
        assert asked == [12, 1]  # keys[9] is asked for again; the rest are known absent
        assert cache.get_ready(keys, 9) == [bytes([9]) * (10 * KiB)]


async def test_a_damaged_row_in_a_stretch_stops_the_run_there(
    source: CountingStore, tmp_path: Path
) -> None:
    keys = [f"obj/{i:03d}" for i in range(6)]
    options: dict[str, object] = {"disk_dir": tmp_path, "disk_bytes": 1 << 22}
    async with TieredCache(source, memory_bytes=1 << 20, **options) as cache:  # type: ignore[arg-type]
        await cache.warm(keys)
        await cache.flush()
        name = cache._disk.name_for(keys[2])  # type: ignore[union-attr]
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.execute("UPDATE entries SET size = -1 WHERE name = ?", (name,))
    async with TieredCache(source, memory_bytes=1 << 20, **options) as cache:  # type: ignore[arg-type]
        assert cache.get_ready(keys) == [bytes([0]) * (10 * KiB), bytes([1]) * (10 * KiB)]
        source.gets.clear()
        assert await cache.get(keys[2]) == bytes([2]) * (10 * KiB)  # refetched
        assert source.gets == [(keys[2], 0, None)]
        assert cache.stats().disk.corrupt == 1


def test_descriptors_of_deleted_segments_do_not_hold_their_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An open descriptor keeps a deleted file's blocks taken: a kept one of an evicted
    # segment would let the tier's files outgrow its budget unseen.
    monkeypatch.setattr(SegmentReader, "SWEEP", 8)
    value = VALUE * 4  # one entry per 16 KiB segment
    tier = DiskTier(tmp_path, 256 * KiB, "memory://source")
    try:
        for i in range(4):
            assert tier.write(f"k/{i}", value, None)
            assert tier.read_cached(f"k/{i}") == (value, None)
        gone = [tier.locate(f"k/{i}")[0] for i in range(3)]  # type: ignore[index]
        for path in gone:
            os.unlink(path)  # as another process's eviction does
        assert len(deleted_open(tmp_path)) == 3
        for _ in range(8):
            assert tier.read_cached("k/3") == (value, None)
        assert deleted_open(tmp_path) == []
    finally:
        tier.close()


def deleted_open(directory: Path) -> list[str]:
    """This process's open descriptors on deleted files under ``directory``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith("(deleted)"):
            found.append(target)
    return found
