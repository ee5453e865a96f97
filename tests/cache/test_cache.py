"""TieredCache: read-through, single flight, self-healing disk tier, consistency."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncstore
from asyncstore import InvalidArgument, NotFound
from asyncstore.cache import TieredCache
from asyncstore.cache._disk import DiskTier
from asyncstore.cache._warm import RANGE_WINDOW
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .conftest import CountingStore

pytestmark = pytest.mark.anyio

KiB = 1 << 10


async def test_read_through_and_promotion(source: CountingStore, tmp_path: Path) -> None:
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        assert await cache.get("obj/001") == bytes([1]) * 10 * KiB
        assert len(source.gets) == 1
        assert await cache.get("obj/001") == bytes([1]) * 10 * KiB
        assert len(source.gets) == 1  # from memory
        stats = cache.stats()
        assert stats.memory.hits == 1
        assert stats.memory.misses == 1
        assert stats.disk.misses == 1
        assert stats.store.fetches == 1
        assert stats.hit_rate == 0.5
    # A new cache on the same directory: memory is cold, disk is warm.
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        assert await cache.get("obj/001") == bytes([1]) * 10 * KiB
        assert len(source.gets) == 1
        assert cache.stats().disk.hits == 1
        await cache.get("obj/001")
        assert cache.stats().memory.hits == 1  # promoted


async def test_memory_only(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=25 * KiB) as cache:
        for i in range(3):
            await cache.get(f"obj/{i:03d}")
        assert cache.stats().memory.evictions == 1
        await cache.get("obj/000")  # evicted: fetched again
        assert len(source.gets) == 4


async def test_single_flight(source: CountingStore) -> None:
    source.delay = 0.05
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        results = await asyncio.gather(*(cache.get("obj/005") for _ in range(100)))
    assert all(r == bytes([5]) * 10 * KiB for r in results)
    assert len(source.gets) == 1


async def test_cancelled_waiter_does_not_cancel_the_fetch(source: CountingStore) -> None:
    source.delay = 0.2
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        impatient = asyncio.ensure_future(cache.get("obj/007"))
        patient = asyncio.ensure_future(cache.get("obj/007"))
        await asyncio.sleep(0.05)
        impatient.cancel()
        assert await patient == bytes([7]) * 10 * KiB
        with pytest.raises(asyncio.CancelledError):
            await impatient
    assert len(source.gets) == 1


async def test_errors_reach_every_waiter_and_are_not_cached(source: CountingStore) -> None:
    source.delay = 0.05
    source.fail = asyncstore.StoreUnavailable("the store is down")
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        results = await asyncio.gather(
            *(cache.get("obj/002") for _ in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, asyncstore.StoreUnavailable) for r in results)
        assert len(source.gets) == 1
        source.fail = None
        assert await cache.get("obj/002") == bytes([2]) * 10 * KiB
        assert len(source.gets) == 2
        with pytest.raises(NotFound):
            await cache.get("obj/missing")


async def test_ranges_are_served_from_blocks(source: CountingStore) -> None:
    data = os.urandom(100 * KiB)
    await source.put("big", data)
    async with TieredCache(source, memory_bytes=1 << 20, block_bytes=16 * KiB) as cache:
        assert await cache.get("big", 20 * KiB, 40 * KiB) == data[20 * KiB : 40 * KiB]
        assert sorted(source.gets) == [("big", 16 * KiB, 32 * KiB), ("big", 32 * KiB, 48 * KiB)]
        assert await cache.get("big", 17 * KiB, 33 * KiB) == data[17 * KiB : 33 * KiB]
        assert len(source.gets) == 2  # both blocks cached
        assert await cache.get("big", 90 * KiB) == data[90 * KiB :]
        assert await cache.get("big", 99 * KiB, 200 * KiB) == data[99 * KiB :]
        assert await cache.get("big", 5, 5) == b""


async def test_corrupt_disk_entries_are_dropped_and_refetched(
    source: CountingStore, tmp_path: Path
) -> None:
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        await cache.get("obj/003")
        await cache.get("obj/004")
    tier = DiskTier(tmp_path, 1 << 20, source.identity)
    found3, found4 = tier.locate("obj/003"), tier.locate("obj/004")
    tier.close()
    assert found3 is not None
    assert found4 is not None
    path3, offset3, size3 = found3
    with open(path3, "r+b") as f:  # one flipped bit in the payload
        f.seek(offset3 + size3 - 100)
        flipped = f.read(1)[0] ^ 0x01
        f.seek(offset3 + size3 - 100)
        f.write(bytes([flipped]))
    path4, offset4, size4 = found4
    assert os.path.getsize(path4) == offset4 + size4  # the last record of its segment
    os.truncate(path4, offset4 + size4 - 10)  # truncated
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        assert await cache.get("obj/003") == bytes([3]) * 10 * KiB
        assert await cache.get("obj/004") == bytes([4]) * 10 * KiB
        assert cache.stats().disk.corrupt == 2
        assert cache.stats().disk.enabled
    assert len(source.gets) == 4  # two first reads, two refetches


async def test_unusable_disk_tier_switches_off(source: CountingStore, tmp_path: Path) -> None:
    # A directory that passes the construction-time check but whose index cannot open:
    # a directory stands where the index database would be.
    directory = tmp_path / "cache"
    (directory / "index.sqlite").mkdir(parents=True)
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=directory, disk_bytes=1 << 20
    ) as cache:
        assert await cache.get("obj/001") == bytes([1]) * 10 * KiB
        stats = cache.stats()
        assert not stats.disk.enabled
        assert stats.disk.errors == 1


async def test_disk_tier_vanishing_mid_run(source: CountingStore, tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    async with TieredCache(
        source, memory_bytes=15 * KiB, disk_dir=directory, disk_bytes=1 << 20
    ) as cache:
        await cache.get("obj/001")
        subprocess.run(["rm", "-rf", str(directory)], check=True)
        directory.write_bytes(b"")  # a file where the directory was: nothing can be written
        for i in range(10):
            assert await cache.get(f"obj/{i:03d}") == bytes([i]) * 10 * KiB
        # Writes go in batches, a little after the reads: the failed one switches it off.
        with anyio.fail_after(10):
            while cache.stats().disk.enabled:  # noqa: ASYNC110 (a counter, not an event)
                await asyncio.sleep(0.01)
        assert cache.stats().disk.errors >= 1


async def test_full_disk_tier_stays_within_budget(source: CountingStore, tmp_path: Path) -> None:
    budget = 120 * KiB
    async with TieredCache(source, memory_bytes=1, disk_dir=tmp_path, disk_bytes=budget) as cache:
        for i in range(20):
            await cache.get(f"obj/{i:03d}")
    tier = DiskTier(tmp_path, budget, source.identity)
    try:
        assert tier.used_bytes() <= budget
        assert 0 < tier.entry_count() < 20
        files = list((tmp_path / "segments").iterdir())
        on_disk = sum(f.stat().st_size for f in files)
        assert on_disk + tier._db_bytes() == tier.used_bytes()  # every byte accounted for
        assert on_disk + tier._db_bytes() <= budget
    finally:
        tier.close()


async def test_pins_survive_recency(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=35 * KiB) as cache:
        cache.pin(["obj/000"])
        await cache.get("obj/000")
        for i in range(1, 10):
            await cache.get(f"obj/{i:03d}")
        before = len(source.gets)
        await cache.get("obj/000")
        assert len(source.gets) == before
        cache.unpin(["obj/000"])
        for i in range(1, 10):
            await cache.get(f"obj/{i:03d}")
        await cache.get("obj/000")
        assert len(source.gets) > before + 9


async def test_invalidate_and_clear(source: CountingStore, tmp_path: Path) -> None:
    async with TieredCache(
        source, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20
    ) as cache:
        await cache.get("obj/001")
        await source.put("obj/001", b"new")
        assert await cache.get("obj/001") == bytes([1]) * 10 * KiB  # validate="none" trusts it
        await cache.invalidate("obj/001")
        assert await cache.get("obj/001") == b"new"
        await cache.clear()
        await cache.get("obj/001")
        assert len(source.gets) == 3


async def test_invalidate_drops_cached_blocks_on_disk(
    source: CountingStore, tmp_path: Path
) -> None:
    await source.put("big", b"a" * 64 * KiB)
    async with TieredCache(
        source, memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20, block_bytes=16 * KiB
    ) as cache:
        assert await cache.get("big", 0, 40 * KiB) == b"a" * 40 * KiB
    await source.put("big", b"b" * 64 * KiB)
    async with TieredCache(
        source, memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20, block_bytes=16 * KiB
    ) as cache:
        assert await cache.get("big", 0, 40 * KiB) == b"a" * 40 * KiB  # trusted: validate="none"
        await cache.invalidate("big")
        assert await cache.get("big", 0, 40 * KiB) == b"b" * 40 * KiB


async def test_flush_puts_fetched_entries_where_other_processes_find_them(
    source: CountingStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batches wait for more entries before they are written; make the wait long, so an entry
    # reaches the shared disk tier only through flush() (or close) within this test.
    monkeypatch.setattr("asyncstore.cache._writes.WRITE_DELAY", 30.0)
    options: dict[str, Any] = {"memory_bytes": 1 << 20, "disk_dir": tmp_path, "disk_bytes": 1 << 20}
    async with TieredCache(source, **options) as first, TieredCache(source, **options) as other:
        with anyio.fail_after(10):  # nothing queued: at once
            await first.flush()
        await first.get("obj/001")
        await other.get("obj/001")  # still on its way to disk: a second fetch
        assert [key for key, *_ in source.gets] == ["obj/001", "obj/001"]
        await first.get("obj/002")
        await other.flush()  # its own queue: obj/001 again, found on disk
        with anyio.fail_after(10):  # well inside the 30 s a batch would otherwise wait
            await first.flush()
        assert await other.get("obj/002") == bytes([2]) * 10 * KiB
        assert [key for key, *_ in source.gets] == ["obj/001", "obj/001", "obj/002"]
        assert other.stats().disk.hits == 1


async def test_warm(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        assert await cache.warm(f"obj/{i:03d}" for i in range(10)) == 10
        assert len(source.gets) == 10
        await cache.get("obj/009")
        assert len(source.gets) == 10


async def test_etag_validation_in_memory_store(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=1 << 20, validate="etag", ttl=0) as cache:
        assert await cache.get("obj/001") == bytes([1]) * 10 * KiB
        await source.put("obj/001", b"changed")
        assert await cache.get("obj/001") == b"changed"
        assert cache.stats().store.revalidations >= 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"memory_bytes": 0}, "memory_bytes=0"),
        ({"memory_bytes": 10, "disk_dir": "/tmp/x"}, "needs disk_bytes"),
        ({"memory_bytes": 10, "disk_bytes": 10}, "without disk_dir"),
        ({"memory_bytes": 10, "policy": "fifo"}, "policy='fifo'"),
        ({"memory_bytes": 10, "validate": "always"}, "validate='always'"),
        ({"memory_bytes": 10, "block_bytes": -1}, "block_bytes=-1"),
    ],
)
async def test_bad_arguments(source: CountingStore, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        TieredCache(source, **kwargs)  # type: ignore[arg-type]


async def test_not_a_store() -> None:
    with pytest.raises(InvalidArgument, match="not an asyncstore store"):
        TieredCache("s3://bucket", memory_bytes=10)  # type: ignore[arg-type]


async def test_restart_in_a_new_process_finds_the_disk_tier_warm(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    cache_dir = tmp_path / "cache"
    async with asyncstore.open_store(store_dir) as store:
        await store.put("a", b"payload-a")
    script = f"""
import asyncio, asyncstore
from asyncstore.cache import TieredCache
async def main():
    async with asyncstore.open_store({str(store_dir)!r}) as store, TieredCache(
        store, memory_bytes=1 << 20, disk_dir={str(cache_dir)!r}, disk_bytes=1 << 20
    ) as cache:
        assert await cache.get("a") == b"payload-a"
        s = cache.stats()
        print(s.disk.hits, s.store.fetches)
asyncio.run(main())
"""
    outputs = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
        for _ in range(2)
    ]
    assert outputs == [["0", "1"], ["1", "0"]]


async def test_etag_revalidation_sees_an_overwrite_in_seaweedfs(seaweedfs: SeaweedFS) -> None:
    url = f"s3://{BUCKET}/{unique()}"
    async with asyncstore.open_store(url, **s3_options(seaweedfs)) as store:
        await store.put("model/config.json", b'{"version": 1}')
        async with TieredCache(store, memory_bytes=1 << 20, validate="etag", ttl=0.2) as cache:
            assert await cache.get("model/config.json") == b'{"version": 1}'
            await store.put("model/config.json", b'{"version": 2}')
            # Within the ttl the cached copy is trusted without asking the store.
            assert await cache.get("model/config.json") == b'{"version": 1}'
            await anyio.sleep(0.3)
            assert await cache.get("model/config.json") == b'{"version": 2}'
            stats = cache.stats()
            assert stats.store.revalidations == 1
            assert stats.store.fetches == 2


async def test_caches_with_other_block_sizes_share_a_disk_tier(
    source: CountingStore, tmp_path: Path
) -> None:
    data = os.urandom(16 * KiB)
    await source.put("shared", data)
    async with TieredCache(
        source, memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20, block_bytes=8 * KiB
    ) as cache:
        assert await cache.get("shared", 0, 16 * KiB) == data
    async with TieredCache(
        source, memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20, block_bytes=4 * KiB
    ) as cache:
        assert await cache.get("shared", 4 * KiB, 4 * KiB + 4) == data[4 * KiB : 4 * KiB + 4]
        assert await cache.get("shared", 9000, 13000) == data[9000:13000]


async def test_invalidate_during_a_fetch_keeps_nothing_stale(source: CountingStore) -> None:
    source.delay = 0.2
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        reading = asyncio.ensure_future(cache.get("obj/001"))
        await asyncio.sleep(0.05)
        await source.put("obj/001", b"new")
        await cache.invalidate("obj/001")
        assert await reading == bytes([1]) * 10 * KiB  # that read began before the change
        source.delay = 0
        assert await cache.get("obj/001") == b"new"


async def test_a_warm_read_during_an_invalidate_keeps_nothing_stale(
    source: CountingStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The entry is on disk: while invalidate() waits for its removal there, a read served
    # from the page cache (the prefetcher's way, or a get) finds the old bytes and keeps
    # them in memory. The invalidate forgets them again once the disk tier has let go.
    remove = DiskTier.remove

    def slow_remove(self: DiskTier, key: str) -> None:
        time.sleep(0.2)  # in the disk tier's thread: the removal takes a while
        remove(self, key)

    monkeypatch.setattr(DiskTier, "remove", slow_remove)
    options: dict[str, Any] = {"disk_dir": tmp_path, "disk_bytes": 1 << 22}
    async with TieredCache(source, memory_bytes=1 << 20, **options) as cache:
        await cache.get("obj/001")
        await cache.flush()
        cache._memory.clear()
        await source.put("obj/001", b"new")
        invalidating = asyncio.ensure_future(cache.invalidate("obj/001"))
        await asyncio.sleep(0)  # memory forgotten; the disk's removal under way
        assert cache.get_ready(["obj/001"]) == [bytes([1]) * 10 * KiB]  # the old bytes, kept
        await invalidating
        assert cache.get_nowait("obj/001") is None
        assert await cache.get("obj/001") == b"new"


def test_replacement_too_large_leaves_no_stale_entry(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 256 * KiB, "memory://test")
    try:
        assert tier.write("k", b"old" * 100, None)
        assert not tier.write("k", b"x" * (250 * KiB), None)  # fits the budget, not the limit
        assert tier.read("k") is None
        assert tier.entry_count() == 0
        assert tier.locate("k") is None
    finally:
        tier.close()


# -- ranges are clipped to the object, like the store's own ranged reads --------------------


async def test_a_range_far_past_the_end_costs_one_read(source: CountingStore) -> None:
    await source.put("small", b"0123456789")
    async with TieredCache(source, memory_bytes=1 << 20, block_bytes=16 * KiB) as cache:
        for end in (10**11, 2**63):
            source.gets.clear()
            assert await cache.get("small", 0, end) == b"0123456789"
            assert len(source.gets) <= 1  # the first block is short: that is the end
        source.gets.clear()
        assert await cache.get("small", 2**62, 2**63) == b""
        assert await cache.get("small", 2**62) == b""
        assert len(source.gets) == 2  # one empty read each, and nothing kept for them


async def test_a_long_range_over_a_large_object_stops_at_its_end(source: CountingStore) -> None:
    data = bytes(range(256)) * 400  # 100 KiB: 7 blocks of 16 KiB
    await source.put("big", data)
    async with TieredCache(source, memory_bytes=1, block_bytes=16 * KiB) as cache:
        assert await cache.get("big", 0, 2**63) == data
        assert len(source.gets) <= 1 + RANGE_WINDOW  # not 2**63 / 16 KiB of them


@pytest.mark.parametrize("size", [0, 10, 16 * KiB, 40 * KiB])
async def test_cached_ranges_match_the_stores(source: CountingStore, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    await source.put("obj", data)
    block = 16 * KiB
    offsets = [0, 1, block - 1, block, block + 1, size - 1, size, size + 1, 3 * block, 10**12]
    offsets = sorted({o for o in offsets if o >= 0})
    async with TieredCache(source, memory_bytes=1, block_bytes=block) as cache:
        for start in [None, *offsets]:
            for end in [None, *offsets]:
                if end is not None and end < (start or 0):
                    continue
                expected = await source.get("obj", start, end)
                assert await cache.get("obj", start, end) == expected, (start, end)
        with pytest.raises(NotFound):
            await cache.get("missing", 0, 10**12)


# -- arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"ttl": float("nan")}, "ttl"),
        ({"ttl": -1}, "ttl"),
        ({"ttl": "60"}, "ttl"),
        ({"ttl": True}, "ttl"),
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"block_bytes": 1.5}, "block_bytes"),
        ({"disk_dir": 123, "disk_bytes": 1 << 20}, "disk_dir"),
        ({"disk_dir": "", "disk_bytes": 1 << 20}, "disk_dir"),
        ({"disk_dir": "/tmp/x", "disk_bytes": -5}, "disk_bytes"),
        ({"policy": "fifo"}, "policy"),
        ({"validate": "md5"}, "validate"),
    ],
)
async def test_bad_arguments_name_the_parameter(
    source: CountingStore, options: dict[str, Any], named: str
) -> None:
    arguments: dict[str, Any] = {"memory_bytes": 1 << 20, **options}
    with pytest.raises(InvalidArgument, match=f"^{named}="):
        TieredCache(source, **arguments)


async def test_infinite_ttl_checks_each_object_once(source: CountingStore) -> None:
    async with TieredCache(
        source, memory_bytes=1 << 20, validate="etag", ttl=float("inf")
    ) as cache:
        for _ in range(3):
            assert await cache.get("obj/001") == bytes([1]) * 10 * KiB
        assert cache.stats().store.revalidations == 0  # the GET itself gave the ETag


async def test_key_lists_are_not_strings(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=1 << 20, policy="plan") as cache:
        with pytest.raises(InvalidArgument, match=r"warm\(keys='abc'\)"):
            await cache.warm("abc")
        with pytest.raises(InvalidArgument, match=r"warm\(keys=5\)"):
            await cache.warm(5)  # type: ignore[arg-type]
        for method in (cache.pin, cache.unpin, cache.plan):
            with pytest.raises(InvalidArgument, match=r"keys='obj/001'"):
                method("obj/001")
        for bad in (0, -1, True, 1.5, None):
            with pytest.raises(InvalidArgument, match=r"^max_inflight="):
                # Bounded: an unchecked max_inflight=0 waits forever on a zero semaphore.
                await asyncio.wait_for(cache.warm(["obj/001"], max_inflight=bad), 10)  # type: ignore[arg-type]
        assert source.gets == []


async def test_warm_raises_the_stores_error(source: CountingStore) -> None:
    async with TieredCache(source, memory_bytes=1 << 20) as cache:
        with pytest.raises(NotFound) as caught:
            await cache.warm(["obj/001", "missing/1", "obj/002"])
        assert "missing/1" in str(caught.value)

        async def keys() -> AsyncIterator[str]:
            for key in ("obj/003", "missing/2"):
                yield key

        with pytest.raises(NotFound, match="missing/2"):
            await cache.warm(keys())
        assert await cache.warm([f"obj/{i:03d}" for i in range(20)], max_inflight=3) == 20
