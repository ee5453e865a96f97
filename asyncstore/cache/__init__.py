"""The tiered cache: memory → local disk → store."""

from ._stats import CacheStats, StoreFetchStats, TierStats
from ._tiered import TieredCache

__all__ = ["TieredCache", "CacheStats", "TierStats", "StoreFetchStats"]
