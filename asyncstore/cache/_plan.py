"""Plan-aware eviction: evict the entry whose next use lies farthest ahead.

Recency (LRU) thrashes when a dataset larger than the cache is read every epoch: by the time
a sample comes back it has been evicted. A training job knows its future reads, though: the
epoch plan. Given the upcoming order of keys, this tier applies Belady's rule — evict the
entry needed farthest in the future — and does not admit an entry that would itself be the
first to go, which for equal-sized entries is the offline optimum (Belady, "A study of
replacement algorithms for a virtual-storage computer", IBM Systems Journal, 1966).

The plan may be given in pieces (``extend``), so a plan of ten million keys never needs to
sit in memory at once; keys beyond what is known count as "not needed again".
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence

_NEVER = float("inf")


class PlanTier:
    """A byte-budgeted map that evicts by next use in a known plan of keys.

    Same interface as :class:`~asyncstore.cache._memory.MemoryTier`, plus :meth:`extend`.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._values: dict[str, bytes] = {}
        self._pins: set[str] = set()
        # key -> its upcoming plan positions: one int (the common case, and no deque to
        # allocate per key), or a deque of them, ascending
        self._uses: dict[str, int | deque[int]] = {}
        self._planned = 0  # positions handed out so far
        # Max-heap of (-next use, tiebreak, key) over unpinned entries; stale items (whose
        # next use changed or whose key left) are skipped when popped. None until an
        # eviction needs it: while everything fits (a dataset the tier holds), a hit only
        # records the key's next use.
        self._heap: list[tuple[float, int, str]] | None = None
        self._next: dict[str, float] = {}  # unpinned entry -> its next use
        self._tiebreak = 0
        self.used = 0
        self.pinned_used = 0
        self.evictions = 0
        self.bypassed = 0

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    # -- the plan ----------------------------------------------------------------------------

    def extend(self, keys: Iterable[str]) -> None:
        """Append ``keys`` to the plan of upcoming reads."""
        values, pins, known, next_use = self._values, self._pins, self._uses, self._next
        for key in keys:
            uses = known.get(key)
            if uses is None:
                known[key] = first = self._planned
            elif isinstance(uses, int):
                known[key] = deque((uses, self._planned))
                first = uses
            else:
                uses.append(self._planned)
                first = uses[0]
            self._planned += 1
            if key in values and key not in pins and next_use[key] == _NEVER:
                if self._heap is None:
                    next_use[key] = first  # no eviction order to keep: just note it
                else:
                    self._schedule(key)

    def _next_use(self, key: str) -> float:
        uses = self._uses.get(key)
        return _NEVER if uses is None else uses if isinstance(uses, int) else uses[0]

    def _consume(self, key: str) -> float:
        # A read of ``key``: its nearest planned use is done; returns the next one.
        uses = self._uses.get(key)
        if uses is None:
            return _NEVER
        if isinstance(uses, int):
            del self._uses[key]
            return _NEVER
        uses.popleft()
        if len(uses) > 1:
            return uses[0]
        self._uses[key] = left = uses[0]
        return left

    def _schedule(self, key: str) -> None:
        when = self._next_use(key)
        if self._next.get(key) == when and key in self._values:
            return  # its heap item is still current
        self._next[key] = when
        heap = self._heap
        if heap is None:
            return
        self._tiebreak += 1
        heapq.heappush(heap, (-when, self._tiebreak, key))
        if len(heap) > 2 * len(self._values) + 64:
            # Stale items pile up between evictions on a hit-heavy run: drop them all; the
            # next eviction rebuilds the heap from the current next uses.
            self._heap = None

    def _order(self) -> list[tuple[float, int, str]]:
        # The heap, built from the entries' next uses if no eviction has needed it since
        # it was last dropped (O(entries), once, then O(log entries) a change).
        heap = self._heap
        if heap is None:
            first = self._tiebreak
            heap = [(-when, first + i, key) for i, (key, when) in enumerate(self._next.items())]
            heapq.heapify(heap)
            self._tiebreak = first + len(heap)
            self._heap = heap
        return heap

    def _farthest(self) -> str | None:
        heap = self._order()
        while heap:
            negative, _, key = heap[0]
            if key in self._values and key not in self._pins and self._next.get(key) == -negative:
                return key
            heapq.heappop(heap)
        return None

    # -- the map -----------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The value, or ``None``; a hit consumes the key's nearest planned use."""
        value = self._values.get(key)
        then = self._consume(key)  # this read is the key's nearest planned use
        if value is not None and key not in self._pins:
            if self._heap is None:
                self._next[key] = then  # no eviction order to keep
            else:
                self._schedule(key)
        return value

    def get_run(self, keys: Sequence[str], start: int, stop: int) -> list[bytes]:
        """The values of ``keys[start:stop]`` up to the first one absent, each consuming its
        key's nearest planned use as :meth:`get` does: one call for a run of hits. The
        absent key's use is left for the read that fetches it. An unhashable key (no key at
        all) ends the run too."""
        values, planned, pins, next_use = self._values, self._uses, self._pins, self._next
        out: list[bytes] = []
        try:
            for index in range(start, stop):
                key = keys[index]
                value = values.get(key)
                if value is None:
                    break
                if type(planned.get(key)) is int:  # its only planned use: the common case
                    del planned[key]
                    then = _NEVER
                else:
                    then = self._consume(key)
                if key not in pins:
                    if self._heap is None:
                        next_use[key] = then
                    else:
                        self._schedule(key)
                out.append(value)
        except TypeError:
            pass
        return out

    def put(self, key: str, value: bytes) -> bool:
        """Insert ``key`` unless it would be the first entry to be evicted; False if not."""
        size = len(value)
        self.discard(key)
        pinned = key in self._pins
        if self.pinned_used + size > self.budget:
            self.bypassed += 1
            return False
        mine = self._next_use(key)
        victims: list[str] = []
        free = self.budget - self.used
        # Choose victims farthest-first without evicting yet: if the new entry is needed
        # later than some victim would be, keeping the cache as it is was better.
        skipped: list[tuple[float, int, str]] = []
        while free < size:
            victim = self._farthest()
            if victim is None:
                break
            entry = heapq.heappop(self._order())
            if not pinned and self._next[victim] <= mine:
                skipped.append(entry)
                break
            skipped.append(entry)
            victims.append(victim)
            free += len(self._values[victim])
        if free < size:
            for entry in skipped:
                heapq.heappush(self._order(), entry)
            self.bypassed += 1
            return False
        for victim in victims:
            old = self._values.pop(victim)
            self._next.pop(victim, None)
            self.used -= len(old)
            self.evictions += 1
        for entry in skipped:
            if entry[2] not in victims:
                heapq.heappush(self._order(), entry)
        self._values[key] = value
        self.used += size
        if pinned:
            self.pinned_used += size
        else:
            self._schedule(key)
        return True

    def discard(self, key: str) -> None:
        """Remove ``key`` if present."""
        value = self._values.pop(key, None)
        if value is not None:
            self.used -= len(value)
            if key in self._pins:
                self.pinned_used -= len(value)
            self._next.pop(key, None)

    def clear(self) -> None:
        """Remove every entry; the plan and pins stay."""
        self._values.clear()
        self._heap = None
        self._next.clear()
        self.used = self.pinned_used = 0

    def pin(self, keys: Iterable[str]) -> None:
        """Never evict ``keys`` (from now, or from when they arrive)."""
        for key in keys:
            if key not in self._pins:
                self._pins.add(key)
                if key in self._values:
                    self.pinned_used += len(self._values[key])
                    self._next.pop(key, None)

    def unpin(self, keys: Iterable[str]) -> None:
        """Let ``keys`` be evicted by next use again."""
        for key in keys:
            if key in self._pins:
                self._pins.discard(key)
                if key in self._values:
                    self.pinned_used -= len(self._values[key])
                    self._schedule(key)

    @property
    def pinned(self) -> frozenset[str]:
        """The keys currently pinned (cached or not)."""
        return frozenset(self._pins)

    def peek(self, key: str) -> bytes | None:
        """The value without consuming a planned use; ``None`` if absent."""
        return self._values.get(key)

    def keys(self) -> list[str]:
        """Every cached key, pinned ones included."""
        return list(self._values)

    def keys_by_recency(self) -> list[str]:
        """Cached keys (in no particular order: this tier does not track recency)."""
        return list(self._values)
