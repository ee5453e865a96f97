"""Stores: bytes under keys, addressed by URL.

:func:`open_store` turns a URL into a store; every store implements :class:`Store`.
"""

from __future__ import annotations

import typing

from ._base import DEFAULT_CHUNK_BYTES, ObjectInfo, Reader, Store, Writer
from ._capabilities import CheckedUploads, CleansUpWrites, LentWrites, LocalFiles, PinnedReads
from ._keys import MAX_KEY_BYTES, check_key, check_key_list, check_range
from ._open import is_local, local_path, open_store, options_from_text
from ._redact import redact
from ._s3config import S3Config
from ._stats import LATENCY_BUCKETS, RequestStats, StoreStats
from ._streams import Loan
from .local import LocalConfig, LocalStore
from .memory import MemoryStore, drop_memory_store

if typing.TYPE_CHECKING:
    from .s3 import S3Store

__all__ = [
    "open_store",
    "Store",
    "ObjectInfo",
    "Reader",
    "Writer",
    "CheckedUploads",
    "LentWrites",
    "Loan",
    "CleansUpWrites",
    "LocalFiles",
    "PinnedReads",
    "MemoryStore",
    "LocalStore",
    "LocalConfig",
    "S3Store",
    "S3Config",
    "drop_memory_store",
    "DEFAULT_CHUNK_BYTES",
    # what a store reports (`Store.stats()`)
    "StoreStats",
    "RequestStats",
    "LATENCY_BUCKETS",
    # the rules every store applies, for a custom store or a caller checking early
    "check_key",
    "check_key_list",
    "check_range",
    "MAX_KEY_BYTES",
    # URLs
    "is_local",
    "local_path",
    "options_from_text",
    "redact",
]


def __getattr__(name: str) -> object:
    # The S3 store imports aiobotocore, botocore and aiohttp (a good part of a second):
    # paid for only by a program that uses it.
    if name == "S3Store":
        from .s3 import S3Store

        globals()[name] = S3Store
        return S3Store
    raise AttributeError(f"module 'asyncstore.stores' has no attribute {name!r}")
