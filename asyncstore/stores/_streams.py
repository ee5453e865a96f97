"""The shared halves of every store's readers and writers: :class:`BaseWriter` commits or
aborts on leaving its block, :class:`BaseReader` opens lazily and closes once.

They need three things of their store (:class:`Owner`), so that they sit below it: the
store builds them, they never build a store.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from types import TracebackType
from typing import Literal, Protocol, Self

import anyio

from .._concurrency import shield
from .._resource import AsyncResource
from ..errors import InvalidArgument, StoreClosed, StoreError
from ._base import ObjectInfo, as_buffer

__all__ = ["CLEANUP_TIMEOUT", "BaseReader", "BaseWriter", "Loan", "Owner", "unchanging"]

# Closing a writer (abort or commit) must finish even when the caller is being cancelled,
# otherwise a cancelled save would leave a temp file or an open multipart upload behind. This
# bounds how long that shielded cleanup may take.
CLEANUP_TIMEOUT = 30.0


class Owner(Protocol):
    """What a reader or writer needs of its store."""

    @property
    def closed(self) -> bool:
        """Whether the store was closed."""
        ...

    def where(self, key: str) -> str:
        """The full URL of ``key``, for messages."""
        ...

    def _check_open(self) -> None: ...


class Loan:
    """Memory lent to writers (:meth:`BaseWriter.write_lent`): ``on_return`` runs once, when
    the lender and every writer holding a view of it have let go.

    The lender holds it from the start and calls :meth:`release` once done handing it out;
    a writer that keeps a view calls :meth:`retain` first and :meth:`release` when it no
    longer reads it. All on one event loop.
    """

    __slots__ = ("_holders", "_on_return")

    def __init__(self, on_return: Callable[[], None]) -> None:
        self._holders = 1
        self._on_return: Callable[[], None] | None = on_return

    @property
    def returned(self) -> bool:
        """Whether every holder let go (``on_return`` ran)."""
        return self._on_return is None

    def retain(self) -> None:
        """One more holder; it must :meth:`release` later."""
        if self._on_return is None:
            raise RuntimeError("a returned loan cannot be held again")
        self._holders += 1

    def release(self) -> None:
        """One holder lets go; the last one runs ``on_return``."""
        self._holders -= 1
        if self._holders == 0 and self._on_return is not None:
            on_return, self._on_return = self._on_return, None
            on_return()


def _nothing() -> None:
    pass


def unchanging() -> Loan:
    """A loan of memory that stays unchanged for as long as any writer holds it: an
    immutable ``bytes``, or a buffer its owner keeps unchanged until the commit."""
    return Loan(_nothing)


class BaseWriter(AsyncResource, abc.ABC):
    """Shared half of every writer: state checks and commit-or-abort on exit.

    A writer is used once: ``new`` → ``open`` (its ``async with`` block) → ``closed``, either
    committed or aborted.
    """

    def __init__(self, store: Owner, key: str) -> None:
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
        # A bytes object never changes: a writer may keep it without a copy.
        await self._accept(data, unchanging() if type(data) is bytes else None)

    async def write_lent(self, data: memoryview, loan: Loan) -> None:
        """Append ``data``, which stays unchanged until ``loan`` is returned: a writer that
        sends bytes later (an S3 part) keeps a view of it instead of a copy, retaining
        ``loan`` until the part is sent. Others copy, as :meth:`write` does.

        Raises:
            InvalidArgument: ``loan`` is not a :class:`Loan`.
            StoreClosed: as :meth:`write`.
        """
        if not isinstance(loan, Loan):
            raise InvalidArgument(
                f"loan={loan!r}: pass an asyncstore.stores.Loan, whose callback runs once "
                "the writer is done with the bytes (or use write(), which copies them)"
            )
        await self._accept(data, loan)

    def unlend(self) -> None:
        """Copy what the writer holds of lent memory for bytes it cannot send yet (a part not
        full), and let go of those loans: a lender that needs its memory back asks this.
        Views of parts being sent are kept until each is sent."""

    async def _accept(self, data: bytes | bytearray | memoryview, loan: Loan | None) -> None:
        if self._state != "open":
            raise StoreClosed(
                f"{self._resource_name()} is {self._status()}; write inside its 'async with' block"
            )
        if self._store.closed:
            raise self._store_closed()
        view = as_buffer(data, self._store.where(self._key))
        if len(view):
            try:
                await (self._write(view) if loan is None else self._write_lent(view, loan))
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

    async def _write_lent(self, data: memoryview, loan: Loan) -> None:
        # Writers that send what they take before returning have no use for the loan.
        await self._write(data)

    @abc.abstractmethod
    async def _commit(self) -> ObjectInfo: ...

    @abc.abstractmethod
    async def _abort(self) -> None:
        """Remove every trace of the write; must not raise for an already-clean state."""


class BaseReader(AsyncResource, abc.ABC):
    """Shared half of every reader: lazy open, iteration, idempotent close."""

    _reopen_hint = "open a new reader with open_reader()"
    _unclosed_hint = "use it in 'async with' or iterate it to the end"

    def __init__(self, store: Owner, key: str, chunk_bytes: int) -> None:
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
