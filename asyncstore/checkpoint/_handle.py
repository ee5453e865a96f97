"""What a save gives back: a :class:`SaveHandle` at once, a :class:`SaveResult` at the commit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from .._concurrency import wait_shared
from ..errors import AsyncStoreError

__all__ = ["SaveHandle", "SaveResult"]


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
        self._task.cancel()

    def _when_done(self, callback: Callable[[asyncio.Task[SaveResult]], None]) -> None:
        # Runs in the loop as the save ends, before the waiters that came after it: what
        # the callback records is there when an awaited handle returns.
        self._task.add_done_callback(callback)
