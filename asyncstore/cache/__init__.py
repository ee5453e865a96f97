"""The read path: the tiered cache (memory → local disk → store) and the lookahead
:class:`Prefetcher` over it."""

from ._disk import DiskRow, RowReader
from ._prefetch import Prefetcher, PrefetchStats, RowPrefetcher
from ._stats import CacheStats, StoreFetchStats, TierStats
from ._tiered import TieredCache
from ._usage import DiskUsage, clear_disk, disk_usage

__all__ = [
    "TieredCache",
    "CacheStats",
    "TierStats",
    "StoreFetchStats",
    "Prefetcher",
    "PrefetchStats",
    # a disk tier's directory, seen from outside (`asyncstore cache`)
    "disk_usage",
    "clear_disk",
    "DiskUsage",
    # warm disk-tier reads on a consumer's thread (StreamingDataset's)
    "RowPrefetcher",
    "DiskRow",
    "RowReader",
]
