"""The memory tier: a hard byte budget over immutable ``bytes`` values.

Values are stored and returned as the same ``bytes`` objects, so a hit copies nothing. Every
operation is O(1): recency lives in an ``OrderedDict`` (oldest first), and pinned entries sit
in a dict of their own, outside the recency order, so eviction never has to skip over them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class MemoryTier:
    """A least-recently-used map from keys to bytes under a byte budget.

    Not thread-safe and not async: every method runs to completion without yielding, which is
    what makes a hit cost microseconds. Callers on one event loop need no lock.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._lru: OrderedDict[str, bytes] = OrderedDict()
        self._pinned: dict[str, bytes] = {}
        self._pins: set[str] = set()
        self.used = 0
        self.pinned_used = 0
        self.evictions = 0
        self.bypassed = 0

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._lru or key in self._pinned

    def get(self, key: str) -> bytes | None:
        """The value, marked most recently used; ``None`` if absent."""
        value = self._lru.get(key)
        if value is not None:
            self._lru.move_to_end(key)
            return value
        return self._pinned.get(key)

    def get_run(self, keys: Sequence[str], start: int, stop: int) -> list[bytes]:
        """The values of ``keys[start:stop]`` up to the first one absent, each marked most
        recently used as :meth:`get` marks it: one call for a run of hits. An unhashable
        key (no key at all) ends the run too."""
        lru, pinned, out = self._lru, self._pinned, []
        try:
            for index in range(start, stop):
                key = keys[index]
                value = lru.get(key)
                if value is not None:
                    lru.move_to_end(key)
                elif (value := pinned.get(key)) is None:
                    break
                out.append(value)
        except TypeError:
            pass
        return out

    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each of ``keys`` (``None`` where absent), marking nothing used; see
        :meth:`use_run`.

        Raises:
            TypeError: a key is unhashable.
        """
        found = list(map(self._lru.get, keys))
        if self._pinned and None in found:
            pinned = self._pinned
            found = [
                pinned.get(key) if value is None else value
                for key, value in zip(keys, found, strict=True)
            ]
        return found

    def use_run(self, keys: Sequence[str]) -> None:
        """Note reads of ``keys``, in order, hits and misses alike, as :meth:`get` notes
        each: the hits are marked most recently used."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def put(self, key: str, value: bytes) -> bool:
        """Insert or replace ``key``; evict least recently used entries to stay in budget.

        Returns False (and stores nothing) when the value cannot fit beside the pinned
        entries, which are never evicted to make room.
        """
        size = len(value)
        self.discard(key)
        if self.pinned_used + size > self.budget:
            self.bypassed += 1
            return False
        # Unpinned bytes are used - pinned_used, so this loop always makes enough room.
        while self.used + size > self.budget:
            _, old = self._lru.popitem(last=False)
            self.used -= len(old)
            self.evictions += 1
        if key in self._pins:
            self._pinned[key] = value
            self.pinned_used += size
        else:
            self._lru[key] = value
        self.used += size
        return True

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> int:
        """:meth:`put` each of ``items`` (key, value), in order; returns how many it
        refused."""
        put = self.put
        return sum(not put(key, value) for key, value in items)

    def discard(self, key: str) -> None:
        """Remove ``key`` if present (pins stay: a pinned key re-inserted is pinned again)."""
        value = self._lru.pop(key, None)
        if value is None:
            value = self._pinned.pop(key, None)
            if value is not None:
                self.pinned_used -= len(value)
        if value is not None:
            self.used -= len(value)

    def clear(self) -> None:
        """Remove every entry; pins stay."""
        self._lru.clear()
        self._pinned.clear()
        self.used = self.pinned_used = 0

    def pin(self, keys: Iterable[str]) -> None:
        """Keep ``keys`` regardless of recency, from now or from when they arrive."""
        for key in keys:
            self._pins.add(key)
            value = self._lru.pop(key, None)
            if value is not None:
                self._pinned[key] = value
                self.pinned_used += len(value)

    def unpin(self, keys: Iterable[str]) -> None:
        """Return ``keys`` to normal recency order (as most recently used)."""
        for key in keys:
            self._pins.discard(key)
            value = self._pinned.pop(key, None)
            if value is not None:
                self._lru[key] = value
                self.pinned_used -= len(value)

    @property
    def pinned(self) -> frozenset[str]:
        """The keys currently pinned (cached or not)."""
        return frozenset(self._pins)

    def peek(self, key: str) -> bytes | None:
        """The value without marking it used; ``None`` if absent."""
        value = self._lru.get(key)
        return value if value is not None else self._pinned.get(key)

    def keys(self) -> list[str]:
        """Every cached key, pinned ones included."""
        return [*self._lru, *self._pinned]

    def keys_by_recency(self) -> list[str]:
        """Unpinned keys, least recently used first (for tests and introspection)."""
        return list(self._lru)
