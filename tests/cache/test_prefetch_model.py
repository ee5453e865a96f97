"""The Prefetcher over a partly warm TieredCache, against a model of what the consumer sees.

A random plan (duplicates, keys the store holds, keys it lacks, keys ``check_key`` refuses)
is read through a cache warmed beforehand in part: in memory only, or with a disk tier
(written by this cache, still queued for it, or written by an earlier cache on the same
directory), with either eviction policy, and block entries of ranged reads in memory whose
cache keys the plan names too. The consumer calls ``take(most, least=...)`` with drawn
sizes, or ``take_nowait(most)`` (a least of -1 in a drawn call: what ``least=0`` gives,
without awaiting), or iterates with ``async for``. The model is a plain list: with
``on_error="skip"`` the plan's good keys in order with their bytes, every bad key skipped
and counted; with ``"raise"`` the good keys before the first bad one, then that key's error
(``NotFound`` or ``InvalidKey``) from the first call that must wait for it. Each call gives
the model's next items, at least ``least`` of them unless the plan (or the good stretch)
ends first; ``[]`` from a waiting call is the end. Afterwards ``take`` gives ``[]``, the
prefetcher is closed, no task is left behind, and the cache serves every good key with the
store's bytes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncstore import AsyncStoreError, InvalidArgument, InvalidKey, NotFound, Prefetcher
from asyncstore.cache import TieredCache
from asyncstore.stores import check_key, drop_memory_store

from .conftest import CountingStore

pytestmark = pytest.mark.anyio

MAX_CALLS = 10_000
"""Calls to ``take`` one plan may need; more means the consumer is not making progress."""

BLOCK = 16
"""The cache's block size when ranged reads are warmed: a few blocks per value."""

PRESENT = [f"p/{i}" for i in range(8)] + ["é/8", "a b/9"]  # the last two: valid, unusual
MISSING = ["m/0", "m/1", "p/99"]
INVALID = ["", "/abs", "a//b", "../x", "trail/", "a\x00b", "x" * 1100]
# What a ranged read of a present key keeps in memory under its block's cache key: a key no
# reader may name, and which the plan names all the same.
BLOCK_KEYS = [f"p/{i}\x00{BLOCK}.0" for i in range(3)]
BAD = MISSING + INVALID + BLOCK_KEYS

Policy = Literal["lru", "plan"]
OnError = Literal["raise", "skip"]
Tiers = Literal["memory", "disk", "disk-queued", "disk-earlier"]


@dataclass(frozen=True)
class Scenario:
    values: dict[str, bytes]
    plan: list[str]
    warm: list[str]  # read whole through the cache before the plan
    ranged: list[str]  # read in part (their first block) before the plan
    tiers: Tiers
    policy: Policy
    preplan: bool  # with policy="plan": warm keys planned before they are read
    memory_bytes: int
    on_error: OnError
    lookahead: int | Literal["auto"]
    max_inflight: int
    max_bytes: int
    delay: float  # the store's latency per read
    calls: list[
        tuple[int, int]
    ]  # (most, least) per call, cycled (least -1: take_nowait); [] for async for


def valid(key: str) -> bool:
    try:
        check_key(key, "memory://model")
    except InvalidArgument:
        return False
    return True


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    values = {
        key: draw(st.just(b"") | st.binary(max_size=300), label=key)
        for key in PRESENT
        if key != "p/7"  # a valid key the store lacks, drawn with the good ones
    }
    good = draw(st.lists(st.sampled_from(PRESENT), max_size=56))
    plan = list(good)
    for position, key in draw(
        st.lists(st.tuples(st.integers(0, 56), st.sampled_from(BAD)), max_size=4)
    ):
        plan.insert(min(position, len(plan)), key)
    present = sorted(values)
    warm = draw(st.lists(st.sampled_from(present), unique=True))
    ranged = draw(st.lists(st.sampled_from(present), unique=True, max_size=3))
    calls = draw(
        st.lists(
            st.integers(1, 20).flatmap(
                lambda most: st.tuples(st.just(most), st.integers(-1, most))
            ),
            min_size=1,
            max_size=8,
        )
        | st.just([])
    )
    return Scenario(
        values=values,
        plan=plan,
        warm=warm,
        ranged=ranged,
        tiers=draw(st.sampled_from(["memory", "disk", "disk-queued", "disk-earlier"])),
        policy=draw(st.sampled_from(["lru", "plan"])),
        preplan=draw(st.booleans()),
        memory_bytes=draw(st.sampled_from([1 << 20, 1000, 200])),
        on_error=draw(st.sampled_from(["skip", "raise"])),
        lookahead=draw(st.sampled_from(["auto", 1, 3, 16])),
        max_inflight=draw(st.integers(1, 6)),
        max_bytes=draw(st.sampled_from([256 << 20, 1000, 1])),  # 1: below every item
        delay=draw(st.sampled_from([0.0, 0.0003])),
        calls=calls,
    )


@dataclass
class Model:
    """What the consumer must see: ``items`` in order, then ``error`` (a type) or the end."""

    items: list[tuple[str, bytes]]
    error: type[AsyncStoreError] | None
    bad_key: str | None
    skipped: int


def model(scenario: Scenario) -> Model:
    items: list[tuple[str, bytes]] = []
    skipped = 0
    for key in scenario.plan:
        if valid(key) and key in scenario.values:
            items.append((key, scenario.values[key]))
            continue
        if scenario.on_error == "raise":
            return Model(items, NotFound if valid(key) else InvalidKey, key, 0)
        skipped += 1
    return Model(items, None, None, skipped)


async def warm_up(cache: TieredCache, scenario: Scenario) -> None:
    for key in scenario.ranged:  # first, so that the block is read and kept
        assert await cache.get(key, 0, 1) == scenario.values[key][:1]
    if cache.policy == "plan" and scenario.preplan:
        cache.plan(scenario.warm)
    assert await cache.warm(scenario.warm) == len(scenario.warm)


async def consume_with_take(
    prefetcher: Prefetcher, scenario: Scenario, expected: Model
) -> tuple[list[tuple[str, bytes]], BaseException | None]:
    got: list[tuple[str, bytes]] = []
    calls = list(scenario.calls)
    if all(least < 0 for _, least in calls) or (
        expected.error is not None and all(least <= 0 for _, least in calls)
    ):
        # Only take() tells the end of the plan, and only a waiting call raises: make one wait.
        calls[-1] = (calls[-1][0], 1)
    for call in range(MAX_CALLS):
        most, least = calls[call % len(calls)]
        left = len(expected.items) - len(got)
        if least < 0:
            # What least=0 would give, the end of the plan and errors aside; never an await.
            batch = prefetcher.take_nowait(most)
            assert len(batch) <= most
            assert batch == expected.items[len(got) : len(got) + len(batch)], (call, most)
            got += batch
            if not batch:
                await asyncio.sleep(0.0001)  # nothing ready yet: let the fetches run
            continue
        error: AsyncStoreError | None = None
        try:
            batch = await prefetcher.take(most, least=least)
        except AsyncStoreError as exc:
            error = exc
        if error is not None:
            # Only where the model has the error next, and only from a call that waits.
            assert left == 0, (len(got), error)
            assert least >= 1
            return got, error
        assert len(batch) <= most
        assert batch == expected.items[len(got) : len(got) + len(batch)], (call, most, least)
        got += batch
        if least:
            # Fewer than least only where the good items end (the plan's end, or a bad key
            # next with on_error="raise"); [] only at the end of the plan.
            assert len(batch) >= min(least, left), (call, most, least, left)
            if not batch:
                assert prefetcher.closed
                return got, None
        elif not batch:
            if prefetcher.closed:
                return got, None
            await asyncio.sleep(0.0001)  # nothing ready yet: let the fetches run
    pytest.fail(f"the plan did not finish in {MAX_CALLS} calls: {len(got)} items taken")


async def consume_with_async_for(
    prefetcher: Prefetcher,
) -> tuple[list[tuple[str, bytes]], BaseException | None]:
    got: list[tuple[str, bytes]] = []
    try:
        async for key, data in prefetcher:
            got.append((key, data))
    except AsyncStoreError as exc:
        return got, exc
    return got, None


async def run_scenario(scenario: Scenario, disk_dir: str | None) -> None:
    expected = model(scenario)
    store = CountingStore()
    store.delay = scenario.delay
    try:
        for key, data in scenario.values.items():
            await store.put(key, data)
        disk_bytes = None if disk_dir is None else 4 << 20
        if scenario.tiers == "disk-earlier":
            # Warm on disk by a cache closed since: this one starts with an empty memory tier.
            async with TieredCache(
                store,
                memory_bytes=1 << 20,
                disk_dir=disk_dir,
                disk_bytes=disk_bytes,
                block_bytes=BLOCK,
            ) as earlier:
                await warm_up(earlier, scenario)
        before = len(asyncio.all_tasks())
        async with TieredCache(
            store,
            memory_bytes=scenario.memory_bytes,
            disk_dir=disk_dir,
            disk_bytes=disk_bytes,
            policy=scenario.policy,
            block_bytes=BLOCK,
        ) as cache:
            if scenario.tiers != "disk-earlier":
                await warm_up(cache, scenario)
            if scenario.tiers == "disk":
                await cache.flush()  # on disk now, not queued for it
            async with Prefetcher(
                cache,
                scenario.plan,
                lookahead=scenario.lookahead,
                max_inflight=scenario.max_inflight,
                max_bytes=scenario.max_bytes,
                on_error=scenario.on_error,
            ) as prefetcher:
                if scenario.calls:
                    got, error = await consume_with_take(prefetcher, scenario, expected)
                else:
                    got, error = await consume_with_async_for(prefetcher)
                assert got == expected.items
                if expected.error is None:
                    assert error is None
                else:
                    assert type(error) is expected.error, (error, expected.bad_key)
                    if expected.error is NotFound:
                        assert f"/{expected.bad_key} does not exist" in str(error)
                assert prefetcher.closed
                assert await prefetcher.take(5) == []
                assert await prefetcher.take(5, least=0) == []
                assert prefetcher.take_nowait(5) == []
                stats = prefetcher.stats()
                assert stats.items == len(expected.items)
                assert stats.skipped == expected.skipped
                if scenario.on_error == "skip":
                    assert stats.fetched == len(scenario.plan)  # every key once, none twice
            await prefetcher.aclose()  # twice is fine
            for key in {key for key, _ in expected.items} | set(scenario.warm):
                assert await cache.get(key) == await store.get(key) == scenario.values[key]
                assert cache.get_nowait(key) in (None, scenario.values[key])
        await anyio.lowlevel.checkpoint()
        assert len(asyncio.all_tasks()) == before  # no fetch or refill left running
    finally:
        drop_memory_store(store.url.removeprefix("memory://"))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(scenario=scenarios())
async def test_prefetch_over_a_partly_warm_cache_matches_the_model(
    tmp_path_factory: pytest.TempPathFactory, scenario: Scenario
) -> None:
    disk_dir = None
    if scenario.tiers != "memory":
        disk_dir = str(tmp_path_factory.mktemp("tier"))
    await run_scenario(scenario, disk_dir)
