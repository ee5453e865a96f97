"""Cache statistics: what each tier served, dropped and evicted, and store latency."""

from __future__ import annotations

from collections import deque
from itertools import repeat

import msgspec


class TierStats(msgspec.Struct):
    """Counters of one cache tier.

    Attributes:
        hits: reads this tier answered.
        misses: reads it could not answer (the next tier was asked).
        bytes_served: payload bytes returned from this tier.
        evictions: entries removed to make room.
        corrupt: entries found damaged (checksum, truncation) and dropped.
        bypassed: values not stored here because they could never fit.
        errors: I/O errors of this tier (the disk tier switches itself off at the first).
        enabled: False once the tier has switched itself off.
    """

    hits: int = 0
    misses: int = 0
    bytes_served: int = 0
    evictions: int = 0
    corrupt: int = 0
    bypassed: int = 0
    errors: int = 0
    enabled: bool = True


class StoreFetchStats(msgspec.Struct):
    """Requests that reached the store below the cache.

    Attributes:
        fetches: store reads (after single-flight merging).
        bytes: bytes fetched.
        revalidations: ``stat`` calls made by ``validate="etag"``.
        latency_p50, latency_p95, latency_p99: seconds, over the most recent fetches.
    """

    fetches: int = 0
    bytes: int = 0
    revalidations: int = 0
    latency_p50: float = 0.0
    latency_p95: float = 0.0
    latency_p99: float = 0.0


class CacheStats(msgspec.Struct):
    """A snapshot of a :class:`TieredCache`'s counters (``cache.stats()``).

    Attributes:
        gets: reads asked of the cache.
        hit_rate: the fraction of gets served by the memory or disk tier.
        memory, disk: per-tier counters.
        store: what reached the store.
    """

    gets: int
    hit_rate: float
    memory: TierStats
    disk: TierStats
    store: StoreFetchStats


class LatencyWindow:
    """The most recent ``size`` latencies, for percentiles that follow the current state."""

    def __init__(self, size: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        # The last percentiles, until a sample comes: a cache's stats() is taken at the
        # start and end of every epoch, and a warm epoch adds no store latency to sort.
        self._known: tuple[float, float, float] | None = (0.0, 0.0, 0.0)

    def add(self, seconds: float) -> None:
        """Record one sample."""
        self._samples.append(seconds)
        self._known = None

    def add_zeros(self, count: int) -> None:
        """Record ``count`` samples of no wait at all."""
        if count > 0:
            self._samples.extend(repeat(0.0, min(count, self._samples.maxlen or count)))
            self._known = None

    def percentiles(self) -> tuple[float, float, float]:
        """p50, p95 and p99 of the window (zeros when empty)."""
        if self._known is None:
            ordered = sorted(self._samples)
            last = len(ordered) - 1

            def at(q: float) -> float:
                return ordered[min(last, round(q * last))]

            self._known = (at(0.50), at(0.95), at(0.99))
        return self._known


def snapshot(
    gets: int,
    memory: tuple[TierStats, int, int],
    disk: tuple[TierStats, int | None],
    store: StoreFetchStats,
    latency: LatencyWindow,
) -> CacheStats:
    """A :class:`CacheStats` from a cache's live counters: the memory tier's (with its
    evictions and bypassed values), the disk tier's (evictions None while it is closed), the
    store's and its latency window; each copied, so later reads do not change it."""
    mem_counts, evictions, bypassed = memory
    mem = TierStats(
        hits=mem_counts.hits,
        misses=mem_counts.misses,
        bytes_served=mem_counts.bytes_served,
        evictions=evictions,
        corrupt=0,
        bypassed=bypassed,
    )
    disk_counts, disk_evictions = disk
    on_disk = TierStats(**{f: getattr(disk_counts, f) for f in TierStats.__struct_fields__})
    if disk_evictions is not None:
        on_disk.evictions = disk_evictions
    p50, p95, p99 = latency.percentiles()
    fetched = StoreFetchStats(
        fetches=store.fetches,
        bytes=store.bytes,
        revalidations=store.revalidations,
        latency_p50=p50,
        latency_p95=p95,
        latency_p99=p99,
    )
    lookups = mem.hits + mem.misses
    hit_rate = (mem.hits + on_disk.hits) / lookups if lookups else 0.0
    return CacheStats(gets=gets, hit_rate=hit_rate, memory=mem, disk=on_disk, store=fetched)
