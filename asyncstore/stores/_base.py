"""The store contract: :class:`Store`, :class:`ObjectInfo`, :class:`Reader` and
:class:`Writer`, and what every store accepts as bytes (:func:`as_buffer`).

The shared halves that implement it live beside it: :mod:`._basestore` (argument checks,
closing, figures) and :mod:`._streams` (the lifecycle of readers and writers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

import msgspec

from ..errors import InvalidArgument

DEFAULT_CHUNK_BYTES = 1 << 20
"""Reader chunk size: 1 MiB amortises the per-chunk await and thread hop while keeping the
memory a slow consumer pins small."""


class ObjectInfo(msgspec.Struct, frozen=True):
    """What a store knows about one object.

    Attributes:
        key: the key relative to the store's root, as passed to :meth:`Store.get`.
        size: the size in bytes.
        etag: an opaque version tag that changes when the object is overwritten (S3's ETag, a
            local file's inode, mtime and size, a hash for memory stores); ``None`` if unknown.
        mtime: last modification, in seconds since the Unix epoch; ``None`` if unknown.
    """

    key: str
    size: int
    etag: str | None = None
    mtime: float | None = None


def as_buffer(data: object, where: str) -> memoryview:
    """Return a flat byte view of ``data`` or raise :class:`InvalidArgument`.

    Anything exposing the buffer protocol works (bytes, bytearray, memoryview, numpy arrays);
    the view is cast to unsigned bytes so lengths are in bytes.
    """
    if isinstance(data, str):
        raise InvalidArgument(
            f"data for {where} is a str; stores hold bytes: encode it first, "
            "for example data.encode('utf-8')"
        )
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"data for {where} is a {type(data).__name__}, which is not a bytes-like object; "
            "pass bytes, bytearray, memoryview or another buffer"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(
            f"data for {where} is a non-contiguous buffer; make it contiguous first "
            "(for example bytes(data) or array.copy())"
        )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Writer(Protocol):
    """A streaming write to one key, returned by :meth:`Store.open_writer`.

    Use it as an async context manager: the object appears under its key, complete, when the
    block exits cleanly, and not at all if it raises or is cancelled.
    """

    @property
    def key(self) -> str:
        """The key being written."""
        ...

    @property
    def bytes_written(self) -> int:
        """How many bytes :meth:`write` has accepted so far."""
        ...

    @property
    def info(self) -> ObjectInfo | None:
        """The committed object's info after a clean exit, ``None`` before."""
        ...

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``. The buffer may be reused by the caller once this returns."""
        ...

    async def aclose(self) -> None:
        """Give up the write if its block is still open: nothing appears under the key, and
        its temp file or unfinished upload is removed. Harmless once the block has ended."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class Reader(Protocol):
    """A streaming read of one object, returned by :meth:`Store.open_reader`.

    An async iterator of ``bytes`` chunks that never holds the whole object. Use it in an
    ``async with`` block (or iterate it to the end) so that its connection or file is released
    promptly if the loop stops early.
    """

    @property
    def info(self) -> ObjectInfo | None:
        """The object's info once the read has started, ``None`` before."""
        ...

    def __aiter__(self) -> Self: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None:
        """Release the connection or file; further iteration raises :class:`StoreClosed`."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Store(Protocol):
    """Bytes under keys: the interface every asyncstore store implements.

    Keys are ``/``-separated paths relative to the store's root (the directory or bucket
    prefix in its URL). Stores are async context managers; :meth:`aclose` releases their
    connections. Open one with :func:`asyncstore.open_store`.
    """

    @property
    def url(self) -> str:
        """The store's root URL, without credentials."""
        ...

    @property
    def identity(self) -> str:
        """What tells this store's objects apart from every other store's, without credentials.

        Two stores with the same identity must hold the same object under the same key; two
        stores that may not must have different identities. A :class:`TieredCache` names and
        checks its disk entries by identity plus key, so stores sharing one cache directory
        never get each other's bytes. It is the root URL with its prefix, plus what the URL
        does not say: the endpoint of an S3 store, the process of a memory store.
        """
        ...

    @property
    def remote(self) -> bool:
        """Whether the store's bytes cross a network (an object store), rather than a local
        disk or memory: the checkpoint engine's ``compression="auto"`` assumes less
        bandwidth for remote stores and compresses more readily."""
        ...

    def reopen_args(self) -> tuple[str, dict[str, Any]]:
        """The URL (or path) and options with which :func:`open_store` opens this store
        again, for example in a DataLoader worker: no live client crosses a process
        boundary."""
        ...

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Return the object's bytes, or the range ``[start, end)`` of them.

        The range follows Python slicing: it is clipped to the object, so a range past the end
        returns fewer bytes (or ``b""``).

        Raises:
            NotFound: no object has this key.
            InvalidKey: the key is malformed.
            InvalidArgument: the range is negative or ``end < start``.
            StoreUnavailable: the store failed after every retry.
        """
        ...

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        """Store ``data`` under ``key``, replacing any object there, atomically.

        Readers see the old object or the new one, never a mix or a partial write.
        """
        ...

    async def stat(self, key: str) -> ObjectInfo:
        """Return the object's :class:`ObjectInfo`; raises :class:`NotFound` if it is missing."""
        ...

    async def delete(self, key: str) -> None:
        """Delete the object. Deleting a missing key is not an error (as in S3)."""
        ...

    def list(self, prefix: str = "", *, start_after: str = "") -> AsyncIterator[ObjectInfo]:
        """Yield every object whose key starts with ``prefix``, in lexicographic key order.

        Pages are fetched as the iteration goes, so memory stays constant whatever the count.
        ``start_after`` resumes an interrupted listing from the last key it yielded: only
        the keys after that one are listed (S3's ``StartAfter``). Local and memory stores
        also take any string there, in byte order; some S3-compatible servers (SeaweedFS)
        read a string that is not a key as a directory name.
        """
        ...

    def open_writer(self, key: str) -> Writer:
        """Return a :class:`Writer` that streams an object to ``key``; see :class:`Writer`."""
        ...

    def open_reader(self, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Reader:
        """Return a :class:`Reader` yielding the object in chunks of ``chunk_bytes`` bytes
        (the last one shorter)."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections; using it afterwards raises :class:`StoreClosed`."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
