"""The memory tier against a small reference model (hypothesis state machine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from asyncstore.cache._memory import MemoryTier

BUDGET = 100
KEYS = st.sampled_from([f"k{i}" for i in range(8)])


class MemoryTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = MemoryTier(BUDGET)
        self.order: list[str] = []  # unpinned keys, least recently used first
        self.values: dict[str, bytes] = {}
        self.pins: set[str] = set()

    def _used(self) -> int:
        return sum(len(v) for v in self.values.values())

    def _pinned_used(self) -> int:
        return sum(len(v) for k, v in self.values.items() if k in self.pins)

    @rule(key=KEYS, size=st.integers(0, 120))
    def put(self, key: str, size: int) -> None:
        value = bytes([size % 256]) * size
        stored = self.tier.put(key, value)
        if key in self.values:
            del self.values[key]
            if key in self.order:
                self.order.remove(key)
        if self._pinned_used() + size > BUDGET:
            assert not stored
            return
        assert stored
        while self._used() + size > BUDGET:
            victim = self.order.pop(0)
            del self.values[victim]
        self.values[key] = value
        if key not in self.pins:
            self.order.append(key)

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        got = self.tier.get(key)
        assert got == self.values.get(key)
        if got is not None:
            assert got is self.tier.get(key)  # the stored object itself: no copy on a hit
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)

    @rule(keys=st.lists(KEYS, max_size=6))
    def get_run(self, keys: list[str]) -> None:
        # The leading run of present keys, each marked used as get() marks it.
        got = self.tier.get_run(["k0", *keys], 1, len(keys) + 1)
        run = []
        for key in keys:
            if key not in self.values:
                break
            run.append(self.values[key])
            if key in self.order:
                self.order.remove(key)
                self.order.append(key)
        assert got == run

    @rule(key=KEYS)
    def discard(self, key: str) -> None:
        self.tier.discard(key)
        self.values.pop(key, None)
        if key in self.order:
            self.order.remove(key)

    @rule(key=KEYS)
    def pin(self, key: str) -> None:
        self.tier.pin([key])
        self.pins.add(key)
        if key in self.order:
            self.order.remove(key)

    @rule(key=KEYS)
    def unpin(self, key: str) -> None:
        self.tier.unpin([key])
        if key in self.pins:
            self.pins.discard(key)
            if key in self.values:
                self.order.append(key)

    @invariant()
    def within_budget(self) -> None:
        assert self.tier.used <= BUDGET
        assert self.tier.used == self._used()
        assert self.tier.pinned_used == self._pinned_used()

    @invariant()
    def same_contents_and_order(self) -> None:
        assert len(self.tier) == len(self.values)
        assert self.tier.keys_by_recency() == self.order
        assert self.tier.pinned == frozenset(self.pins)


TestMemoryTier = MemoryTierMachine.TestCase
TestMemoryTier.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_value_larger_than_budget_is_bypassed() -> None:
    tier = MemoryTier(10)
    assert not tier.put("big", b"x" * 11)
    assert tier.bypassed == 1
    assert tier.get("big") is None
    assert tier.used == 0


def test_eviction_counts() -> None:
    tier = MemoryTier(10)
    for i in range(5):
        tier.put(f"k{i}", b"x" * 4)
    assert tier.evictions == 3
    assert tier.keys_by_recency() == ["k3", "k4"]
