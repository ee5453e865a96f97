"""What some stores can do beyond :class:`~asyncstore.stores.Store`, as Protocols.

Code above the store layer (the checkpoint engine, the dataset) asks a store for a capability
with ``isinstance(store, Capability)`` and never checks for a concrete store class, so a new
store gains a behaviour by implementing its methods. Each Protocol's methods have names no
other store method shares, which is what a runtime ``isinstance`` check can see.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ._base import Writer
from ._streams import Loan

__all__ = ["CleansUpWrites", "CheckedUploads", "LentWrites", "LocalFiles", "PinnedReads"]


@runtime_checkable
class CleansUpWrites(Protocol):
    """A store whose killed writers can leave data behind (temp files, multipart uploads)
    that a later writer of the same key should remove first (local and S3 stores)."""

    async def clean_up_writes(self, key: str) -> int:
        """Remove what writers of ``key`` killed mid-write left; returns how many items were
        removed. Live writers' data is left alone."""
        ...

    async def abandoned_writes(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` that unfinished writes left something for (local
        stores: in ``prefix``'s directory, temporary files no live writer holds; S3: keys
        with unfinished multipart uploads, which S3 cannot tell live from killed)."""
        ...


@runtime_checkable
class LocalFiles(Protocol):
    """A store whose objects are regular files on this machine (the local store): readers
    may map or ``pread`` them directly, and writers may go around the page cache."""

    def local_path(self, key: str) -> str:
        """The file's path.

        Raises:
            PermissionDenied: the key leads outside the store's directory (a symlink).
        """
        ...

    def open_local_file(self, key: str) -> int:
        """Open the regular file at ``key`` for reading and return its descriptor (the
        caller closes it). Blocking: call it from a worker thread.

        Raises:
            NotFound: nothing, a directory, or a FIFO, socket or device is at the key.
            PermissionDenied: the key leads outside the store's directory.
            OSError: any other failure; :meth:`local_error` says what it means.
        """
        ...

    def local_error(self, exc: OSError, key: str, doing: str) -> Exception:
        """The asyncstore error for ``exc``, raised while ``doing`` (``"read"``…) ``key``."""
        ...

    def open_direct_writer(self, key: str) -> Writer:
        """A writer for a large object written once (a checkpoint) that goes around the
        page cache where the file system allows it; see :meth:`LocalStore.open_writer`."""
        ...


@runtime_checkable
class PinnedReads(Protocol):
    """A store that can read a range of one version of an object and refuse any other
    (S3's ``If-Match``): a reader of several ranges never mixes two versions."""

    async def get_pinned(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        """Bytes ``[start, end)`` of exactly the version ``etag`` (from ``stat``).

        Raises:
            StoreError: the object was replaced since (its ETag changed).
        """
        ...

    async def get_pinned_into(
        self, key: str, start: int, out: list[memoryview], etag: str | None
    ) -> None:
        """As :meth:`get_pinned` from ``start``, into ``out`` (views whose lengths add up to
        the range) as the bytes arrive: no copy of the whole range in between.

        Raises:
            StoreError: the object was replaced since (its ETag changed).
        """
        ...


@runtime_checkable
class CheckedUploads(Protocol):
    """A writer whose server checks what it stores against what was sent, without reading it
    back (S3 writers: each part goes with its CRC32C, which the server verifies before
    storing it and returns; a part damaged on the way is refused and sent again)."""

    @property
    def server_checked(self) -> bool:
        """After the commit: whether the server confirmed the checksum of every part sent.
        ``False`` before the commit, for a server that ignores checksums, or with
        ``checksum=None``: read the object back to be sure."""
        ...


@runtime_checkable
class LentWrites(Protocol):
    """A writer that can take memory lent to it instead of copying it (every writer of the
    built-in stores; S3 writers keep views of lent bytes in the parts they send).

    The checkpoint engine lends its staging slabs this way: each slab goes back to the pool
    once the parts holding views of it are sent.
    """

    async def write_lent(self, data: memoryview, loan: Loan) -> None:
        """Append ``data``, which its owner keeps unchanged until ``loan`` is returned; the
        writer retains ``loan`` for as long as it holds a view of ``data``."""
        ...

    def unlend(self) -> None:
        """Copy the lent bytes held for a part not yet full and let go of their loans (an
        owner short of memory asks this; views of parts being sent are kept until sent)."""
        ...
