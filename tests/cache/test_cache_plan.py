"""Plan-aware eviction: with the plan known, the tier matches the offline optimum."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstore import InvalidArgument
from asyncstore.cache import TieredCache
from asyncstore.cache._memory import MemoryTier
from asyncstore.cache._plan import PlanTier
from asyncstore.stores import MemoryStore, drop_memory_store
from asyncstore.testing import belady_hits

from ..conftest import unique


def run(tier: MemoryTier | PlanTier, keys: list[str]) -> int:
    hits = 0
    for key in keys:
        if tier.get(key) is not None:
            hits += 1
        else:
            tier.put(key, b"x" * 10)
        assert tier.used <= tier.budget
    return hits


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.sampled_from("abcdefghij"), min_size=0, max_size=80),
    capacity=st.integers(0, 6),
)
def test_plan_tier_is_optimal_for_equal_sizes(keys: list[str], capacity: int) -> None:
    tier = PlanTier(capacity * 10)
    tier.extend(keys)
    assert run(tier, keys) == belady_hits(keys, capacity)


@settings(max_examples=150, deadline=None)
@given(
    stretches=st.lists(
        st.tuples(st.sampled_from(["ab", "abc", "abcdefghij"]), st.integers(0, 150)),
        max_size=5,
    ),
    capacity=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_long_runs_of_hits_between_evictions_stay_optimal(
    stretches: list[tuple[str, int]], capacity: int, seed: int
) -> None:
    # Stretches of hits on a few keys (hundreds of reschedules, no eviction: the tier keeps
    # no eviction order, or drops a stale one) between stretches over more keys than fit
    # (the order is rebuilt when an eviction first needs it).
    rng = random.Random(seed)
    keys = [rng.choice(letters) for letters, length in stretches for _ in range(length)]
    tier = PlanTier(capacity * 10)
    tier.extend(keys)
    assert run(tier, keys) == belady_hits(keys, capacity)


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.sampled_from("abcdefghij"), min_size=0, max_size=80),
    capacity=st.integers(0, 6),
    runs=st.lists(st.integers(1, 9), min_size=1, max_size=8),
)
def test_runs_of_hits_are_as_optimal_as_single_reads(
    keys: list[str], capacity: int, runs: list[int]
) -> None:
    # get_run (the prefetcher's warm path) serves the leading hits of a stretch in one call,
    # leaving the first miss to a get() and a put(): the same decisions, hit for hit.
    tier = PlanTier(capacity * 10)
    tier.extend(keys)
    hits = position = 0
    for turn in range(len(keys) + 1):
        if position == len(keys):
            break
        stop = min(len(keys), position + runs[turn % len(runs)])
        got = tier.get_run(keys, position, stop)
        assert got == [b"x" * 10] * len(got)
        hits += len(got)
        position += len(got)
        if position < stop:
            assert tier.get(keys[position]) is None  # the miss that ended the run
            tier.put(keys[position], b"x" * 10)
            position += 1
        assert tier.used <= tier.budget
    assert hits == belady_hits(keys, capacity)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.sampled_from("abcdefgh"), max_size=60), piece=st.integers(1, 10))
def test_plan_given_in_pieces(keys: list[str], piece: int) -> None:
    # Feeding the plan a window ahead (as the prefetcher does) never breaks the budget and
    # never does worse than not knowing the plan beyond the window would allow.
    tier = PlanTier(30)
    hits = 0
    fed = 0
    for position, key in enumerate(keys):
        while fed < len(keys) and fed < position + piece:
            tier.extend([keys[fed]])
            fed += 1
        if tier.get(key) is not None:
            hits += 1
        else:
            tier.put(key, b"x" * 10)
        assert tier.used <= 30
    assert hits <= belady_hits(keys, 3)


def read_runs(tier: PlanTier, keys: list[str], runs: list[int]) -> int:
    # As the prefetcher reads: runs of hits with get_run, each miss with get() and put().
    hits = position = turn = 0
    while position < len(keys):
        stop = min(len(keys), position + runs[turn % len(runs)])
        turn += 1
        got = tier.get_run(keys, position, stop)
        assert got == [b"x" * 10] * len(got)
        hits += len(got)
        position += len(got)
        if position < stop:
            assert tier.get(keys[position]) is None
            tier.put(keys[position], b"x" * 10)
            position += 1
        assert tier.used <= tier.budget
    return hits


@settings(max_examples=200, deadline=None)
@given(
    epochs=st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=30), min_size=1, max_size=5),
    capacity=st.integers(1, 6),
    runs=st.lists(st.integers(1, 9), min_size=1, max_size=6),
)
def test_every_epoch_is_optimal_from_the_state_the_last_one_left(
    epochs: list[list[str]], capacity: int, runs: list[int]
) -> None:
    # Epoch after epoch, each planned whole before it is read: the tier keeps the plan as a
    # list until an eviction needs next uses, maps them, and goes back to the list once every
    # planned use was read. Each epoch must still get the optimum from where it starts: the
    # resident keys first (they fit, so they cost misses only), then the epoch.
    tier = PlanTier(capacity * 10)
    for keys in epochs:
        resident = tier.keys()
        tier.extend(keys)
        hits = read_runs(tier, keys, runs)
        assert hits == belady_hits(resident + keys, capacity)


# Operations of the randomized tests below: a piece of plan, a read of the next planned keys
# (as a prefetcher makes them), a run of reads of any keys.
PLAN_PIECE = st.tuples(st.just("plan"), st.lists(st.sampled_from("abcdef"), max_size=8))
READ_NEXT = st.tuples(st.just("next"), st.integers(1, 6))
READ_RUN = st.tuples(st.just("run"), st.lists(st.sampled_from("abcdefg"), max_size=5))
PUT = st.tuples(st.sampled_from("abcdefg"), st.integers(1, 30))  # a key and its size


def eager(tier: PlanTier) -> PlanTier:
    # The same tier, made to map every use from the start and never keep the plan as a list.
    assert tier._lazy
    tier._map()
    tier._unmap = lambda: None  # type: ignore[method-assign]
    return tier


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            PLAN_PIECE,
            READ_NEXT,
            st.tuples(st.just("get"), st.sampled_from("abcdefg")),
            READ_RUN,
            st.tuples(st.just("put"), st.sampled_from("abcdefg")),
        ),
        max_size=40,
    )
)
def test_a_plan_kept_as_a_list_consumes_the_uses_a_mapped_one_does(
    ops: list[tuple[str, object]],
) -> None:
    # With room for everything (no eviction decides anything), both must agree read for
    # read and leave the same upcoming uses, whatever the order of reads and plan pieces.
    lazy, mapped = PlanTier(1000), eager(PlanTier(1000))
    planned: list[str] = []  # the reads a prefetcher would make, in the plan's order
    for op, arg in ops:
        if op == "plan":
            assert isinstance(arg, list)
            lazy.extend(arg)
            mapped.extend(arg)
            planned += arg
        elif op == "next":
            assert isinstance(arg, int)
            keys, planned = planned[:arg], planned[arg:]
            assert lazy.get_run(keys, 0, len(keys)) == mapped.get_run(keys, 0, len(keys))
        elif op == "get":
            assert lazy.get(str(arg)) == mapped.get(str(arg))
        elif op == "run":
            assert isinstance(arg, list)
            assert lazy.get_run(arg, 0, len(arg)) == mapped.get_run(arg, 0, len(arg))
        else:
            assert lazy.put(str(arg), b"v" + str(arg).encode())
            assert mapped.put(str(arg), b"v" + str(arg).encode())
    if lazy._lazy:
        lazy._map()
    assert upcoming_uses(lazy) == upcoming_uses(mapped)
    assert sorted(lazy.keys()) == sorted(mapped.keys())


def test_a_warm_epoch_keeps_the_plan_as_a_list() -> None:
    # The cheap path is the one taken: a dataset the tier holds, read in the plan's order,
    # maps no uses (an epoch that evicts maps them, and the next extend drops them).
    tier = PlanTier(1000)
    keys = [f"k{i}" for i in range(50)]
    tier.extend(keys)
    for key in keys:
        assert tier.get(key) is None
        assert tier.put(key, b"x" * 10)
    for _ in range(3):
        tier.extend(keys)
        assert len(tier.get_run(keys, 0, 50)) == 50
        assert tier._lazy
        assert not tier._uses
    tier.extend(keys)
    assert tier.get(keys[1]) is not None  # out of the plan's order: the uses are mapped
    assert not tier._lazy
    assert len(tier._uses) == 49
    assert tier.get_run(keys, 0, 1) == [b"x" * 10]
    assert len(tier.get_run(keys, 2, 50)) == 48
    assert not tier._uses
    tier.extend(keys)  # every use read: a list again
    assert tier._lazy


def test_shuffled_epochs_beat_lru() -> None:
    # A dataset twice the cache, three freshly shuffled epochs: LRU thrashes, the plan does not.
    rng = random.Random(0)
    dataset = [f"k{i}" for i in range(200)]
    keys: list[str] = []
    for _ in range(3):
        rng.shuffle(dataset)
        keys += dataset
    planned = PlanTier(100 * 10)
    planned.extend(keys)
    plan_hits = run(planned, keys)
    lru_hits = run(MemoryTier(100 * 10), keys)
    optimum = belady_hits(keys, 100)
    assert plan_hits >= 0.9 * optimum
    assert plan_hits > 1.5 * lru_hits


def test_pinned_entries_are_never_evicted() -> None:
    tier = PlanTier(30)
    tier.pin(["p"])
    tier.extend(["p", "a", "b", "c", "d"])
    tier.put("p", b"x" * 10)
    for key in "abcd":
        tier.put(key, b"x" * 10)
    assert "p" in tier
    assert tier.used <= 30


def test_an_entry_not_planned_again_is_refused_by_a_full_tier_unless_pinned() -> None:
    # A warm epoch read from the disk tier: every hit is put once it was read, with no use
    # planned ahead. It would go first, so the tier stays as it is; a pinned one goes in.
    tier = PlanTier(30)
    tier.extend(["a", "b", "c", "d", "a"])
    for key in "abc":
        assert tier.put(key, b"x" * 10)
    assert tier.get("d") is None
    assert not tier.put("d", b"x" * 10)  # used once, never again: refused
    assert sorted(tier._values) == ["a", "b", "c"]
    assert tier.bypassed == 1
    tier.pin(["p"])
    assert tier.put("p", b"x" * 10)  # pinned: in, in place of an unpinned entry
    assert "p" in tier
    assert tier.used == 30
    tier.discard("b")
    assert tier.put("q", b"x" * 10)  # room for it: in, planned or not
    assert "q" in tier


def test_an_entry_put_back_with_the_same_next_use_is_evicted_once() -> None:
    # Discarded (an invalidate) and put back with the same next use, an entry has two items
    # in the eviction order; taking it as a victim twice made the put raise KeyError.
    tier = PlanTier(10)
    tier.extend(["y", "x", "a", "b"])
    assert tier.put("a", b"a" * 4)
    assert tier.put("b", b"b" * 4)
    assert tier.put("x", b"x" * 4)  # evicts b: the eviction order is built
    tier.discard("a")
    assert tier.put("a", b"a" * 4)
    assert tier.put("y", b"y" * 10)  # needs every byte: a and x go, once each
    assert sorted(tier._values) == ["y"]
    assert tier.used == 10


def test_belady_reference() -> None:
    # a b c a b c with room for 2: keep a and b; the optimum hits a and b once each.
    assert belady_hits(list("abcabc"), 2) == 2
    assert belady_hits(list("aaaa"), 1) == 3
    assert belady_hits(list("abab"), 0) == 0


@pytest.mark.anyio
async def test_cache_with_a_plan() -> None:
    store = MemoryStore(unique("plan"))
    try:
        for i in range(20):
            await store.put(f"k{i:02d}", bytes([i]) * 100)
        rng = random.Random(1)
        order: list[str] = []
        for _ in range(3):
            epoch = [f"k{i:02d}" for i in range(20)]
            rng.shuffle(epoch)
            order += epoch
        async with TieredCache(store, memory_bytes=1000, policy="plan") as cache:
            cache.plan(order)
            for key in order:
                assert await cache.get(key) == bytes([int(key[1:])]) * 100
            stats = cache.stats()
        assert stats.memory.hits == belady_hits(order, 10)
        async with TieredCache(store, memory_bytes=1000) as lru:
            with pytest.raises(InvalidArgument, match="policy='plan'"):
                lru.plan(order)
    finally:
        drop_memory_store(store.url.removeprefix("memory://"))


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("plan"), st.lists(st.sampled_from("abcdef"), max_size=8)),
            st.tuples(st.just("get"), st.sampled_from("abcdefg")),
            st.tuples(st.just("run"), st.lists(st.sampled_from("abcdefg"), max_size=5)),
            st.tuples(st.just("put"), st.tuples(st.sampled_from("abcdefg"), st.integers(0, 40))),
            st.tuples(st.just("pin"), st.sampled_from("abcdefg")),
            st.tuples(st.just("unpin"), st.sampled_from("abcdefg")),
            st.tuples(st.just("discard"), st.sampled_from("abcdefg")),
            st.tuples(st.just("clear"), st.just("")),
        ),
        max_size=50,
    )
)
def test_the_budget_and_the_pins_hold_through_every_switch_of_the_plan(
    ops: list[tuple[str, object]],
) -> None:
    # Any mix of plan pieces, reads in and out of order, puts that evict, pins, discards
    # and clears: the bytes counted are the bytes held, within the budget, a pinned entry
    # is never evicted, a value read is the value last put, and the list form holds no map.
    tier = PlanTier(60)
    held: dict[str, bytes] = {}  # what the tier may still hold: the last value put
    pinned: set[str] = set()
    for op, arg in ops:
        if op == "plan":
            assert isinstance(arg, list)
            tier.extend(arg)
        elif op == "get":
            value = tier.get(str(arg))
            assert value is None or value == held[str(arg)]
        elif op == "run":
            assert isinstance(arg, list)
            for key, value in zip(arg, tier.get_run(arg, 0, len(arg)), strict=False):
                assert value == held[key]
        elif op == "put":
            assert isinstance(arg, tuple)
            key, size = arg
            before = {k for k in pinned if k in tier and k != key}
            value = key.encode() * size
            if tier.put(key, value):
                held[key] = value
            else:
                held.pop(key, None)
            assert before <= set(tier.keys())  # no pinned entry was evicted
        elif op == "pin":
            tier.pin([str(arg)])
            pinned.add(str(arg))
        elif op == "unpin":
            tier.unpin([str(arg)])
            pinned.discard(str(arg))
        elif op == "discard":
            tier.discard(str(arg))
        else:
            tier.clear()
        cached = tier.keys()
        assert tier.used == sum(len(held[k]) for k in cached)
        assert tier.used <= tier.budget
        assert tier.pinned_used == sum(len(held[k]) for k in cached if k in pinned)
        assert not (tier._lazy and tier._uses)


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            PLAN_PIECE,
            READ_NEXT,
            READ_RUN,
            st.tuples(st.just("put"), PUT),
            st.tuples(st.just("puts"), st.lists(PUT, max_size=6)),
            st.tuples(st.just("pin"), st.sampled_from("abcdefg")),
            st.tuples(st.just("unpin"), st.sampled_from("abcdefg")),
        ),
        max_size=50,
    ),
    plan_tier=st.booleans(),
)
def test_runs_noted_at_once_are_a_call_per_key(
    ops: list[tuple[str, object]], plan_tier: bool
) -> None:
    # peek_many then use_run (the warm window's lookups) against a get() per key, and
    # put_many (the rows read and settled) against a put() per item: the same values and
    # refusals, then the same tier, decision for decision, whatever it evicts and refuses.
    one, each = (PlanTier(60), PlanTier(60)) if plan_tier else (MemoryTier(60), MemoryTier(60))
    planned: list[str] = []
    for op, arg in ops:
        if op in ("next", "run"):
            if op == "next":
                assert isinstance(arg, int)
                keys, planned = planned[:arg], planned[arg:]
            else:
                assert isinstance(arg, list)
                keys = arg
            peeked = one.peek_many(keys)
            one.use_run(keys)
            assert peeked == [each.get(key) for key in keys]
        elif op == "plan":
            assert isinstance(arg, list)
            if isinstance(one, PlanTier) and isinstance(each, PlanTier):
                one.extend(arg)
                each.extend(arg)
            planned += arg
        elif op == "put":
            assert isinstance(arg, tuple)
            key, size = arg
            assert one.put(key, key.encode() * size) == each.put(key, key.encode() * size)
        elif op == "puts":
            assert isinstance(arg, list)
            items = [(key, key.encode() * size) for key, size in arg]
            assert one.put_many(items) == sum(not each.put(key, value) for key, value in items)
        elif op == "pin":
            one.pin([str(arg)])
            each.pin([str(arg)])
        else:
            one.unpin([str(arg)])
            each.unpin([str(arg)])
        assert sorted(one.keys()) == sorted(each.keys())
        assert (one.used, one.bypassed) == (each.used, each.bypassed)
        if isinstance(one, PlanTier) and isinstance(each, PlanTier):
            assert upcoming_uses(one) == upcoming_uses(each)
            if not one._lazy:  # each entry's next use, which chooses the next victim
                assert one._next == each._next
    if isinstance(one, MemoryTier) and isinstance(each, MemoryTier):
        assert one.keys_by_recency() == each.keys_by_recency()


def upcoming_uses(tier: PlanTier) -> dict[str, list[int]]:
    """Each key's planned uses not yet read, by plan position, in either of the tier's forms."""
    if not tier._lazy:
        return {
            key: [uses] if isinstance(uses, int) else list(uses) for key, uses in tier._uses.items()
        }
    out: dict[str, list[int]] = {}
    for i, key in enumerate(tier._log[tier._cursor :]):
        out.setdefault(key, []).append(tier._base + tier._cursor + i)
    return out
