"""The offline optimum for caching equal-sized entries, to grade eviction policies against."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def belady_hits(keys: Sequence[str], capacity: int) -> int:
    """Hits of the optimal cache holding ``capacity`` equal-sized entries over ``keys``.

    Belady's rule with bypass: on a miss with a full cache, keep the new entry only if it is
    needed again before the resident entry needed farthest ahead, which it then replaces.
    """
    if capacity <= 0:
        return 0
    never = len(keys)
    next_use = [never] * len(keys)
    last_seen: dict[str, int] = {}
    for position in range(len(keys) - 1, -1, -1):
        next_use[position] = last_seen.get(keys[position], never)
        last_seen[keys[position]] = position
    resident: dict[str, int] = {}  # key -> its next use
    heap: list[tuple[int, str]] = []  # (-next use, key), stale items skipped
    hits = 0
    for position, key in enumerate(keys):
        upcoming = next_use[position]
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while -heap[0][0] != resident.get(heap[0][1], -1):
                heapq.heappop(heap)
            farthest, victim = -heap[0][0], heap[0][1]
            if farthest <= upcoming:
                continue  # the new entry would be the first to go: bypass it
            heapq.heappop(heap)
            del resident[victim]
        resident[key] = upcoming
        heapq.heappush(heap, (-upcoming, key))
    return hits
