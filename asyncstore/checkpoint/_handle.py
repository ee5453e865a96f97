"""What a save gives back: a :class:`SaveHandle` at once, a :class:`SaveResult` at the commit."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Callable
from typing import Any

import msgspec

from .._concurrency import wait_shared
from ..errors import AsyncStoreError

__all__ = ["SaveHandle", "SaveResult"]

logger = logging.getLogger("asyncstore.checkpoint")


class SaveResult(msgspec.Struct, frozen=True):
    """What a finished save did.

    Attributes:
        url: where the checkpoint was written.
        raw_bytes: tensor bytes plus the pickled structure, before compression.
        stored_bytes: bytes written, manifest and footer included.
        storages: tensor storages saved.
        chunks: chunks written.
        compressed_storages: storages stored compressed.
        snapshot_seconds: how long the caller waited (the snapshot).
        total_seconds: from the call to the commit.
        direct_bytes: bytes a local file took straight from the staging memory, around the
            page cache (``O_DIRECT``); 0 for other targets, or a file system without it.
        digest: the whole-checkpoint digest (hex xxh3-64 over every chunk's digest).
        skipped_bytes: raw bytes of chunks an earlier version's pack holds, stored as
            references instead of written again (differential saves of a
            :class:`~asyncstore.Checkpointer`; 0 otherwise).
    """

    url: str
    raw_bytes: int
    stored_bytes: int
    storages: int
    chunks: int
    compressed_storages: int
    snapshot_seconds: float
    total_seconds: float
    digest: str
    direct_bytes: int = 0
    skipped_bytes: int = 0


class SaveHandle:
    """A save in progress: returned once the snapshot is taken.

    ``await handle`` (or :meth:`wait`) gives the :class:`SaveResult` or raises the save's
    error; :meth:`done` tells whether it finished; :meth:`result` gives the outcome of a
    finished save.
    """

    def __init__(self, task: asyncio.Task[SaveResult], url: str) -> None:
        self._task = task
        self.url = url
        # Shared with the task's callback, which must not keep the handle alive: whether
        # the handle was dropped first decides what a failure that nobody saw tells.
        self._watch = _Watch(url)
        task.add_done_callback(self._watch.ended)

    def __del__(self) -> None:
        # A save whose handle goes away while it writes is one nobody waits for: when the
        # event loop ends (asyncio.run returning), it is cancelled and nothing is committed.
        task, watch = getattr(self, "_task", None), getattr(self, "_watch", None)
        if task is None or watch is None or task.done():
            return
        watch.dropped = True
        warnings.warn(
            f"the save to {self.url} was still writing when its handle was dropped; await "
            "the handle (await handle) so that the checkpoint commits before the event loop "
            "ends",
            ResourceWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "writing"
        return f"<SaveHandle {self.url} {state}>"

    def __await__(self) -> Any:
        return self.wait().__await__()

    async def wait(self) -> SaveResult:
        """Wait for the save to commit; the result, or the save's error.

        Cancelling the wait leaves the save running; :meth:`cancel` stops it.
        """
        return await wait_shared(self._task)

    def done(self) -> bool:
        """Whether the save finished (committed or failed)."""
        return self._task.done()

    def result(self) -> SaveResult:
        """The result of a finished save, or its error.

        Raises:
            AsyncStoreError: the save is still writing (await the handle instead).
        """
        if not self._task.done():
            raise AsyncStoreError(f"the save to {self.url} is still writing; await the handle")
        return self._task.result()

    def cancel(self) -> None:
        """Abandon the save: nothing is committed, the previous checkpoint stays."""
        self._watch.cancelled = True
        self._task.cancel()

    def _when_done(self, callback: Callable[[asyncio.Task[SaveResult]], None]) -> None:
        # Runs in the loop as the save ends, before the waiters that came after it: what
        # the callback records is there when an awaited handle returns.
        self._task.add_done_callback(callback)


class _Watch:
    """What the end of a save should tell when nobody asked for it: a save cancelled other
    than by :meth:`SaveHandle.cancel` (its event loop shutting down: ``asyncio.run``
    cancels every task left when its coroutine returns), or one that failed after its
    handle was dropped. Either way nothing was committed, and a log line is all there is."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.cancelled = False  # by SaveHandle.cancel(): asked for, nothing to tell
        self.dropped = False  # the handle was garbage-collected while the save was writing

    def ended(self, task: asyncio.Task[SaveResult]) -> None:
        if task.cancelled():
            if not self.cancelled:
                logger.warning(
                    "the save to %s was cancelled before it committed (its event loop shut "
                    "down: asyncio.run ends with every task still running) and nothing was "
                    "written there; await the save's handle (await handle) before the loop "
                    "ends",
                    self.url,
                )
            return
        if self.dropped:
            error = task.exception()  # nobody else can retrieve it: it is reported here
            if error is not None:
                logger.warning(
                    "the save to %s failed after its handle was dropped, and nothing was "
                    "committed there: %s; await the save's handle to get its error",
                    self.url,
                    error,
                )
