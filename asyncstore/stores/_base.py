"""The store contract: :class:`Store`, :class:`ObjectInfo`, readers and writers.

Concrete stores subclass :class:`BaseStore`, which validates every argument once, here, and
then calls the store's ``_get``/``_put``/… with clean values. That keeps the rules (key syntax,
ranges, closed stores) identical across stores and out of each implementation.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Literal, Protocol, Self, runtime_checkable

import anyio
import msgspec

from .._concurrency import shield
from .._resource import AsyncResource
from ..errors import InvalidArgument, StoreClosed, StoreError
from ._keys import check_key, check_prefix, check_range
from ._stats import Requests, StoreStats

DEFAULT_CHUNK_BYTES = 1 << 20
"""Reader chunk size: 1 MiB amortises the per-chunk await and thread hop while keeping the
memory a slow consumer pins small."""

# Closing a writer (abort or commit) must finish even when the caller is being cancelled,
# otherwise a cancelled save would leave a temp file or an open multipart upload behind. This
# bounds how long that shielded cleanup may take.
CLEANUP_TIMEOUT = 30.0


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


class BaseStore(AsyncResource, abc.ABC):
    """Shared half of every store: argument checks, closing, context management.

    A store may be used without ``async with``: its first call opens it (connections are
    made lazily), and :meth:`aclose` releases what it opened.
    """

    _reopen_hint = "open a new store with open_store()"
    _unclosed_hint = "use 'async with open_store(...)' or await aclose()"

    def __init__(self, url: str) -> None:
        self._url = url.rstrip("/")
        self._req_get, self._req_put, self._req_stat, self._req_delete = (
            Requests() for _ in range(4)
        )

    def stats(self) -> StoreStats:
        """A snapshot of the store's request figures: counts, errors, bytes and latency
        histograms of ``get``, ``put``, ``stat`` and ``delete``."""
        return StoreStats(
            get=self._req_get.snapshot(),
            put=self._req_put.snapshot(),
            stat=self._req_stat.snapshot(),
            delete=self._req_delete.snapshot(),
        )

    @property
    def url(self) -> str:
        """The store's root URL, without credentials."""
        return self._url

    @property
    def identity(self) -> str:
        """See :attr:`Store.identity`; the root URL unless a store needs more."""
        return self._url

    @property
    def remote(self) -> bool:
        """See :attr:`Store.remote`; ``False`` unless the store says otherwise."""
        return False

    def reopen_args(self) -> tuple[str, dict[str, Any]]:
        """See :meth:`Store.reopen_args`; the URL and no options unless a store needs more."""
        return self._url, {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    def where(self, key: str) -> str:
        """The full URL of ``key``, for messages."""
        return f"{self._url}/{key}"

    def _resource_name(self) -> str:
        return self._url

    def _holds_resources(self) -> bool:
        return False  # stores that hold connections say so

    def _check_open(self) -> None:
        if self._state != "open":
            super()._check_open()
            self._state = "open"  # used without 'async with': aclose() still releases it

    # -- public API: validate, then delegate -------------------------------------------------

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """See :meth:`Store.get`."""
        self._check_open()
        key = check_key(key, self._url)
        first, last = check_range(start, end, self.where(key))
        # Timed here, once per call: two clock reads and a bisection (see _stats).
        started = time.perf_counter()
        try:
            data = await self._get(key, first, last)
        except Exception:
            self._req_get.errors += 1
            self._req_get.add(time.perf_counter() - started, 0)
            raise
        self._req_get.add(time.perf_counter() - started, len(data))
        return data

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        """See :meth:`Store.put`."""
        self._check_open()
        key = check_key(key, self._url)
        buffer = as_buffer(data, self.where(key))
        started = time.perf_counter()
        try:
            info = await self._put(key, buffer)
        except Exception:
            self._req_put.errors += 1
            self._req_put.add(time.perf_counter() - started, 0)
            raise
        self._req_put.add(time.perf_counter() - started, buffer.nbytes)
        return info

    async def stat(self, key: str) -> ObjectInfo:
        """See :meth:`Store.stat`."""
        self._check_open()
        key = check_key(key, self._url)
        started = time.perf_counter()
        try:
            info = await self._stat(key)
        except Exception:
            self._req_stat.errors += 1
            self._req_stat.add(time.perf_counter() - started, 0)
            raise
        self._req_stat.add(time.perf_counter() - started, 0)
        return info

    async def delete(self, key: str) -> None:
        """See :meth:`Store.delete`."""
        self._check_open()
        key = check_key(key, self._url)
        started = time.perf_counter()
        try:
            await self._delete(key)
        except Exception:
            self._req_delete.errors += 1
            self._req_delete.add(time.perf_counter() - started, 0)
            raise
        self._req_delete.add(time.perf_counter() - started, 0)

    def list(self, prefix: str = "", *, start_after: str = "") -> AsyncIterator[ObjectInfo]:
        """See :meth:`Store.list`."""
        self._check_open()
        prefix = check_prefix(prefix, self._url)
        if not isinstance(start_after, str):
            raise InvalidArgument(
                f"start_after={start_after!r}: pass the last key already listed (a str), "
                "or '' to list from the start"
            )
        return self._list(prefix, start_after)

    def open_writer(self, key: str) -> BaseWriter:
        """See :meth:`Store.open_writer`."""
        self._check_open()
        return self._open_writer(check_key(key, self._url))

    def open_reader(self, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> BaseReader:
        """See :meth:`Store.open_reader`."""
        self._check_open()
        key = check_key(key, self._url)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise InvalidArgument(
                f"chunk_bytes={chunk_bytes!r} for {self.where(key)}: pass a positive number of "
                "bytes, for example 1 << 20"
            )
        return self._open_reader(key, chunk_bytes)

    async def __aenter__(self) -> Self:
        if self._state == "closed":
            raise self._closed_error()
        await self._on_open()  # connections eagerly, even if the store was used already
        self._state = "open"
        return self

    # -- what each store implements ----------------------------------------------------------

    @abc.abstractmethod
    async def _get(self, key: str, start: int, end: int | None) -> bytes: ...

    @abc.abstractmethod
    async def _put(self, key: str, data: memoryview) -> ObjectInfo: ...

    @abc.abstractmethod
    async def _stat(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    async def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _list(self, prefix: str, start_after: str) -> AsyncIterator[ObjectInfo]: ...

    @abc.abstractmethod
    def _open_writer(self, key: str) -> BaseWriter: ...

    @abc.abstractmethod
    def _open_reader(self, key: str, chunk_bytes: int) -> BaseReader: ...


class BaseWriter(AsyncResource, abc.ABC):
    """Shared half of every writer: state checks and commit-or-abort on exit.

    A writer is used once: ``new`` → ``open`` (its ``async with`` block) → ``closed``, either
    committed or aborted.
    """

    def __init__(self, store: BaseStore, key: str) -> None:
        self._store = store
        self._key = key
        self._written = 0
        self._outcome: Literal["committed", "aborted"] | None = None
        self._info: ObjectInfo | None = None
        self._failure: BaseException | None = None

    @property
    def key(self) -> str:
        """The key being written."""
        return self._key

    @property
    def bytes_written(self) -> int:
        """How many bytes :meth:`write` has accepted so far."""
        return self._written

    @property
    def info(self) -> ObjectInfo | None:
        """The committed object's info after a clean exit, ``None`` before."""
        return self._info

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._store.where(self._key)} {self._status()}>"

    def _status(self) -> str:
        return self._outcome or self._state

    def _resource_name(self) -> str:
        return f"writer for {self._store.where(self._key)}"

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise StoreClosed(f"{self._resource_name()} was already used")
        self._store._check_open()
        self._state = "open"
        try:
            await self._begin()
        except BaseException:
            self._finish("aborted")
            await self.abort_now()
            raise
        return self

    def _finish(self, outcome: Literal["committed", "aborted"]) -> None:
        self._state, self._outcome = "closed", outcome

    async def aclose(self) -> None:
        """Discard the write if its block is still open (nothing is committed under the key);
        harmless once the block has ended."""
        if self._state == "open":
            self._finish("aborted")
            await self.abort_now()
        elif self._state == "new":
            self._state = "closed"

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; the caller may reuse the buffer once this returns.

        Raises:
            StoreClosed: the writer is not open (use it inside ``async with``), or its store
                was closed meanwhile.
        """
        if self._state != "open":
            raise StoreClosed(
                f"{self._resource_name()} is {self._status()}; write inside its 'async with' block"
            )
        if self._store.closed:
            raise self._store_closed()
        view = as_buffer(data, self._store.where(self._key))
        if len(view):
            try:
                await self._write(view)
            except BaseException as exc:
                # Part of the data may be lost: the object must never be committed now, even
                # if the caller catches this and leaves the block cleanly.
                self._failure = exc
                raise
            self._written += len(view)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != "open":
            return
        if self._store.closed:
            # The owner closed the store while this writer was open: closing means "done with
            # it", so nothing may appear under the key afterwards.
            self._finish("aborted")
            await self.abort_now()
            if exc_type is None:
                raise self._store_closed()
            return
        if exc_type is None and self._failure is not None:
            self._finish("aborted")
            await self.abort_now()
            raise StoreError(
                f"nothing was written to {self._store.where(self._key)}: an earlier write "
                f"failed ({type(self._failure).__name__}: {self._failure})"
            ) from self._failure
        if exc_type is None:
            try:
                self._info = await self._commit()
            except BaseException:
                self._finish("aborted")
                await self.abort_now()
                raise
            self._finish("committed")
        else:
            self._finish("aborted")
            await self.abort_now()

    def _store_closed(self) -> StoreClosed:
        return StoreClosed(
            f"nothing was written to {self._store.where(self._key)}: its store was closed "
            "while the writer was open; close the store only after its writers"
        )

    async def abort_now(self) -> None:
        """Remove every trace of this write (temp file, unfinished multipart upload), within
        ``CLEANUP_TIMEOUT`` seconds; the writer's block then commits nothing.

        Shielded: cancellation, the usual reason for an abort, cannot stop the cleanup
        halfway. Harmless on a writer already clean.
        """
        await shield(self._bounded_abort())

    async def _bounded_abort(self) -> None:
        with anyio.move_on_after(CLEANUP_TIMEOUT):
            await self._abort()

    async def _begin(self) -> None:
        """Prepare the write (open a temp file, …)."""

    @abc.abstractmethod
    async def _write(self, data: memoryview) -> None: ...

    @abc.abstractmethod
    async def _commit(self) -> ObjectInfo: ...

    @abc.abstractmethod
    async def _abort(self) -> None:
        """Remove every trace of the write; must not raise for an already-clean state."""


class BaseReader(AsyncResource, abc.ABC):
    """Shared half of every reader: lazy open, iteration, idempotent close."""

    _reopen_hint = "open a new reader with open_reader()"
    _unclosed_hint = "use it in 'async with' or iterate it to the end"

    def __init__(self, store: BaseStore, key: str, chunk_bytes: int) -> None:
        self._store = store
        self._key = key
        self._chunk_bytes = chunk_bytes
        self._info: ObjectInfo | None = None

    @property
    def info(self) -> ObjectInfo | None:
        """The object's info once the read has started, ``None`` before."""
        return self._info

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._store.where(self._key)} {self._state}>"

    def _resource_name(self) -> str:
        return f"reader for {self._store.where(self._key)}"

    async def _on_open(self) -> None:
        self._store._check_open()
        self._info = await self._open()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        await self._ensure_open()
        try:
            chunk = await self._read(self._chunk_bytes)
        except BaseException:
            await self.aclose()
            raise
        if not chunk:
            await self.aclose()
            raise StopAsyncIteration
        return chunk

    @abc.abstractmethod
    async def _open(self) -> ObjectInfo: ...

    @abc.abstractmethod
    async def _read(self, size: int) -> bytes:
        """Return up to ``size`` bytes (exactly ``size`` unless at the end), ``b""`` at the end."""

    async def _on_close(self) -> None:
        """Release the file or connection."""
