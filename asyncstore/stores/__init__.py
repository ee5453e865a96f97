"""Stores: bytes under keys, addressed by URL.

:func:`open_store` turns a URL into a store; every store implements :class:`Store`.
"""

from __future__ import annotations

import typing

from ._base import DEFAULT_CHUNK_BYTES, ObjectInfo, Reader, Store, Writer
from ._capabilities import CheckedUploads, CleansUpWrites, LocalFiles, PinnedReads
from ._open import open_store
from ._s3config import S3Config
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
]


def __getattr__(name: str) -> object:
    # The S3 store imports aiobotocore, botocore and aiohttp (a good part of a second):
    # paid for only by a program that uses it.
    if name == "S3Store":
        from .s3 import S3Store

        globals()[name] = S3Store
        return S3Store
    raise AttributeError(f"module 'asyncstore.stores' has no attribute {name!r}")
