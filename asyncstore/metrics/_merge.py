"""Adding up two snapshots of one kind of figures: the same component counted in two
processes, or one DataLoader worker's figures across its restarts.

Counters and histograms add up and ratios are computed again from the sums; a gauge or a
percentile (a tier switched off, the current depth, recent latencies) is the newer
snapshot's, ``b``, unless ``b`` has seen nothing it could be taken over.
"""

from __future__ import annotations

from ..cache import CacheStats, PrefetchStats, StoreFetchStats, TierStats
from ..stores import RequestStats, StoreStats

__all__ = ["add_cache", "add_prefetch", "add_store"]


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _requests(a: RequestStats, b: RequestStats) -> RequestStats:
    return RequestStats(
        requests=a.requests + b.requests,
        errors=a.errors + b.errors,
        bytes=a.bytes + b.bytes,
        seconds=a.seconds + b.seconds,
        buckets=[x + y for x, y in zip(a.buckets, b.buckets, strict=True)],
    )


def add_store(a: StoreStats, b: StoreStats) -> StoreStats:
    """``a`` and ``b`` together: every request counter and histogram bucket summed."""
    return StoreStats(
        get=_requests(a.get, b.get),
        put=_requests(a.put, b.put),
        stat=_requests(a.stat, b.stat),
        delete=_requests(a.delete, b.delete),
        latency_buckets=b.latency_buckets,
    )


def _tier(a: TierStats, b: TierStats) -> TierStats:
    return TierStats(
        hits=a.hits + b.hits,
        misses=a.misses + b.misses,
        bytes_served=a.bytes_served + b.bytes_served,
        evictions=a.evictions + b.evictions,
        corrupt=a.corrupt + b.corrupt,
        bypassed=a.bypassed + b.bypassed,
        errors=a.errors + b.errors,
        enabled=b.enabled,
    )


def add_cache(a: CacheStats, b: CacheStats) -> CacheStats:
    """``a`` and ``b`` together: counters summed, ``hit_rate`` from the sums, the store
    latency percentiles of ``b`` (of ``a`` if ``b`` fetched nothing)."""
    memory, disk = _tier(a.memory, b.memory), _tier(a.disk, b.disk)
    recent = b.store if b.store.fetches else a.store
    store = StoreFetchStats(
        fetches=a.store.fetches + b.store.fetches,
        bytes=a.store.bytes + b.store.bytes,
        revalidations=a.store.revalidations + b.store.revalidations,
        latency_p50=recent.latency_p50,
        latency_p95=recent.latency_p95,
        latency_p99=recent.latency_p99,
    )
    # As TieredCache.stats() computes it: every read asks the memory tier first.
    hit_rate = _share(memory.hits + disk.hits, memory.hits + memory.misses)
    return CacheStats(
        gets=a.gets + b.gets, hit_rate=hit_rate, memory=memory, disk=disk, store=store
    )


def add_prefetch(a: PrefetchStats, b: PrefetchStats) -> PrefetchStats:
    """``a`` and ``b`` together: counters summed, ``stall_fraction`` and ``accuracy`` from
    the sums, the wait percentiles of ``b`` (of ``a`` if ``b`` yielded nothing) and the depth
    of ``b``."""
    items, skipped, fetched = a.items + b.items, a.skipped + b.skipped, a.fetched + b.fetched
    stalls = a.stalls + b.stalls
    recent = b if b.items else a
    return PrefetchStats(
        items=items,
        skipped=skipped,
        fetched=fetched,
        stalls=stalls,
        stall_fraction=_share(stalls, items),
        wait_seconds=a.wait_seconds + b.wait_seconds,
        wait_p50=recent.wait_p50,
        wait_p95=recent.wait_p95,
        wait_p99=recent.wait_p99,
        accuracy=_share(items + skipped, fetched),
        depth=b.depth,
    )
