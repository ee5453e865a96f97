"""The shared half of every store, :class:`BaseStore`: it validates every argument once,
here, then calls the store's ``_get``/``_put``/… with clean values. That keeps the rules (key
syntax, ranges, closed stores) identical across stores and out of each implementation, and
it counts every request's figures (:meth:`BaseStore.stats`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator
from typing import Any, Self

from .._resource import AsyncResource
from ..errors import InvalidArgument
from ._base import DEFAULT_CHUNK_BYTES, ObjectInfo, as_buffer
from ._keys import check_key, check_prefix, check_range
from ._stats import Requests, StoreStats
from ._streams import BaseReader, BaseWriter

__all__ = ["BaseStore"]


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
