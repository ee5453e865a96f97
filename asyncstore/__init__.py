"""asyncstore: asyncio-first storage and caching for ML training.

Open a store by URL and move bytes::

    import asyncstore

    async with asyncstore.open_store("s3://bucket/datasets") as store:
        await store.put("train/00001.jpg", data)
        head = await store.get("train/00001.jpg", start=0, end=1024)
"""

from __future__ import annotations

import logging
import typing

# metrics: asyncstore.metrics.snapshot(), asyncstore.metrics.prometheus
from . import metrics as metrics

# prefetch
from ._prefetch import Prefetcher, PrefetchStats

# cache
from .cache import CacheStats, StoreFetchStats, TieredCache, TierStats

# errors
from .errors import (
    AsyncStoreError,
    IntegrityError,
    InvalidArgument,
    InvalidKey,
    InvalidURL,
    NotFound,
    PermissionDenied,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    UnsafeCheckpoint,
)

# stores
from .stores import (
    LocalConfig,
    LocalStore,
    MemoryStore,
    ObjectInfo,
    Reader,
    S3Config,
    S3Store,
    Store,
    Writer,
    open_store,
)

if typing.TYPE_CHECKING:
    from .checkpoint import Checkpointer, SaveHandle, SaveResult, load, save

__version__ = "0.1.0.dev0"

# The library logs through "asyncstore" and its children ("asyncstore.cache", ...) and never
# prints; without this, Python's last-resort handler would print its warnings to stderr in an
# application that configured no logging.
logging.getLogger("asyncstore").addHandler(logging.NullHandler())

__all__ = [
    # stores
    "open_store",
    "Store",
    "ObjectInfo",
    "Reader",
    "Writer",
    "MemoryStore",
    "LocalStore",
    "LocalConfig",
    "S3Store",
    "S3Config",
    # cache
    "TieredCache",
    "CacheStats",
    "TierStats",
    "StoreFetchStats",
    # prefetch
    "Prefetcher",
    "PrefetchStats",
    # errors
    "AsyncStoreError",
    "InvalidArgument",
    "InvalidKey",
    "InvalidURL",
    "NotFound",
    "PermissionDenied",
    "StoreUnavailable",
    "StoreError",
    "StoreClosed",
    "IntegrityError",
    "UnsafeCheckpoint",
    # checkpoints (imported on first use: they need torch)
    "save",
    "load",
    "SaveHandle",
    "SaveResult",
    "Checkpointer",
]

_LAZY = {"save", "load", "SaveHandle", "SaveResult", "Checkpointer"}


def __getattr__(name: str) -> object:
    # The checkpoint engine imports torch (seconds); pay for it only when it is used.
    if name in _LAZY:
        from . import checkpoint

        value = getattr(checkpoint, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'asyncstore' has no attribute {name!r}")


def _export() -> None:
    # Show public names where users meet them (reprs, tracebacks, docs): asyncstore.S3Store,
    # not asyncstore.stores.s3.S3Store. msgspec Structs keep their module: msgspec resolves
    # their annotations in it.
    import msgspec

    for name in __all__:
        if name in _LAZY:
            continue
        obj = globals()[name]
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
            continue
        if getattr(obj, "__module__", "").startswith("asyncstore."):
            obj.__module__ = "asyncstore"


_export()
