"""Plan-aware eviction: evict the entry whose next use lies farthest ahead.

Recency (LRU) thrashes when a dataset larger than the cache is read every epoch: by the time
a sample comes back it has been evicted. A training job knows its future reads, though: the
epoch plan. Given the upcoming order of keys, this tier applies Belady's rule — evict the
entry needed farthest in the future — and does not admit an entry that would itself be the
first to go, which for equal-sized entries is the offline optimum (Belady, "A study of
replacement algorithms for a virtual-storage computer", IBM Systems Journal, 1966).

The plan may be given in pieces (``extend``), so a plan of ten million keys never needs to
sit in memory at once; keys beyond what is known count as "not needed again".

Next uses matter only to choose what to evict. Until an eviction needs them, the tier keeps
the plan as a list and the reads that follow it as a position in that list: a warm epoch
over a dataset the tier holds costs a list extension per piece of plan and a comparison per
read, where a map of each key's upcoming uses cost several dictionary operations per key and
per read (a third of the prefetcher's work per sample). The first read out of the plan's
order, or the first eviction, builds the map from the rest of the list; the list comes back
once every planned use has been read.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import cast

_NEVER = float("inf")

# Read keys at the head of the lazy plan list dropped once they are this many and half of it.
_COMPACT = 4096


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
        self._planned = 0  # positions handed out so far (while uses are mapped)
        # Until next uses are needed: the plan as a list, read in order from _cursor on
        # (every use before it was read in the plan's order); _uses is empty meanwhile.
        self._lazy = True
        self._log: list[str] = []
        self._cursor = 0
        self._base = 0  # plan position of _log[0]
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
        if not self._lazy and not self._uses:
            self._unmap()  # every planned use was read: back to the list
        if self._lazy:
            log, cursor = self._log, self._cursor
            if cursor >= _COMPACT and cursor * 2 >= len(log):
                del log[:cursor]  # what was read, dropped now and then (amortised O(1))
                self._base += cursor
                self._cursor = 0
            log.extend(keys)
            return
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

    def _map(self) -> None:
        # Next uses are needed (an eviction, a read out of the plan's order): map each key
        # to its upcoming uses from the unread part of the list, and each entry to its next.
        uses: dict[str, int | deque[int]] = {}
        position = self._base + self._cursor
        for key in islice(self._log, self._cursor, None):
            known = uses.get(key)
            if known is None:
                uses[key] = position
            elif isinstance(known, int):
                uses[key] = deque((known, position))
            else:
                known.append(position)
            position += 1
        self._uses, self._planned = uses, position
        self._lazy, self._log, self._cursor = False, [], 0
        pins = self._pins
        self._next = {key: self._next_use(key) for key in self._values if key not in pins}
        self._heap = None  # built from _next when an eviction needs it

    def _unmap(self) -> None:
        # No planned use is left to read: keep the plan as a list again.
        self._lazy, self._log, self._cursor, self._base = True, [], 0, self._planned
        self._next.clear()
        self._heap = None

    def _follows(self, key: str) -> bool:
        # While lazy: does this read follow the plan (the next unread key, or nothing is
        # planned ahead)? Moves past it if so; False means the uses must be mapped.
        cursor = self._cursor
        if cursor == len(self._log):
            return True  # nothing planned ahead: a read consumes no use
        if self._log[cursor] == key:
            self._cursor = cursor + 1
            return True
        return False

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
        if self._lazy:
            return  # no next uses are kept: _map computes them
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
        if self._lazy:
            if self._follows(key):
                return value
            self._map()
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
        run = self._hits(keys, start, stop)
        self.use_run(keys[start : start + len(run)])
        return run

    def _hits(self, keys: Sequence[str], start: int, stop: int) -> list[bytes]:
        # The values of keys[start:stop] up to the first absent or unhashable key, in C loops.
        got: list[bytes | None]
        try:
            got = list(map(self._values.get, keys[start:stop]))
        except TypeError:  # an unhashable key: the run ends before it
            got = []
            for key in keys[start:stop]:
                try:
                    got.append(self._values.get(key))
                except TypeError:
                    break
        if None in got:
            del got[got.index(None) :]
        return cast("list[bytes]", got)

    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each of ``keys`` (``None`` where absent), consuming no planned use;
        see :meth:`use_run`.

        Raises:
            TypeError: a key is unhashable.
        """
        return list(map(self._values.get, keys))

    def use_run(self, keys: Sequence[str]) -> None:
        """Note reads of ``keys``, in order, hits and misses alike: each consumes its key's
        nearest planned use, as :meth:`get` does. One list comparison while the reads follow
        the plan as a list; else a loop over the keys without :meth:`get`'s calls."""
        if self._lazy:
            log, cursor = self._log, self._cursor
            follow = min(len(keys), len(log) - cursor)
            # Past the plan's end a read consumes no use (see _follows).
            if log[cursor : cursor + follow] == list(keys[:follow]):
                self._cursor = cursor + follow
                return
            for count, key in enumerate(keys):
                if not self._follows(key):
                    self._map()
                    keys = keys[count:]
                    break
            else:
                return
        values, planned, pins, next_use = self._values, self._uses, self._pins, self._next
        for key in keys:
            if type(uses := planned.get(key)) is int:  # its only planned use: the common case
                del planned[key]
                then = _NEVER
            elif uses is None:
                then = _NEVER
            else:
                then = self._consume(key)
            if key in values and key not in pins:
                if self._heap is None:
                    next_use[key] = then
                else:
                    self._schedule(key)

    def put(self, key: str, value: bytes) -> bool:
        """Insert ``key`` unless it would be the first entry to be evicted; False if not."""
        size = len(value)
        if self._refused_at_once(key, size):
            # Not planned again, and no room: refused at once (see below), the common case of
            # a warm epoch's reads from the disk tier.
            self.bypassed += 1
            return False
        return self._insert(key, value, size)

    def _insert(self, key: str, value: bytes, size: int) -> bool:
        # put() for an entry not refused at once.
        self.discard(key)
        pinned = key in self._pins
        if self.pinned_used + size > self.budget:
            self.bypassed += 1
            return False
        if self._lazy:
            if self.used + size <= self.budget:  # no eviction: no next use is needed
                self._values[key] = value
                self.used += size
                if pinned:
                    self.pinned_used += size
                return True
            self._map()
        mine = self._next_use(key)
        if mine == _NEVER and not pinned and self.used + size > self.budget:
            # Not planned again: it would be the first to go (ties keep what is there), so
            # the eviction order is not consulted. The common case of a warm epoch read from
            # the disk tier, whose hits are read once an epoch: bringing the order up to
            # date for each (built anew after every stretch of hits, stale items dropped)
            # was a quarter of the loop's cache work. The same decision for this entry;
            # later ties between entries of one next use may break otherwise than they
            # would have (the eviction rule allows either).
            self.bypassed += 1
            return False
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
            if victim in victims:
                # A second item of one entry (put back with the same next use after a
                # discard): stale, dropped.
                continue
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

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> int:
        """:meth:`put` each of ``items`` (key, value), in order; returns how many it
        refused. An entry refused at once (no room, not planned again: a warm epoch's
        reads from the disk tier, most of them) costs a few lookups here, not a call."""
        refused = at_once = 0
        at_once_test, insert = self._refused_at_once, self._insert
        for key, value in items:
            size = len(value)
            if at_once_test(key, size):
                at_once += 1
            elif not insert(key, value, size):
                refused += 1
        self.bypassed += at_once
        return refused + at_once

    def _refused_at_once(self, key: str, size: int) -> bool:
        # No room for ``size`` more bytes and ``key`` neither planned, held nor pinned: the
        # entry would be the first to go (see put).
        return (
            not self._lazy
            and self.used + size > self.budget
            and key not in self._uses
            and key not in self._values
            and key not in self._pins
        )

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
