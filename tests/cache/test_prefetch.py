"""The prefetch scheduler: order, bounds, laziness, errors, early exit, adaptive depth."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from collections.abc import AsyncIterator, Iterator
from typing import Literal

import anyio
import anyio.lowlevel
import pytest

import asyncstore
from asyncstore import InvalidArgument, NotFound, Prefetcher
from asyncstore.cache import TieredCache
from asyncstore.stores import MemoryStore, drop_memory_store
from asyncstore.testing import FaultProxy, SeaweedFS, belady_hits

from ..conftest import BUCKET, s3_options, unique

pytestmark = pytest.mark.anyio


class SlowStore(MemoryStore):
    """A real memory store with per-read latency, counting reads in flight."""

    def __init__(self, delay: float = 0.0, jitter: float = 0.0) -> None:
        super().__init__(unique("slow"))
        self.delay = delay
        self.jitter = jitter
        self.inflight = 0
        self.peak = 0
        self.reads = 0
        self.rng = random.Random(0)
        self.key_delay: dict[str, float] = {}  # a longer latency for some keys

    async def _get(self, key: str, start: int, end: int | None) -> bytes:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        self.reads += 1
        try:
            delay = self.key_delay.get(key, self.delay)
            await anyio.sleep(delay + self.rng.random() * self.jitter)
            return await super()._get(key, start, end)
        finally:
            self.inflight -= 1


@pytest.fixture
async def slow() -> AsyncIterator[SlowStore]:
    store = SlowStore(delay=0.002, jitter=0.01)
    for i in range(200):
        await store.put(f"k{i:03d}", str(i).encode() * 10)
    yield store
    drop_memory_store(store.url.removeprefix("memory://"))


async def test_yields_in_plan_order(slow: SlowStore) -> None:
    plan = [f"k{i:03d}" for i in random.Random(1).sample(range(200), 200)]
    async with Prefetcher(slow, plan, lookahead=32) as prefetcher:
        got = [(key, data) async for key, data in prefetcher]
    assert [k for k, _ in got] == plan
    assert all(data == str(int(k[1:])).encode() * 10 for k, data in got)
    stats = prefetcher.stats()
    assert stats.items == 200
    assert stats.accuracy == 1.0


async def test_async_plan_and_duplicates(slow: SlowStore) -> None:
    async def plan() -> AsyncIterator[str]:
        for key in ["k001", "k002", "k001", "k003"]:
            await anyio.lowlevel.checkpoint()
            yield key

    async with Prefetcher(slow, plan()) as prefetcher:
        assert [k async for k, _ in prefetcher] == ["k001", "k002", "k001", "k003"]


async def test_plan_is_consumed_lazily(slow: SlowStore) -> None:
    drawn = 0

    def endless() -> Iterator[str]:
        nonlocal drawn
        for i in itertools.count():
            drawn += 1
            yield f"k{i % 200:03d}"

    async with Prefetcher(slow, endless(), lookahead=8) as prefetcher:
        async for _ in prefetcher:
            if prefetcher.stats().items == 50:
                break
    assert drawn < 50 + 200  # a bounded slice ahead, never the whole (endless) plan


async def test_requests_in_flight_are_bounded(slow: SlowStore) -> None:
    async with Prefetcher(
        slow, [f"k{i:03d}" for i in range(200)], lookahead=100, max_inflight=5
    ) as prefetcher:
        async for _ in prefetcher:
            pass
    assert slow.peak <= 5


async def test_bytes_ahead_are_bounded(slow: SlowStore) -> None:
    slow.delay, slow.jitter = 0.0, 0.0
    big = os.urandom(100_000)
    for i in range(30):
        await slow.put(f"big{i:02d}", big)
    async with Prefetcher(
        slow, [f"big{i:02d}" for i in range(30)], lookahead=30, max_bytes=250_000
    ) as prefetcher:
        async for _ in prefetcher:
            await anyio.sleep(0.01)  # a slow consumer: fetched items pile up
            assert prefetcher._ready_bytes <= 250_000 + 100_000 * 5


async def test_early_exit_stops_every_fetch(slow: SlowStore) -> None:
    slow.delay = 0.05
    before = len(asyncio.all_tasks())
    async with Prefetcher(slow, [f"k{i:03d}" for i in range(200)], lookahead=64) as prefetcher:
        async for _ in prefetcher:
            break
    await anyio.lowlevel.checkpoint()
    assert len(asyncio.all_tasks()) == before
    assert slow.inflight == 0
    assert prefetcher.stats().accuracy < 0.5  # fetched ahead, then dropped


async def test_cancellation_stops_every_fetch(slow: SlowStore) -> None:
    slow.delay = 0.05
    before = len(asyncio.all_tasks())

    async def consume() -> None:
        async with Prefetcher(slow, [f"k{i:03d}" for i in range(200)]) as prefetcher:
            async for _ in prefetcher:
                await anyio.sleep(10)

    with anyio.move_on_after(0.2):
        await consume()
    await anyio.lowlevel.checkpoint()
    assert len(asyncio.all_tasks()) == before
    assert slow.inflight == 0


async def test_errors_raise_in_order(slow: SlowStore) -> None:
    plan = ["k000", "k001", "missing", "k002"]
    seen = []
    with pytest.raises(NotFound, match="missing"):
        async with Prefetcher(slow, plan) as prefetcher:
            async for key, _ in prefetcher:
                seen.append(key)
    assert seen == ["k000", "k001"]


async def test_errors_skipped_and_counted(slow: SlowStore) -> None:
    plan = ["k000", "missing", "k001", "gone"]
    async with Prefetcher(slow, plan, on_error="skip") as prefetcher:
        assert [k async for k, _ in prefetcher] == ["k000", "k001"]
    assert prefetcher.stats().skipped == 2


async def test_take_batches_in_order_with_errors(slow: SlowStore) -> None:
    # take() is what the sync bridge uses: ready items in batches, errors in order.
    plan = [f"k{i:03d}" for i in range(50)]
    plan[10] = "missing"
    plan[41] = "gone"
    async with Prefetcher(slow, plan, on_error="skip") as prefetcher:
        taken: list[str] = []
        while batch := await prefetcher.take(8):
            assert 1 <= len(batch) <= 8
            taken += [key for key, _ in batch]
        assert await prefetcher.take(8) == []
    assert taken == [k for k in plan if k.startswith("k")]
    assert prefetcher.stats().skipped == 2
    seen: list[str] = []
    with pytest.raises(NotFound, match="missing"):
        async with Prefetcher(slow, plan) as prefetcher:
            while batch := await prefetcher.take(8):
                seen += [key for key, _ in batch]
    assert seen == plan[:10]
    with pytest.raises(InvalidArgument, match="most=0"):
        await Prefetcher(slow, plan).take(0)


async def test_take_waits_for_least_items_per_call(slow: SlowStore) -> None:
    # A consumer that needs whole batches gets them in one call each, never a few at a time;
    # only the end of the plan or a failed key makes a call come back short.
    plan = [f"k{i:03d}" for i in range(50)]
    async with Prefetcher(slow, plan, max_inflight=4) as prefetcher:
        sizes = []
        while batch := await prefetcher.take(16, least=12):
            sizes.append(len(batch))
    assert sum(sizes) == 50
    assert all(size >= 12 for size in sizes[:-1]), sizes
    assert len(sizes) <= 5
    plan[30] = "missing"
    seen: list[str] = []
    with pytest.raises(NotFound, match="missing"):
        async with Prefetcher(slow, plan) as prefetcher:
            while batch := await prefetcher.take(16, least=12):
                seen += [key for key, _ in batch]
    assert seen == plan[:30]  # what came before the failed key, then its error
    for least in (-1, 17, True):
        with pytest.raises(InvalidArgument, match="least="):
            await Prefetcher(slow, plan).take(16, least=least)


async def test_take_gives_what_it_collected_before_a_key_that_fails_while_it_waits(
    slow: SlowStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The call has items in hand, needs more, and waits for a key whose fetch then fails:
    # it returns the items it has, and the next call raises the error. The wait counts once.
    # (Only waits of 50 ms or more count as stalls here: on a loaded machine the waits for
    # the first items, fetched with no delay, can exceed the usual half millisecond.)
    monkeypatch.setattr("asyncstore.cache._prefetch._STALL_SECONDS", 0.05)
    slow.delay, slow.jitter = 0.0, 0.0
    slow.key_delay["missing"] = 0.1
    plan = [f"k{i:03d}" for i in range(20)]
    plan[5] = "missing"
    async with Prefetcher(slow, plan, lookahead=16) as prefetcher:
        batch = await prefetcher.take(16, least=12)
        assert [key for key, _ in batch] == plan[:5]
        assert prefetcher.stats().stalls == 1
        with pytest.raises(NotFound, match="missing"):
            await prefetcher.take(16, least=12)
        assert prefetcher.closed
    assert prefetcher.stats().stalls == 1
    assert prefetcher.stats().items == 5
    async with Prefetcher(slow, plan, lookahead=16, on_error="skip") as prefetcher:
        batch = await prefetcher.take(16, least=12)  # skipped: the wait goes on past it
        assert [key for key, _ in batch] == plan[:5] + plan[6:17]
    assert prefetcher.stats().skipped == 1


async def test_take_of_least_zero_never_waits_and_keeps_the_order(slow: SlowStore) -> None:
    # least=0 gives what is ready now: nothing while the first fetches are in flight, then
    # the items that arrived, in plan order, stopping before a failed key (whose error the
    # next waiting call raises); [] with closed set is the end of the plan.
    slow.delay, slow.jitter = 0.05, 0.0
    plan = [f"k{i:03d}" for i in range(40)]
    plan[25] = "missing"
    seen: list[str] = []
    async with Prefetcher(slow, plan, lookahead=8) as prefetcher:
        assert await prefetcher.take(16, least=0) == []
        assert prefetcher.stats().fetched > 0  # started fetches, came back without them
        assert not prefetcher.closed
        await anyio.sleep(0.1)
        ready = await prefetcher.take(16, least=0)
        assert 1 <= len(ready) <= 8
        seen += [key for key, _ in ready]
        while len(seen) < 25:
            batch = await prefetcher.take(16, least=0)
            seen += [key for key, _ in batch]
            if not batch:
                await anyio.sleep(0.02)
        assert await prefetcher.take(16, least=0) == []  # the failed key is next
        with pytest.raises(NotFound, match="missing"):
            await prefetcher.take(16)
    assert seen == plan[:25]
    assert prefetcher.stats().stalls == 0  # nothing it gave was waited for
    slow.delay = 0.0
    async with Prefetcher(slow, ["k001", "k002"]) as prefetcher:
        got: list[str] = []
        while not prefetcher.closed:
            got += [key for key, _ in await prefetcher.take(4, least=0)]
            await anyio.sleep(0.001)
    assert got == ["k001", "k002"]


async def test_take_nowait_gives_what_is_ready_without_a_task_when_all_is_local(
    slow: SlowStore,
) -> None:
    # From a warm cache: every item at once, the window refilled in place (no task, no
    # await), in plan order. From the store: nothing until fetches finish, then the
    # finished ones in order, stopping before one in flight and before a failed key, whose
    # error only a waiting take() raises.
    slow.delay, slow.jitter = 0.0, 0.0
    plan = [f"k{i:03d}" for i in range(100)]
    async with TieredCache(slow, memory_bytes=1 << 20) as cache:
        assert await cache.warm(plan) == 100
        async with Prefetcher(cache, plan, lookahead=8) as prefetcher:
            tasks = len(asyncio.all_tasks())
            got: list[str] = []
            while len(got) < 100:
                batch = prefetcher.take_nowait(16)
                assert len(batch) == min(16, 100 - len(got))  # never short while all is local
                got += [key for key, _ in batch]
                assert len(asyncio.all_tasks()) == tasks
            assert got == plan
            assert prefetcher.take_nowait(16) == []
            assert not prefetcher.closed  # only take() tells the end of the plan
            assert await prefetcher.take(16, least=0) == []
            assert prefetcher.closed
    slow.delay = 0.05
    plan = [f"k{i:03d}" for i in range(12)]
    plan[9] = "missing"
    async with Prefetcher(slow, plan, lookahead=4, max_inflight=4) as prefetcher:
        assert prefetcher.take_nowait(8) == []
        await anyio.sleep(0.01)
        assert slow.inflight == 4  # the fetches it started, in the background
        seen: list[str] = []
        while len(seen) < 9:
            seen += [key for key, _ in prefetcher.take_nowait(8)]
            await anyio.sleep(0.01)
        assert seen == plan[:9]
        await anyio.sleep(0.1)
        assert prefetcher.take_nowait(8) == []  # the failed key is next
        with pytest.raises(NotFound, match="missing"):
            await prefetcher.take(8)
    assert prefetcher.stats().stalls == 0


class FailingPlan:
    """A plan of ``keys`` that raises once when it reaches ``at`` (a listing page that
    failed, say), and would go on after it."""

    def __init__(self, keys: list[str], at: int) -> None:
        self.keys, self.at, self.next, self.failed = keys, at, 0, False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.next == self.at and not self.failed:
            self.failed = True
            raise OSError("the plan's listing failed")
        if self.next == len(self.keys):
            raise StopIteration
        self.next += 1
        return self.keys[self.next - 1]

    def __aiter__(self) -> FailingPlan:
        return self

    async def __anext__(self) -> str:
        await anyio.lowlevel.checkpoint()
        try:
            return next(self)
        except StopIteration:
            raise StopAsyncIteration from None


@pytest.mark.parametrize("plan", ["sync", "async"])
@pytest.mark.parametrize("call", ["take", "take_nowait", "async for"])
async def test_an_error_reading_the_plan_comes_after_the_items_before_it(
    slow: SlowStore, plan: str, call: str
) -> None:
    # The plan ends where it raised: every key read before the error comes, in order, then
    # the error from a call that waits (never lost in a background refill, never taking
    # items already counted as given along with it).
    slow.delay, slow.jitter = 0.0, 0.0
    keys = [f"k{i:03d}" for i in range(150)]
    failing = FailingPlan(keys, 100)
    source: AsyncIterator[str] | Iterator[str] = failing if plan == "sync" else aiter(failing)
    async with TieredCache(slow, memory_bytes=1 << 20) as cache:
        assert await cache.warm(keys) == 150
        async with Prefetcher(cache, source, lookahead=8) as prefetcher:
            got: list[str] = []
            with pytest.raises(OSError, match="listing failed"):
                if call == "async for":
                    async for key, _ in prefetcher:
                        got.append(key)
                for _ in range(1000):
                    if call == "take_nowait":
                        batch = prefetcher.take_nowait(16)
                        if batch:
                            got += [key for key, _ in batch]
                            continue
                        await anyio.lowlevel.checkpoint()
                    got += [key for key, _ in await prefetcher.take(16)]
            assert got == keys[:100]
            assert prefetcher.stats().items == 100
            assert prefetcher.closed
            assert await prefetcher.take(16) == []


@pytest.mark.parametrize("most", [0, -1, True, 2.0, "3"])
async def test_take_nowait_refuses_a_bad_count(slow: SlowStore, most: object) -> None:
    async with Prefetcher(slow, ["k001"]) as prefetcher:
        with pytest.raises(InvalidArgument, match="most="):
            prefetcher.take_nowait(most)  # type: ignore[arg-type]


async def test_plan_aware_cache_gets_the_plan(slow: SlowStore) -> None:
    slow.delay, slow.jitter = 0.0, 0.0
    rng = random.Random(2)
    plan: list[str] = []
    for _ in range(3):
        epoch = [f"k{i:03d}" for i in range(40)]
        rng.shuffle(epoch)
        plan += epoch
    size = len(await slow.get("k000"))
    sizes = {len(await slow.get(f"k{i:03d}")) for i in range(40)}
    assert len(sizes) > 1  # values differ in size: compare against LRU, not the optimum
    async with TieredCache(slow, memory_bytes=20 * 30, policy="plan") as planned:
        async with Prefetcher(planned, plan, lookahead=4) as prefetcher:
            async for _ in prefetcher:
                pass
        plan_hits = planned.stats().memory.hits
    async with TieredCache(slow, memory_bytes=20 * 30) as lru:
        async with Prefetcher(lru, plan, lookahead=4) as prefetcher:
            async for _ in prefetcher:
                pass
        lru_hits = lru.stats().memory.hits
    assert plan_hits > lru_hits
    assert size > 0
    assert plan_hits <= belady_hits(plan, 40)


async def test_a_plan_aware_cache_is_told_the_plan_ahead_in_short_reads() -> None:
    # The cache hears PLAN_AHEAD keys ahead of what was taken all along (not from
    # PLAN_AHEAD down to none between reads), in reads of a few hundred keys: the first
    # items wait for one or two of them, never for PLAN_AHEAD keys.
    from asyncstore.cache import _prefetch

    store = MemoryStore(unique("told"))
    count = 3 * _prefetch.PLAN_AHEAD
    for i in range(count):
        await store.put(f"k{i:05d}", b"v")
    told: list[int] = []  # keys planned so far, after each plan() call

    class Listening(TieredCache):
        def plan(self, keys: list[str]) -> None:  # type: ignore[override]
            told.append((told[-1] if told else 0) + len(keys))
            super().plan(keys)

    try:
        async with Listening(store, memory_bytes=1 << 20, policy="plan") as cache:
            cache.plan([f"k{i:05d}" for i in range(count)])  # warm: every read is a hit
            async with Prefetcher(cache, [f"k{i:05d}" for i in range(count)]) as prefetcher:
                while await prefetcher.take(64, least=64):
                    pass
            async with Prefetcher(cache, [f"k{i:05d}" for i in range(count)]) as prefetcher:
                told.clear()
                taken = len(await prefetcher.take(64, least=64))
                assert told[-1] <= 2 * _prefetch._PLAN_READ  # the first items waited for that
                while got := await prefetcher.take(64, least=64):
                    taken += len(got)
                    ahead = told[-1] - taken
                    if taken >= _prefetch.PLAN_AHEAD // 2:  # the first reads have caught up
                        least = _prefetch.PLAN_AHEAD - _prefetch._PLAN_READ
                        assert ahead >= min(least, count - taken)
                    assert ahead <= _prefetch.PLAN_AHEAD + _prefetch._PLAN_READ
            assert taken == count
            assert max(b - a for a, b in itertools.pairwise([0, *told])) <= _prefetch._PLAN_READ
    finally:
        drop_memory_store(store.url.removeprefix("memory://"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lookahead": 0}, "lookahead=0"),
        ({"lookahead": -1}, "lookahead=-1"),
        ({"lookahead": "deep"}, "lookahead='deep'"),
        ({"lookahead": 2.5}, "lookahead=2.5"),
        ({"lookahead": True}, "lookahead=True"),
        ({"max_inflight": 0}, "max_inflight=0"),
        ({"max_inflight": "32"}, "max_inflight='32'"),
        ({"max_bytes": -1}, "max_bytes=-1"),
        ({"max_bytes": None}, "max_bytes=None"),
        ({"on_error": "ignore"}, "on_error='ignore'"),
    ],
)
async def test_bad_arguments(slow: SlowStore, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Prefetcher(slow, ["k000"], **kwargs)  # type: ignore[arg-type]


async def test_bad_plan_and_source(slow: SlowStore) -> None:
    with pytest.raises(InvalidArgument, match="not a single key"):
        Prefetcher(slow, "k000")
    with pytest.raises(InvalidArgument, match="neither a store"):
        Prefetcher("s3://bucket", ["k"])  # type: ignore[arg-type]


async def test_stall_fraction_falls_with_lookahead(seaweedfs: SeaweedFS) -> None:
    # A slow network: 20 ms added before every request by the proxy in front of SeaweedFS.
    with FaultProxy("127.0.0.1", seaweedfs.s3_port) as proxy:
        url = f"s3://{BUCKET}/{unique()}"
        async with asyncstore.open_store(url, **s3_options(seaweedfs)) as direct:
            await asyncio.gather(*(direct.put(f"o{i:03d}", os.urandom(2000)) for i in range(60)))
        proxy.latency = 0.02
        async with asyncstore.open_store(
            url, **s3_options(seaweedfs, endpoint_url=proxy.url)
        ) as store:
            fractions: dict[int | str, float] = {}
            lookaheads: list[int | Literal["auto"]] = [1, 4, 16, "auto"]
            for lookahead in lookaheads:
                async with Prefetcher(
                    store, [f"o{i:03d}" for i in range(60)], lookahead=lookahead
                ) as prefetcher:
                    async for _ in prefetcher:
                        await anyio.sleep(0.005)  # the training step
                fractions[lookahead] = prefetcher.stats().stall_fraction
    # With 4 or more in flight a 20 ms fetch keeps up with a 5 ms step: a few stalls at the
    # start, and a few more when this shared machine stalls the loop (up to 6 of 60 here).
    assert fractions[1] > 0.9
    assert fractions[4] < 0.5
    assert fractions[16] <= fractions[4] + 0.1
    assert fractions["auto"] <= fractions[4] + 0.1


async def test_early_exit_releases_every_slot_and_connection(seaweedfs: SeaweedFS) -> None:
    # 16 reads in flight on a store allowing 8 requests at once, abandoned by an early exit:
    # if a cancelled read kept its request slot or its connection, the store would hang.
    url = f"s3://{BUCKET}/{unique()}"
    async with asyncstore.open_store(url, **s3_options(seaweedfs, max_inflight=8)) as store:
        assert isinstance(store, asyncstore.S3Store)
        await asyncio.gather(*(store.put(f"o{i:03d}", os.urandom(200_000)) for i in range(40)))
        for _ in range(3):
            async with Prefetcher(store, [f"o{i:03d}" for i in range(40)], lookahead=16) as pf:
                async for _ in pf:
                    break
        fast = store._fast
        assert fast is not None
        connector = fast._session.connector
        assert connector is not None
        assert len(connector._acquired) == 0
        with anyio.fail_after(10):
            results = await asyncio.gather(*(store.get(f"o{i:03d}") for i in range(40)))
        assert all(len(r) == 200_000 for r in results)


async def test_a_store_returning_bytearrays_is_prefetched_over_warm_epochs() -> None:
    # Items already local wait in the window as they are: a bytearray from a custom store
    # must not be taken for a fetch in flight.
    class Mutable(MemoryStore):
        async def _get(self, key: str, start: int, end: int | None) -> bytes:
            return bytearray(await super()._get(key, start, end))  # type: ignore[return-value]

    store = Mutable(unique("bytearrays"))
    async with store, TieredCache(store, memory_bytes=1 << 20) as cache:
        for i in range(10):
            await store.put(f"k{i}", bytes([i]) * 10)
        for _ in range(2):  # the second epoch is all memory hits
            async with Prefetcher(cache, [f"k{i}" for i in range(10)]) as prefetcher:
                got = [data async for _, data in prefetcher]
            assert got == [bytes([i]) * 10 for i in range(10)]


async def test_items_larger_than_max_bytes_all_come_one_at_a_time() -> None:
    # Each item alone is over the byte bound: the plan is not cut short (an empty window
    # always gets one fetch), and no more than one such item is held or in flight at once.
    store = SlowStore(delay=0.001)
    plan = [f"k{i}" for i in range(10)]
    for key in plan:
        await store.put(key, b"x" * 1000)
    try:
        async with Prefetcher(store, plan, max_bytes=500) as prefetcher:
            seen = [key async for key, _ in prefetcher]
        assert seen == plan
        assert store.peak <= 4  # the first fetches start before any size is known
        async with Prefetcher(store, plan, max_bytes=500) as prefetcher:
            batches = [await prefetcher.take(4, least=2) for _ in range(12)]
        assert [key for batch in batches for key, _ in batch] == plan
        assert batches[-1] == []
    finally:
        drop_memory_store(store.url.removeprefix("memory://"))


@pytest.mark.parametrize("warm", [False, True])
async def test_empty_items_are_prefetched(warm: bool) -> None:
    # An average item size of zero bytes: the byte bound has nothing to divide.
    store = SlowStore()
    plan = [f"e{i % 3}" for i in range(50)]
    for key in set(plan):
        await store.put(key, b"")
    try:
        async with TieredCache(store, memory_bytes=1 << 20) as cache:
            if warm:
                await cache.warm(sorted(set(plan)))
            async with Prefetcher(cache, plan, lookahead=8) as prefetcher:
                got = [item for _ in range(20) for item in await prefetcher.take(7)]
        assert got == [(key, b"") for key in plan]
    finally:
        drop_memory_store(store.url.removeprefix("memory://"))
