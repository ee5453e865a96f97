"""Stores: bytes under keys, addressed by URL.

:func:`open_store` turns a URL into a store; every store implements :class:`Store`.
"""

from ._base import DEFAULT_CHUNK_BYTES, ObjectInfo, Reader, Store, Writer
from ._capabilities import CheckedUploads, CleansUpWrites, LocalFiles, PinnedReads
from ._open import open_store
from .local import LocalConfig, LocalStore
from .memory import MemoryStore, drop_memory_store
from .s3 import S3Config, S3Store

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
