"""The read path: the tiered cache (memory → local disk → store) and the lookahead
:class:`Prefetcher` over it."""

from ._prefetch import Prefetcher, PrefetchStats
from ._stats import CacheStats, StoreFetchStats, TierStats
from ._tiered import TieredCache

__all__ = [
    "TieredCache",
    "CacheStats",
    "TierStats",
    "StoreFetchStats",
    "Prefetcher",
    "PrefetchStats",
]
