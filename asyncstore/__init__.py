"""asyncstore: asyncio-first storage and caching for ML training.

Open a store by URL and move bytes::

    import asyncstore

    async with asyncstore.open_store("s3://bucket/datasets") as store:
        await store.put("train/00001.jpg", data)
        head = await store.get("train/00001.jpg", start=0, end=1024)
"""

from __future__ import annotations

import importlib
import logging
import typing

# the options of every save, as one object
from ._config import SaveConfig

# errors
from .errors import (
    AsyncStoreError,
    IntegrityError,
    InvalidArgument,
    InvalidKey,
    InvalidTarget,
    InvalidURL,
    NotFound,
    PermissionDenied,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    Unpicklable,
    UnsafeCheckpoint,
    Unsupported,
)

# stores
from .stores import (
    LocalConfig,
    LocalStore,
    MemoryStore,
    ObjectInfo,
    Reader,
    S3Config,
    Store,
    Writer,
    open_store,
)

# Imported on first use (see __getattr__ below): the cache, prefetch and metrics (most of
# the package's import time), the S3 store (aiobotocore, botocore, aiohttp) and the
# checkpoint engine (torch).
if typing.TYPE_CHECKING:
    # metrics: asyncstore.metrics.snapshot(), asyncstore.metrics.prometheus
    from . import metrics as metrics
    from .cache import (
        CacheStats,
        Prefetcher,
        PrefetchStats,
        StoreFetchStats,
        TieredCache,
        TierStats,
    )
    from .checkpoint import Checkpointer, SaveHandle, SaveResult, load, save
    from .stores.s3 import S3Store

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
    "InvalidTarget",
    "Unsupported",
    "Unpicklable",
    # checkpoints (imported on first use: they need torch)
    "save",
    "load",
    "SaveHandle",
    "SaveResult",
    "SaveConfig",
    "Checkpointer",
]

# Where each name imported on first use lives.
_LAZY = {
    "metrics": "",
    "Prefetcher": ".cache",
    "PrefetchStats": ".cache",
    "TieredCache": ".cache",
    "CacheStats": ".cache",
    "TierStats": ".cache",
    "StoreFetchStats": ".cache",
    "S3Store": ".stores.s3",
    "save": ".checkpoint",
    "load": ".checkpoint",
    "SaveHandle": ".checkpoint",
    "SaveResult": ".checkpoint",
    "Checkpointer": ".checkpoint",
}


def __getattr__(name: str) -> object:
    # A command line that lists a run should not wait for what it never uses: the
    # checkpoint engine imports torch (seconds), the S3 store aiobotocore, botocore and
    # aiohttp (most of a second), the cache and metrics most of the rest.
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncstore' has no attribute {name!r}")
    if home:
        value: object = getattr(importlib.import_module(home, __name__), name)
        if home == ".cache":
            _show_here(value)  # asyncstore.TieredCache, as before it was imported lazily
    else:
        value = importlib.import_module(f".{name}", __name__)
    globals()[name] = value
    return value


def _show_here(obj: object) -> None:
    # Show a public name where users meet it (reprs, tracebacks, docs): asyncstore.S3Store,
    # not asyncstore.stores.s3.S3Store. msgspec Structs keep their module: msgspec resolves
    # their annotations in it.
    import msgspec

    if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        return
    if getattr(obj, "__module__", "").startswith("asyncstore."):
        obj.__module__ = "asyncstore"


def _export() -> None:
    for name in __all__:
        if name not in _LAZY:
            _show_here(globals()[name])


_export()
