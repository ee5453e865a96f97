"""Write-behind to the disk tier: entries fetched from the store, written in batches.

A read is served as soon as its fetch lands; writing the entry to the disk tier comes after,
in a background task. Writes go in batches, one thread hop and one index transaction each:
per entry, both cost more than appending a small entry. Until an entry is on disk, reads are
served from its bytes here (:attr:`DiskWrites.unwritten`), never fetched again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio

from .._config import MiB
from ._stats import TierStats

WRITE_QUEUE_BYTES = 256 * MiB
"""Fetched bytes waiting to be written to the disk tier; past this, writes are skipped (the
reads they came from have been served already) rather than let memory grow."""

WRITE_BATCH = 64
"""Entries that make a disk-tier write batch worth starting at once (see WRITE_DELAY)."""

WRITE_DELAY = 0.02
"""Seconds a smaller batch waits for more entries before it is written. Each batch costs a
thread hop and an index transaction (about 0.3 ms here, whatever its size); one entry of
50 KB costs about 0.05 ms to append. A cold epoch fetches an entry every millisecond or
two, so without the wait most batches held one or two entries. Entries waiting are served
from memory meanwhile (never fetched again), and closing the cache writes them at once."""

Entry = tuple[str, bytes, str | None]
"""An entry on its way to disk: its cache key, its bytes and the ETag they came with."""


class DiskWrites:
    """The queue of entries for the disk tier, and the one task that writes it out.

    Args:
        write: writes a batch to the disk tier in a worker thread; returns whether each
            entry was kept, or None if the tier failed (it then counts the error itself).
        spawn: starts a background task the cache waits for when it closes.
        stats: the disk tier's counters; entries not kept count as ``bypassed``.
    """

    def __init__(
        self,
        write: Callable[[list[Entry]], Awaitable[list[bool] | None]],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        stats: TierStats,
    ) -> None:
        self._write = write
        self._spawn = spawn
        self._stats = stats
        self._pending: list[Entry] = []
        self._pending_bytes = 0
        # Every entry queued or being written, by cache key: until it is on disk, a read is
        # served from these bytes, never fetched again.
        self.unwritten: dict[str, Entry] = {}
        self._writing = False
        self._task: asyncio.Task[None] | None = None
        self._batch_full = asyncio.Event()
        self._hurry = False
        self._flushing = 0  # flush() calls waiting: batches go without waiting to fill
        self._stopped = False

    def queue(self, cache_key: str, data: bytes, etag: str | None) -> None:
        """Queue an entry fetched from the store; the write task starts if none runs."""
        if self._pending_bytes + len(data) > WRITE_QUEUE_BYTES:
            self._stats.bypassed += 1  # the disk cannot keep up: skip, it is a cache
            return
        item = (cache_key, data, etag)
        self._pending.append(item)
        self.unwritten[cache_key] = item
        self._pending_bytes += len(data)
        if len(self._pending) >= WRITE_BATCH:
            self._batch_full.set()
        if not self._writing:
            self._writing = True
            self._task = self._spawn(self._write_pending(), "disk writes")

    async def _write_pending(self) -> None:
        try:
            while self._pending and not self._stopped:
                if len(self._pending) < WRITE_BATCH and not (self._hurry or self._flushing):
                    self._batch_full.clear()
                    with anyio.move_on_after(WRITE_DELAY):
                        await self._batch_full.wait()
                    if self._stopped:
                        break
                batch, self._pending, self._pending_bytes = self._pending, [], 0
                try:
                    kept = await self._write(batch)
                finally:
                    for item in batch:
                        if self.unwritten.get(item[0]) is item:  # not queued again since
                            del self.unwritten[item[0]]
                if kept is not None:
                    # Larger than the room the budget leaves: served, not kept.
                    self._stats.bypassed += kept.count(False)
        finally:
            self._writing = False

    def hurry(self) -> None:
        """Write what is queued now, and every batch from now on, without waiting for it to
        fill (the cache is closing)."""
        self._hurry = True
        self._batch_full.set()

    async def flush(self) -> None:
        """Write what is queued now, and return once nothing queued is left unwritten.

        Entries queued meanwhile are written too. A cancelled caller stops waiting; the
        writes go on.
        """
        self._flushing += 1
        try:
            while (task := self._task) is not None and not task.done():
                self._batch_full.set()
                await asyncio.wait([task])
        finally:
            self._flushing -= 1

    async def settle(self) -> None:
        """Wait for the batch already handed to the disk thread, if any.

        It lands whatever the caller does: a removal made after this cannot be undone by it.
        """
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait([task])

    def forget(self, key: str) -> None:
        """Drop what is queued of the object ``key``: the entry and its blocks."""
        kept = [item for item in self._pending if item[0].split("\x00", 1)[0] != key]
        if len(kept) != len(self._pending):
            self._pending = kept
            self._pending_bytes = sum(len(item[1]) for item in kept)
        for cache_key in [k for k in self.unwritten if k.split("\x00", 1)[0] == key]:
            del self.unwritten[cache_key]

    def clear(self) -> None:
        """Drop everything queued."""
        self._pending, self._pending_bytes = [], 0
        self.unwritten.clear()

    def stop(self) -> None:
        """Drop everything queued and write no more: the disk tier is gone."""
        self._stopped = True
        self.clear()
