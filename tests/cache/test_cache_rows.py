"""Warm disk-tier hits read on the consumer's thread: ``TieredCache.get_ready_rows`` hands
on where each entry lies, a ``RowReader`` reads and checks it on another thread, and
``settle`` counts it and promotes its bytes; a row that cannot be read so is got the regular
way, which drops a damaged entry and fetches it again."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncstore import InvalidArgument
from asyncstore.cache import DiskRow, RowPrefetcher, RowReader, TieredCache
from asyncstore.cache._disk import DiskTier
from asyncstore.cache._record import HEADER
from asyncstore.cache._segments import SegmentReader

from .conftest import CountingStore, KiB

pytestmark = pytest.mark.anyio

KEYS = [f"obj/{i:03d}" for i in range(6)]


def value(i: int) -> bytes:
    return bytes([i]) * (10 * KiB)  # what CountingStore serves for obj/00i


async def warm(source: CountingStore, directory: Path, keys: list[str] = KEYS) -> None:
    """Put ``keys`` in the disk tier of ``directory``, through a cache that is then closed."""
    async with TieredCache(
        source, memory_bytes=100 * KiB, disk_dir=directory, disk_bytes=1 << 20
    ) as cache:
        for key in keys:
            await cache.get(key)
        await cache.flush()


def cold_cache(source: CountingStore, directory: Path) -> TieredCache:
    """A new cache over ``directory``: nothing in memory, KEYS on disk."""
    return TieredCache(source, memory_bytes=100 * KiB, disk_dir=directory, disk_bytes=1 << 20)


async def read_rows(cache: TieredCache, rows: list[DiskRow]) -> list[bytes | None]:
    """``rows`` read on another thread, as a consumer's, through a reader closed after."""
    reader = cache.row_reader()
    assert reader is not None
    try:
        return await anyio.to_thread.run_sync(lambda: [reader.read(row) for row in rows])
    finally:
        reader.close()


@contextlib.asynccontextmanager
async def warm_rows(
    source: CountingStore, directory: Path, keys: list[str] = KEYS
) -> AsyncIterator[tuple[TieredCache, list[DiskRow], RowReader]]:
    """``keys`` warmed into the disk tier of ``directory``; a new cache over it, every key's
    row (none in memory), and a reader for them, closed afterwards."""
    await warm(source, directory, keys)
    async with cold_cache(source, directory) as cache:
        found = cache.get_ready_rows(keys)
        rows = [row for row in found if isinstance(row, DiskRow)]
        assert len(rows) == len(keys)
        reader = cache.row_reader()
        assert reader is not None
        try:
            yield cache, rows, reader
        finally:
            reader.close()


async def test_rows_read_elsewhere_are_counted_and_promoted_once_settled(
    source: CountingStore, tmp_path: Path
) -> None:
    await warm(source, tmp_path)
    async with cold_cache(source, tmp_path) as cache:
        await cache.get(KEYS[0])  # in memory: bytes, not a row
        source.gets.clear()
        before = cache.stats()
        got = cache.get_ready_rows(KEYS)
        assert got[0] == value(0)
        rows = got[1:]
        assert all(isinstance(row, DiskRow) for row in rows)
        assert [row.key for row in rows] == KEYS[1:]  # type: ignore[union-attr]
        assert all(len(row) > 10 * KiB for row in rows)  # the record: payload and header
        # Neither counted nor promoted until settled.
        assert cache.stats().disk.hits == before.disk.hits
        assert cache.get_ready(KEYS, 1, 2) == [value(1)]  # the regular way reads it
        assert cache.stats().disk.hits == before.disk.hits + 1

        reader = cache.row_reader()
        assert reader is not None

        def read_all() -> list[bytes | None]:
            return [reader.read(row) for row in rows]  # type: ignore[arg-type]

        read = await anyio.to_thread.run_sync(read_all)  # another thread, as a consumer's
        assert read == [value(i) for i in range(1, 6)]
        assert reader.cold == 0
        cache.settle([(row, data) for row, data in zip(rows, read, strict=True)])  # type: ignore[misc]
        stats = cache.stats()
        assert stats.disk.hits == before.disk.hits + 1 + 5
        assert stats.disk.bytes_served - before.disk.bytes_served == 6 * 10 * KiB
        # Promoted: the whole run is now in memory, as bytes.
        hits = stats.memory.hits
        assert cache.get_ready_rows(KEYS) == [value(i) for i in range(6)]
        assert cache.stats().memory.hits == hits + 6
        assert source.gets == []  # never the store
        reader.close()


async def test_a_row_whose_segment_is_gone_is_not_read(
    source: CountingStore, tmp_path: Path
) -> None:
    async with warm_rows(source, tmp_path) as (_, rows, reader):
        segments = list((tmp_path / "segments").glob("*.seg"))
        assert segments
        for segment in segments:
            segment.unlink()  # evicted since the rows were found
        assert [reader.read(row) for row in rows] == [None] * 6
        assert reader.cold == 0


def flip(cache: TieredCache, row: DiskRow, at: int, mask: int) -> None:
    """Flip the bits ``mask`` of the byte ``at`` of ``row``'s record, in its segment file."""
    path = Path(cache._disk.segment_path(row.segment))  # type: ignore[union-attr]
    with path.open("r+b") as f:
        f.seek(row.offset + at)
        old = f.read(1)
        f.seek(row.offset + at)
        f.write(bytes([old[0] ^ mask]))


async def test_a_row_not_in_the_page_cache_is_counted_cold(
    source: CountingStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.preadv

    def cold(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError("not in the page cache")
        return real(fd, buffers, offset, flags)

    async with warm_rows(source, tmp_path) as (_, rows, reader):
        monkeypatch.setattr(os, "preadv", cold)
        assert reader.read(rows[0]) is None
        assert reader.cold == 1
        monkeypatch.setattr(os, "preadv", real)
        assert reader.read(rows[0]) == value(0)


@contextlib.asynccontextmanager
async def row_prefetcher(source: CountingStore, directory: Path) -> AsyncIterator[RowPrefetcher]:
    """A RowPrefetcher over KEYS, warm on the disk tier of ``directory`` (none in memory)."""
    await warm(source, directory)
    async with (
        cold_cache(source, directory) as cache,
        RowPrefetcher(cache, KEYS, lookahead=2) as prefetcher,
    ):
        yield prefetcher


async def test_a_row_prefetcher_hands_on_rows_until_told_not_to(
    source: CountingStore, tmp_path: Path
) -> None:
    async with row_prefetcher(source, tmp_path) as prefetcher:
        first = await prefetcher.take_rows(2, least=2)
        assert [key for key, _ in first] == KEYS[:2]
        assert all(isinstance(item, DiskRow) for _, item in first)
        prefetcher.rows = False
        rest = await prefetcher.take_rows(4, least=4)
        # Rows already in its window may still come; every later one is bytes.
        assert [key for key, _ in rest] == KEYS[2:]
        assert isinstance(rest[-1][1], bytes)
        assert rest[-1][1] == value(5)


async def test_a_row_prefetcher_takes_rows_without_awaiting_and_refuses_plain_takes(
    source: CountingStore, tmp_path: Path
) -> None:
    async with row_prefetcher(source, tmp_path) as prefetcher:
        got = prefetcher.take_rows_nowait(len(KEYS))
        assert [key for key, _ in got] == KEYS
        assert all(isinstance(item, DiskRow) for _, item in got)
        with pytest.raises(TypeError, match="take_rows_nowait"):
            prefetcher.take_nowait(1)
        with pytest.raises(TypeError, match="take_rows"):
            await prefetcher.take(1)


@pytest.mark.parametrize("forget", ["invalidate", "clear"])
async def test_bytes_of_a_key_forgotten_since_its_row_was_found_are_not_kept(
    source: CountingStore, tmp_path: Path, forget: str
) -> None:
    async with warm_rows(source, tmp_path) as (cache, rows, reader):
        old = reader.read(rows[1])  # read on the consumer's thread; then, on the loop:
        assert old == value(1)
        await source.put(KEYS[1], b"new")
        if forget == "invalidate":
            await cache.invalidate(KEYS[1])
        else:
            await cache.clear()
        cache.settle([(rows[1], old)])
        source.gets.clear()
        assert await cache.get(KEYS[1]) == b"new"  # not the old bytes, kept after all
        assert [key for key, _, _ in source.gets] == [KEYS[1]]


@pytest.mark.parametrize("forget", ["invalidate", "clear"])
@pytest.mark.parametrize("found_before", [False, True], ids=["found then", "found again then"])
async def test_bytes_of_a_row_found_while_its_key_is_forgotten_are_not_kept(
    source: CountingStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    forget: str,
    found_before: bool,
) -> None:
    # The disk tier's part of the forgetting is held until the row is found: a row found
    # then points at the old entry, although the forgetting began before. Found before it
    # began too, the row is the same object the disk tier kept from then.
    entered, release = threading.Event(), threading.Event()
    method = "remove" if forget == "invalidate" else "clear"
    original = getattr(DiskTier, method)

    def held(self: DiskTier, *args: Any) -> None:
        entered.set()
        release.wait(10)
        original(self, *args)

    monkeypatch.setattr(DiskTier, method, held)
    await warm(source, tmp_path)
    async with cold_cache(source, tmp_path) as cache:
        before = cache.get_ready_rows(KEYS[1:2]) if found_before else None
        await source.put(KEYS[1], b"new")
        async with anyio.create_task_group() as tg:
            if forget == "invalidate":
                tg.start_soon(cache.invalidate, KEYS[1])
            else:
                tg.start_soon(cache.clear)
            assert await anyio.to_thread.run_sync(entered.wait, 10)
            (row,) = cache.get_ready_rows(KEYS[1:2])
            assert isinstance(row, DiskRow)
            (old,) = await read_rows(cache, [row])
            release.set()
        assert isinstance(row, DiskRow)  # (narrowed again: the task group may swallow)
        if before is not None:
            assert before == [row]  # the very row found then: the disk tier kept it
        assert old == value(1)
        cache.settle([(row, old)])
        source.gets.clear()
        assert await cache.get(KEYS[1]) == b"new"  # not the old bytes, kept after all
        assert [key for key, _, _ in source.gets] == [KEYS[1]]


async def test_bytes_of_a_key_forgotten_before_its_row_was_found_are_kept(
    source: CountingStore, tmp_path: Path
) -> None:
    # Forgotten, then fetched anew and found as a row: its bytes are the current ones.
    await warm(source, tmp_path)
    async with TieredCache(
        source, memory_bytes=15 * KiB, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        await cache.invalidate(KEYS[1])
        assert await cache.get(KEYS[1]) == value(1)  # fetched anew, then written to disk
        await cache.flush()
        assert await cache.get(KEYS[2]) == value(2)  # the memory tier's one entry now
        (row,) = cache.get_ready_rows(KEYS[1:2])
        assert isinstance(row, DiskRow)
        (data,) = await read_rows(cache, [row])
        assert data == value(1)
        cache.settle([(row, data)])
        hits = cache.stats().memory.hits
        assert cache.get_ready_rows(KEYS[1:2]) == [value(1)]  # promoted: bytes, not a row
        assert cache.stats().memory.hits == hits + 1


async def test_a_forked_child_closes_the_readers_descriptors(
    source: CountingStore, tmp_path: Path
) -> None:
    async with warm_rows(source, tmp_path) as (_, rows, reader):
        assert reader.read(rows[0]) == value(0)
        assert reader._reader._open  # a segment's descriptor kept
        pid = os.fork()
        if pid == 0:  # the child: an evicted segment's space must not stay held here
            os._exit(0 if not reader._reader._open else 1)
        _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert reader._reader._open  # the parent's are untouched


BIG = [f"big/{i}" for i in range(4)]


def big_value(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(256)) * 256  # 64 KiB: past SPLIT_FROM


@contextlib.asynccontextmanager
async def big_rows(
    source: CountingStore, directory: Path
) -> AsyncIterator[tuple[TieredCache, list[DiskRow], RowReader]]:
    """BIG, of 64 KiB each, warmed as warm_rows does."""
    for i, key in enumerate(BIG):
        await source.put(key, big_value(i))
    async with warm_rows(source, directory, BIG) as warmed:
        yield warmed


async def test_large_records_are_read_in_two_parts_straight_into_their_bytes(
    source: CountingStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first record is read whole (its ETag's length unknown), the next ones in two parts:
    # the payload comes in the bytes object that os.pread made, with no copy after it.
    calls: list[str] = []
    read, read_parts = SegmentReader.read, SegmentReader.read_parts
    payloads: list[bytes] = []
    real_pread = os.pread

    def spy_pread(fd: int, size: int, offset: int) -> bytes:
        payloads.append(real_pread(fd, size, offset))
        return payloads[-1]

    def spy_read(self: SegmentReader, *args: Any) -> Any:
        calls.append("whole")
        return read(self, *args)

    def spy_parts(self: SegmentReader, *args: Any) -> Any:
        calls.append("parts")
        return read_parts(self, *args)

    monkeypatch.setattr(SegmentReader, "read", spy_read)
    monkeypatch.setattr(SegmentReader, "read_parts", spy_parts)
    monkeypatch.setattr(os, "pread", spy_pread)
    async with big_rows(source, tmp_path) as (cache, rows, reader):
        got = [reader.read(row) for row in rows]
        assert got == [big_value(i) for i in range(len(BIG))]
        assert calls == ["whole"] + ["parts"] * (len(BIG) - 1)
        assert all(a is b for a, b in zip(got[1:], payloads, strict=True))
        reader._etag_len = 3  # an ETag of another length than the record's: read whole,
        calls.clear()
        preads = len(payloads)
        assert reader.read(rows[0]) == big_value(0)
        assert calls == ["parts", "whole"]
        assert len(payloads) == preads  # its payload read once, not first in part
        cache.settle(list(zip(rows, got, strict=True)))  # type: ignore[arg-type]
        assert cache.stats().disk.hits == len(BIG)


@pytest.mark.parametrize(
    "case", ["small record", "large record, payload", "large record, ETag length"]
)
async def test_a_damaged_record_is_not_read_and_the_regular_way_refetches_it(
    source: CountingStore, tmp_path: Path, case: str
) -> None:
    # A large record is read in two parts once the reader knows its ETags' length (after
    # the first read): damage is caught there too, in the payload or in the header's ETag
    # length (the header's last field: the payload would start elsewhere than expected).
    large = case.startswith("large")
    keys, of = (BIG, big_value) if large else (KEYS, value)
    async with (big_rows if large else warm_rows)(source, tmp_path) as (cache, rows, reader):
        assert reader.read(rows[0]) == of(0)
        row = rows[1]
        flip(cache, row, HEADER.size - 4 if case.endswith("ETag length") else row.size - 1, 1)
        assert reader.read(row) is None
        assert reader.read(rows[2]) == of(2)  # its neighbours read as before
        source.gets.clear()
        assert await cache.get(keys[1]) == of(1)
        assert [key for key, _, _ in source.gets] == [keys[1]]  # fetched again
        assert cache.stats().disk.corrupt == 1


async def test_a_run_of_rows_stops_before_the_first_key_not_ready(
    source: CountingStore, tmp_path: Path
) -> None:
    # The run's memory hits and disk rows in the keys' order, up to a key that is neither:
    # one not cached, one being fetched, one that is no key at all, a block's key.
    await warm(source, tmp_path)
    async with cold_cache(source, tmp_path) as cache:
        await cache.get(KEYS[2])  # in memory; the rest of KEYS on disk only
        for stop in ("obj/019", "bad//key", "obj/000\x00size.1", 7):
            before = cache.stats()
            got = cache.get_ready_rows([*KEYS[:4], stop, KEYS[4]])  # type: ignore[list-item]
            assert got[2] == value(2)
            rows = [got[i] for i in (0, 1, 3)]
            assert [row.key for row in rows] == [KEYS[0], KEYS[1], KEYS[3]]  # type: ignore[union-attr]
            assert len(got) == 4, stop
            stats = cache.stats()
            assert stats.memory.hits - before.memory.hits == 1
            assert stats.memory.bytes_served - before.memory.bytes_served == 10 * KiB
            assert stats.disk.hits == before.disk.hits  # rows count once settled
        source.delay = 0.5
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.get, "obj/018")
            await anyio.sleep(0.05)  # the fetch has begun
            assert len(cache.get_ready_rows([KEYS[0], "obj/018", KEYS[1]])) == 1
        assert cache.get_ready_rows(["obj/018", KEYS[0]])[0] == bytes([18]) * (10 * KiB)


async def test_a_window_longer_than_one_lookup_comes_whole(
    source: CountingStore, tmp_path: Path
) -> None:
    # Rows are looked up a stretch of keys at a time; a window of several stretches, with
    # repeats and memory hits among them, comes whole and in order.
    await warm(source, tmp_path)
    async with cold_cache(source, tmp_path) as cache:
        await cache.get(KEYS[5])
        keys = [KEYS[i % 6] for i in range(700)]
        got = cache.get_ready_rows(keys)
        assert len(got) == 700
        for key, found in zip(keys, got, strict=True):
            if key == KEYS[5]:
                assert found == value(5)
            else:
                assert isinstance(found, DiskRow)
                assert found.key == key
        read = await read_rows(cache, [row for row in got[:12] if isinstance(row, DiskRow)])
        assert read == [value(i % 6) for i in range(12) if i % 6 != 5]


@pytest.mark.parametrize(
    ("start", "stop"), [(-3, None), (-300, None), (1.5, None), (0, "5"), (True, None)]
)
async def test_a_window_given_by_positions_that_are_not_positions_is_refused(
    source: CountingStore, tmp_path: Path, start: object, stop: object
) -> None:
    await warm(source, tmp_path)
    async with cold_cache(source, tmp_path) as cache:
        for ready in (cache.get_ready, cache.get_ready_rows):
            with pytest.raises(InvalidArgument, match=r"start=.*stop=.*int >= 0"):
                ready(KEYS, start, stop)  # type: ignore[arg-type]
        assert len(cache.get_ready_rows(KEYS, 4, 100)) == 2  # past the end: up to it


async def test_a_key_that_cannot_be_encoded_ends_a_run_and_raises_nothing(
    source: CountingStore, tmp_path: Path
) -> None:
    # A lone surrogate is no key: the run stops before it wherever it falls, in the first
    # stretch of lookups or a later one, for get_ready and get_ready_rows alike.
    await warm(source, tmp_path)
    async with cold_cache(source, tmp_path) as cache:
        await cache.get(KEYS[0])
        for at in (1, 5, 63, 64, 70, 130):
            keys = [KEYS[i % 6] for i in range(at)] + ["obj/\ud800", KEYS[1]]
            assert len(cache.get_ready_rows(keys)) == at
            assert len(cache.get_ready(keys)) == at
            with pytest.raises(InvalidArgument):
                await cache.get("obj/\ud800")
