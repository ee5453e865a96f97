"""TieredCache: memory → local disk → store, read-through, with single flight.

A read looks in memory, then on disk, then asks the store; what a lower tier returns is
copied into the tiers above it. Concurrent reads of one missing entry share one fetch (single
flight): the fetch runs as its own task, so a reader that is cancelled or times out does not
cancel it for the others, and an error reaches every reader without being cached.
Entries fetched from the store reach the disk tier afterwards, in batches written in the
background (see :mod:`~asyncstore.cache._writes`).

Ranged reads are served from fixed-size blocks (``block_bytes``) cached like small objects,
so the hot regions of a huge object stay local without caching all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Iterable, Sequence
from operator import itemgetter
from typing import Any, Literal, TypeVar, cast

from .._concurrency import TaskSet, shield, to_thread, wait_shared
from .._config import DEFAULT_BLOCK_BYTES, DEFAULT_TTL, CacheConfig, build
from .._dirs import check_disk_dir
from .._resource import AsyncResource
from ..errors import IntegrityError, InvalidArgument, StoreClosed
from ..stores import Store, check_key, check_key_list, check_range
from ._disk import TOUCH_BATCH, DiskRow, DiskTier, RowReader, WouldBlock
from ._freshness import Freshness
from ._memory import MemoryTier
from ._plan import PlanTier
from ._stats import CacheStats, LatencyWindow, StoreFetchStats, TierStats, snapshot
from ._warm import check_keys, read_all, read_blocks
from ._writes import DiskWrites, Entry

logger = logging.getLogger("asyncstore.cache")

MiB = 1 << 20


DISK_THREADS = 8
"""Worker threads doing disk-tier I/O at once: enough to keep an NVMe queue busy."""

T = TypeVar("T")
_Loader = Callable[[], Awaitable[tuple[bytes, str | None]]]


_RUN_KEYS = 64
"""Keys a run of warm reads looks up at a time (one index query for its disk hits), as
many as a stretch of :meth:`DiskTier.expect`: keys found absent are taken as absent for a
while (a hint), and a run should not take keys far beyond where it stops for absent."""


class TieredCache(AsyncResource):
    """A read-through cache over a store: memory, then an optional local disk directory.

    Args:
        store: the store to read through (any :class:`asyncstore.Store`).
        memory_bytes: the memory tier's hard budget.
        disk_dir: a local directory for the disk tier, shared by every process that opens it,
            whatever their stores (entries are kept apart by :attr:`Store.identity`);
            ``None`` for no disk tier.
        disk_bytes: the disk tier's hard budget (entries plus index); required with
            ``disk_dir``.
        policy: ``"lru"`` evicts the least recently used entry; ``"plan"`` evicts the entry
            whose next use in the plan (see :meth:`plan`) lies farthest ahead, and does not
            admit one that would be evicted before its next use. The policy governs the
            memory tier; the disk tier, shared by processes with different plans, stays LRU
            (by segment: see docs/cache.md).
        validate: ``"none"`` trusts cached entries forever (immutable datasets);
            ``"etag"`` re-checks an object's ETag with ``stat`` after ``ttl`` seconds and
            refetches it if it changed.
        ttl: seconds between ETag checks of one object with ``validate="etag"``; ``0``
            checks on every read, ``float("inf")`` once per object for the cache's life.
        block_bytes: block size for ranged reads.

    Raises:
        InvalidArgument: a budget, policy, mode or size is not usable; ``disk_dir`` is a
            file, lies under one, or cannot be created.
        PermissionDenied: this process may not create ``disk_dir`` or write in it.

    ``disk_dir`` is created and checked here, before any read. A read-only or full file
    system is not refused: the disk tier switches itself off when it opens (logged,
    counted in :meth:`stats`), as it does when that happens later, and reads go on.

    Use it as an async context manager; :meth:`aclose` waits for background disk writes.
    """

    def __init__(
        self,
        store: Store,
        *,
        memory_bytes: int,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int | None = None,
        policy: Literal["lru", "plan"] = "lru",
        validate: Literal["none", "etag"] = "none",
        ttl: float = DEFAULT_TTL,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        if not isinstance(store, Store):
            raise InvalidArgument(
                f"store={store!r} is not an asyncstore store; open one with open_store()"
            )
        config = build(
            CacheConfig,
            {
                "memory_bytes": memory_bytes,
                "disk_dir": os.fspath(disk_dir) if isinstance(disk_dir, os.PathLike) else disk_dir,
                "disk_bytes": disk_bytes,
                "policy": policy,
                "validate": validate,
                "ttl": ttl,
                "block_bytes": block_bytes,
            },
            "TieredCache",
        )
        if config.disk_dir is not None:
            check_disk_dir(
                config.disk_dir, "disk_dir", "disk_dir=None and disk_bytes=None for no disk tier"
            )
        self._config = config
        self._store = store
        self._policy = config.policy
        tier = PlanTier if config.policy == "plan" else MemoryTier
        self._memory: MemoryTier | PlanTier = tier(config.memory_bytes)
        self._disk: DiskTier | None = None
        self._validate = config.validate
        self._block = config.block_bytes
        self._limiter = asyncio.Semaphore(DISK_THREADS)
        self._inflight: dict[str, asyncio.Future[bytes]] = {}
        self._tasks = TaskSet(f"the cache over {store.url}")
        self._flushing = False
        self._generations: dict[str, int] = {}  # bumped by invalidate()
        self._clears = 0  # bumped by clear()
        self._gets = 0
        self._mem_stats = TierStats()
        self._disk_stats = TierStats(enabled=disk_dir is not None)
        self._writes = DiskWrites(self._write_entries, self._background, self._disk_stats)
        self._store_stats = StoreFetchStats()
        self._freshness = Freshness(store, config.validate, config.ttl, self._store_stats)
        self._latency = LatencyWindow()

    @property
    def policy(self) -> Literal["lru", "plan"]:
        """The memory tier's eviction policy, ``"lru"`` or ``"plan"``."""
        return self._policy

    @property
    def config(self) -> CacheConfig:
        """The cache's options, validated."""
        return self._config

    @property
    def url(self) -> str:
        """The URL of the store it reads through (that store's ``url``)."""
        return self._store.url

    # -- lifecycle ---------------------------------------------------------------------------

    async def _on_open(self) -> None:
        directory, budget = self._config.disk_dir, self._config.disk_bytes
        if directory is not None and budget is not None:
            identity = self._store.identity
            try:
                self._disk = await to_thread(DiskTier, directory, budget, identity)
            except (OSError, sqlite3.Error) as exc:
                self._disable_disk(exc)

    async def aclose(self) -> None:
        """Finish background disk writes and close the disk tier; closing twice is harmless."""
        await super().aclose()

    async def _on_close(self) -> None:
        self._writes.hurry()  # a batch waiting for more entries goes now
        # Let fetches and disk writes finish: a cancelled write would only waste the fetch,
        # and every task is bounded by the store's own timeouts. A finishing fetch may queue
        # a write task: wait until none is left.
        await self._drain()
        disk, self._disk = self._disk, None
        if disk is not None:
            await to_thread(disk.close, limiter=self._limiter)

    async def _drain(self) -> None:
        while self._tasks:
            await self._tasks.join()
        await self._tasks.aclose()

    def _holds_resources(self) -> bool:
        return getattr(self, "_disk", None) is not None

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes (or ``[start, end)`` of them), from the nearest tier that has it.

        A range is clipped to the object as the store's own :meth:`Store.get` does: past the
        end it gives fewer bytes, or ``b""``. Raises the store's errors (``NotFound``,
        ``StoreUnavailable``…) when it must be asked and fails; a broken cache tier never
        fails a read the store can serve.
        """
        if self._state != "open":
            await self._ensure_open()
        key = check_key(key, self._store.url)
        self._gets += 1
        if start is None and end is None:
            return await self._lookup(key, key, lambda: self._load_object(key))
        first, last = check_range(start, end, f"{self._store.url}/{key}")
        return await self._get_range(key, first, last)

    def get_nowait(self, key: str) -> bytes | None:
        """The whole object if it can be had without waiting, else ``None``: from memory,
        or from the disk tier when the entry is in the page cache; never from the store.
        Only with ``validate="none"`` (a revalidation would wait)."""
        got = self.get_ready([check_key(key, self._store.url)])
        return got[0] if got else None

    def get_ready(
        self, keys: Sequence[str], start: int = 0, stop: int | None = None
    ) -> list[bytes]:
        """The objects of the leading keys of ``keys[start:stop]`` that can be had without
        waiting, as :meth:`get_nowait` gives each, up to the first that cannot (or is not a
        valid key): a run of warm reads for a fraction of a call each (the prefetcher's).

        Raises:
            InvalidArgument: ``start`` is not an int >= 0, or ``stop`` not an int or None.
        """
        return cast("list[bytes]", self._ready(keys, start, stop, rows=False))

    def get_ready_rows(
        self, keys: Sequence[str], start: int = 0, stop: int | None = None
    ) -> list[bytes | DiskRow]:
        """:meth:`get_ready`, but each disk-tier hit as a :class:`DiskRow` (found in the
        index, not read), for a :class:`RowReader` on the consumer's thread to read. A row
        is neither counted nor promoted to memory until :meth:`settle` hands its bytes back;
        a row not read that way is got again the regular way (:meth:`get`)."""
        return self._ready(keys, start, stop, rows=True)

    def row_reader(self) -> RowReader | None:
        """A :class:`RowReader` over the disk tier, for one consumer thread; None without a
        disk tier."""
        return None if self._disk is None else RowReader(self._disk)

    def settle(self, read: Sequence[tuple[DiskRow, bytes]]) -> None:
        """Count the rows of :meth:`get_ready_rows` that a :class:`RowReader` read, with
        their bytes, as disk-tier hits, and promote the bytes to memory (on the loop), but
        for keys that :meth:`invalidate` or :meth:`clear` forgot since their rows were
        found."""
        if self._state != "open" or not read:
            return
        self._gets += len(read)
        self._mem_stats.misses += len(read)
        self._disk_stats.hits += len(read)
        self._disk_stats.bytes_served += sum(map(len, map(itemgetter(1), read)))
        clears, generations = self._clears, self._generations
        if generations:
            kept = [
                (row.key, data)
                for row, data in read
                if row.generation == (clears, generations.get(row.key, 0))
            ]
        else:  # no key forgotten since the last clear: one generation for all
            fresh = (clears, 0)
            kept = [(row.key, data) for row, data in read if row.generation == fresh]
        self._mem_stats.bypassed += self._memory.put_many(kept)
        if self._disk is not None:
            self._flush_touches_soon(self._disk)

    def _ready(
        self, keys: Sequence[str], start: int, stop: int | None, *, rows: bool
    ) -> list[bytes | DiskRow]:
        if not (type(start) is int and start >= 0 and (stop is None or type(stop) is int)):
            raise InvalidArgument(
                f"start={start!r}, stop={stop!r}: give positions in keys, start an int >= 0 "
                "and stop an int or None (the end)"
            )
        stop = len(keys) if stop is None else min(stop, len(keys))
        out: list[bytes | DiskRow] = []
        if self._state != "open" or self._validate != "none":
            return out
        while rows and self._disk is not None and start < stop:
            window = keys[start : min(stop, start + _RUN_KEYS)]
            warm = self._rows_run(self._disk, window)
            out += warm
            start += len(warm)
            if len(warm) < len(window):
                break
        disk, ahead = self._disk, 0  # keys before ahead were looked up on disk
        while start < stop:
            run = self._memory.get_run(keys, start, stop)
            # Only checked keys go in memory, so these are valid, unless one names a block
            # ("key\x00size.index"): the run ends before it.
            if run and "\x00" in "".join(keys[start : start + len(run)]):
                stop = start + next(i for i, key in enumerate(keys[start:]) if "\x00" in key)
                run = run[: stop - start]
            self._served_from_memory(run)
            out += run
            start += len(run)
            if start < stop and disk is not None and start >= ahead:  # one query a stretch
                ahead = disk.expect(keys, start, min(stop, start + 64), self._memory)
            value = self._ready_one(keys[start], rows) if start < stop else None
            if value is None:
                break
            out.append(value)
            start += 1
        if disk is not None and ahead:
            disk.expect(keys, 0, 0, ())  # the rows go stale once the loop moves on
        return out

    def _rows_run(self, disk: DiskTier, keys: Sequence[str]) -> list[bytes | DiskRow]:
        # The leading run of ``keys`` in memory or on the disk (as rows), in a few passes
        # over them all: the common warm-epoch window, at a fraction of _ready's loop per
        # key. Stops before a key that needs more (queued for the disk tier, being fetched,
        # not found, a block, not a valid key), which _ready's loop then takes up.
        try:
            if "\x00" in "".join(keys):  # a block's key; not a str: TypeError
                return []
            found = self._memory.peek_many(keys)
        except TypeError:
            return []
        misses = [key for key, value in zip(keys, found, strict=True) if value is None]
        out: list[bytes | DiskRow] = []
        if misses:
            try:
                check_key_list(misses, self._store.url)
            except InvalidArgument:
                return []  # _ready's loop stops at the first invalid key
            rows = disk.rows_now(misses)
            if None in rows:
                rows = rows[: rows.index(None)]
            unwritten, inflight = self._writes.unwritten, self._inflight
            if unwritten or inflight:  # none in a warm epoch: no look per row then
                for count, row in enumerate(cast("list[DiskRow]", rows)):
                    if row.key in unwritten or row.key in inflight:
                        rows = rows[:count]
                        break
            self._stamp(cast("list[DiskRow]", rows))
            taken = iter(rows)
            for value in found:
                item = next(taken, None) if value is None else value
                if item is None:  # the first key without a row
                    break
                out.append(item)
        else:
            out = cast("list[bytes | DiskRow]", found)
        self._memory.use_run(keys[: len(out)])
        self._served_from_memory([value for value in found[: len(out)] if value is not None])
        return out

    def _stamp(self, rows: list[DiskRow]) -> None:
        # Set the generation of the rows found for the first time: what the cache knows of
        # their keys now. A row the disk tier kept from an earlier find keeps its own, so
        # settle refuses its bytes if its key was forgotten since then, even while the row
        # is found again before the disk tier drops it (an invalidate under way).
        clears, generations = self._clears, self._generations
        fresh = (clears, 0)  # the generation of a key never forgotten since the clear
        for row in rows:
            if row.generation is None:
                key = row.key
                row.generation = (clears, generations[key]) if key in generations else fresh

    def _served_from_memory(self, values: list[bytes]) -> None:
        # Count ``values`` as gets the memory tier answered.
        self._gets += len(values)
        self._mem_stats.hits += len(values)
        self._mem_stats.bytes_served += sum(map(len, values))

    def _ready_one(self, key: str, rows: bool = False) -> bytes | DiskRow | None:
        # Not in memory: queued for the disk tier, or in the page cache (``rows``: on the
        # disk, its row); else None.
        try:
            key = check_key(key, self._store.url)
        except InvalidArgument:
            return None
        self._memory.get(key)  # a miss, counted as the key's planned use
        if (queued := self._writes.unwritten.get(key)) is not None:
            self._gets += 1
            self._mem_stats.hits += 1
            self._mem_stats.bytes_served += len(queued[1])
            return self._promote(key, queued[1])
        if key in self._inflight:
            return None
        if rows:
            row = None if self._disk is None else self._disk.row_now(key)
            if row is not None:
                self._stamp([row])
            return row
        data = self._disk_now(key)
        if data is not None:
            self._gets += 1
            self._mem_stats.misses += 1
        return data

    def _disk_now(self, cache_key: str) -> bytes | None:
        """A disk-tier hit served from the page cache, counted and promoted to memory; None
        if it would need the disk, a thread or a check (the regular path handles those)."""
        if self._disk is None:
            return None
        try:
            hit = self._read_cached(self._disk, cache_key)
        except (IntegrityError, OSError):
            return None  # the regular path counts and handles it
        if hit is None or isinstance(hit, WouldBlock):
            return None
        data = hit[0]
        self._disk_stats.hits += 1
        self._disk_stats.bytes_served += len(data)
        return self._promote(cache_key, data)

    async def _get_range(self, key: str, start: int, end: int | None) -> bytes:
        whole = self._memory.peek(key)
        if whole is not None and await self._freshness.fresh(key, key, self._memory):
            part = whole[start:end]
            self._mem_stats.hits += 1
            self._mem_stats.bytes_served += len(part)
            return part
        size = self._block
        first = start // size
        last = None if end is None else max(first, (end - 1) // size)
        data = await read_blocks(functools.partial(self._get_block, key), first, last, size)
        offset = first * size
        return data[start - offset : None if end is None else end - offset]

    async def _get_block(self, key: str, index: int) -> bytes:
        size = self._block

        async def load() -> tuple[bytes, str | None]:
            etag = await self._freshness.current_etag(key)
            return await self._fetch_store(key, index * size, (index + 1) * size), etag

        # The block size is part of the key: processes sharing a disk tier may use others.
        # An empty block past the first says only "the object ends before here": keeping it
        # would let any offset a caller picks add an entry.
        return await self._lookup(f"{key}\x00{size}.{index}", key, load, keep_empty=index == 0)

    async def _lookup(
        self, cache_key: str, key: str, load: _Loader, *, keep_empty: bool = True
    ) -> bytes:
        value = self._memory.get(cache_key)
        if value is not None and not await self._freshness.fresh(cache_key, key, self._memory):
            value = None
        # Fetched, and still on its way to the disk tier: these bytes are in memory.
        queued = self._writes.unwritten.get(cache_key) if value is None else None
        if queued is not None and (
            self._validate == "none" or queued[2] == await self._freshness.current_etag(key)
        ):
            value = self._promote(cache_key, queued[1])
        if value is not None:
            self._mem_stats.hits += 1
            self._mem_stats.bytes_served += len(value)
            return value
        self._mem_stats.misses += 1
        future = self._inflight.get(cache_key)
        if future is None and self._validate == "none":
            # A disk hit from the page cache needs no fetch task: serve it right here.
            data = self._disk_now(cache_key)
            if data is not None:
                return data
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._inflight[cache_key] = future
            self._background(self._fill(cache_key, key, load, future, keep_empty), "fetch")
        # A caller cancelled while waiting must not cancel the fetch other callers (or the
        # cache) are waiting on.
        return await wait_shared(future)

    async def _fill(
        self,
        cache_key: str,
        key: str,
        load: _Loader,
        future: asyncio.Future[bytes],
        keep_empty: bool = True,
    ) -> None:
        generation = self._generations.get(key, 0)
        try:
            data, etag, from_store = await self._load(cache_key, key, load)
        except BaseException as exc:
            self._inflight.pop(cache_key, None)
            if not future.done():
                error = exc if isinstance(exc, Exception) else StoreClosed("the cache closed")
                future.set_exception(error)
                future.exception()  # retrieved: nobody may be left waiting, that is fine
            if not isinstance(exc, Exception):
                raise
            return
        self._inflight.pop(cache_key, None)
        future.set_result(data)
        if self._generations.get(key, 0) != generation:
            return  # invalidated while fetching: serve the readers, keep nothing
        if not data and not keep_empty:
            return
        self._freshness.fetched(cache_key, etag)
        if not self._memory.put(cache_key, data):
            self._mem_stats.bypassed += 1
        if from_store and self._disk is not None:
            self._writes.queue(cache_key, data, etag)

    async def _load(
        self, cache_key: str, key: str, load: _Loader
    ) -> tuple[bytes, str | None, bool]:
        disk = self._disk
        if disk is not None:
            hit = await self._disk_read(disk, cache_key)
            if hit is not None:
                payload, etag = hit
                if self._validate == "none" or etag == await self._freshness.current_etag(key):
                    self._disk_stats.hits += 1
                    self._disk_stats.bytes_served += len(payload)
                    return payload, etag, False
            self._disk_stats.misses += 1
        data, etag = await load()
        return data, etag, True

    async def _load_object(self, key: str) -> tuple[bytes, str | None]:
        if self._validate == "none":
            return await self._fetch_store(key, None, None), None
        # One GET gives the bytes and the ETag of the same version.
        started = time.monotonic()
        async with self._store.open_reader(key, chunk_bytes=64 * MiB) as reader:
            data = b"".join([chunk async for chunk in reader])
            info = reader.info
        self._record_fetch(started, len(data))
        etag = info.etag if info is not None else None
        self._freshness.seen(key, etag)
        return data, etag

    async def _fetch_store(self, key: str, start: int | None, end: int | None) -> bytes:
        started = time.monotonic()
        data = await self._store.get(key, start, end)
        self._record_fetch(started, len(data))
        return data

    def _record_fetch(self, started: float, size: int) -> None:
        self._latency.add(time.monotonic() - started)
        self._store_stats.fetches += 1
        self._store_stats.bytes += size

    # -- the disk tier -----------------------------------------------------------------------

    async def _disk_read(self, disk: DiskTier, cache_key: str) -> tuple[bytes, str | None] | None:
        # A thread hop costs more than reading a small entry from the page cache (about
        # 500 us against 20 us on the benchmark machine), so try that inline first; it
        # never waits for the disk.
        try:
            hit = self._read_cached(disk, cache_key)
        except IntegrityError as exc:
            self._disk_stats.corrupt += 1
            logger.warning("dropped a damaged disk cache entry: %s", exc)
            await self._disk_call(disk.remove, cache_key)
            return None
        except OSError as exc:
            self._disable_disk(exc)
            return None
        if isinstance(hit, WouldBlock):
            return await self._disk_call(disk.read, cache_key)
        return hit

    def _read_cached(
        self, disk: DiskTier, cache_key: str
    ) -> tuple[bytes, str | None] | WouldBlock | None:
        hit = disk.read_cached(cache_key)
        self._flush_touches_soon(disk)
        return hit

    def _flush_touches_soon(self, disk: DiskTier) -> None:
        # Reads' access times go to the index in batches, in the background.
        if disk.touches_pending >= TOUCH_BATCH and not self._flushing:
            self._flushing = True
            self._background(self._flush_touches(disk), "flush access times")

    def _promote(self, cache_key: str, data: bytes) -> bytes:
        if not self._memory.put(cache_key, data):
            self._mem_stats.bypassed += 1
        return data

    async def _write_entries(self, batch: list[Entry]) -> list[bool] | None:
        disk = self._disk
        return None if disk is None else await self._disk_call(disk.write_many, batch)

    async def _flush_touches(self, disk: DiskTier) -> None:
        try:
            await self._disk_call(disk.flush_touches)
        finally:
            self._flushing = False

    def _background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        # Nobody awaits these tasks: a fetch hands its result to a future, writes and
        # flushes report through the tier's stats. aclose() waits for all of them.
        return self._tasks.spawn(coro, name=name, detached=True)

    async def _disk_call(self, func: Callable[..., T], *args: object) -> T | None:
        try:
            return await to_thread(func, *args, limiter=self._limiter)
        except IntegrityError as exc:
            self._disk_stats.corrupt += 1
            logger.warning("dropped a damaged disk cache entry: %s", exc)
        except (OSError, sqlite3.Error) as exc:
            self._disable_disk(exc)
        return None

    def _disable_disk(self, exc: BaseException) -> None:
        self._disk_stats.errors += 1
        if self._disk_stats.enabled:
            self._disk_stats.enabled = False
            logger.warning(
                "disk cache tier at %s switched off after an error (%s); reads go on from "
                "memory and %s",
                self._config.disk_dir,
                exc,
                self._store.url,
            )
        disk, self._disk = self._disk, None
        self._writes.stop()
        if disk is not None:
            # Closing waits for the index lock, which a worker thread may hold for a while:
            # never on the event loop.
            self._background(self._close_disk(disk), "close the disk tier")

    async def _close_disk(self, disk: DiskTier) -> None:
        def close() -> None:
            with contextlib.suppress(OSError, sqlite3.Error):
                disk.close()

        await shield(to_thread(close))

    # -- management --------------------------------------------------------------------------

    async def warm(self, keys: Iterable[str] | AsyncIterable[str], max_inflight: int = 32) -> int:
        """Read ``keys`` into the cache, ``max_inflight`` at a time; returns how many were read.

        Raises:
            InvalidArgument: ``keys`` is a single str (or not iterable), or ``max_inflight`` is
                not a positive int.
            AsyncStoreError: the first error a read raised (``NotFound``, ``InvalidKey``…),
                as itself, not inside an ``ExceptionGroup``; the reads still running are
                cancelled. (Notes are not added: single flight shares the error object
                with other readers of the key.)
        """
        check_keys(keys, "warm")
        return await read_all(self.get, keys, max_inflight)

    def plan(self, keys: Iterable[str]) -> None:
        """Append ``keys`` to the plan of upcoming reads (``policy="plan"``).

        Call it with the epoch's order ahead of reading, whole or in successive pieces; the
        prefetcher does this by itself. Keys not in the plan count as not needed again.

        Raises:
            InvalidArgument: the cache was not created with ``policy="plan"``.
        """
        check_keys(keys, "plan")
        if not isinstance(self._memory, PlanTier):
            raise InvalidArgument(
                f"plan() needs a cache created with policy='plan' (this one is {self._policy!r})"
            )
        self._memory.extend(check_key_list(list(keys), self._store.url))

    def pin(self, keys: Iterable[str]) -> None:
        """Keep ``keys`` in memory regardless of recency (from when they are next read)."""
        check_keys(keys, "pin")
        self._memory.pin(check_key(key, self._store.url) for key in keys)

    def unpin(self, keys: Iterable[str]) -> None:
        """Let ``keys`` be evicted by recency again."""
        check_keys(keys, "unpin")
        self._memory.unpin(check_key(key, self._store.url) for key in keys)

    async def invalidate(self, key: str) -> None:
        """Forget ``key`` (and its cached blocks) in every tier; the next read refetches it."""
        key = check_key(key, self._store.url)
        # Fetches of this key still under way must not put the old bytes back.
        self._generations[key] = self._generations.get(key, 0) + 1
        for removed in (False, True):
            doomed = [k for k in self._memory.keys() if k.split("\x00", 1)[0] == key]  # noqa: SIM118
            for cache_key in [key, *doomed]:
                self._memory.discard(cache_key)
            self._freshness.forget(key, [key, *doomed])
            self._writes.forget(key)
            if removed or self._disk is None:
                return
            await self._writes.settle()
            # A read meanwhile may find the entry on disk and keep it in memory: forget again.
            await self._disk_call(self._disk.remove, key)
            # A row found meanwhile points at the entry removed: its bytes are not kept either.
            self._generations[key] += 1

    async def flush(self) -> None:
        """Write the entries still on their way to the disk tier, and return once they
        are there: other processes sharing ``disk_dir`` then find them.

        Entries fetched from the store reach the disk tier in batches, up to 20 ms after
        the read that fetched them. Call this where another process is about to read what
        this one fetched (:class:`~asyncstore.torch.StreamingDataset` does at the end of each
        iteration). Without a disk tier, with nothing queued, or on a cache not open, it
        returns at once.
        """
        await self._writes.flush()

    async def clear(self) -> None:
        """Empty the memory and disk tiers (the disk tier for every process sharing it)."""
        self._clears += 1  # rows found before must not put their bytes back
        self._memory.clear()
        self._freshness.clear()
        self._writes.clear()
        if self._disk is not None:
            await self._writes.settle()
            await self._disk_call(self._disk.clear)
            self._clears += 1  # nor rows found meanwhile, which point at the entries cleared

    def stats(self) -> CacheStats:
        """A snapshot of the cache's counters."""
        memory, disk = self._memory, self._disk
        return snapshot(
            self._gets,
            (self._mem_stats, memory.evictions, memory.bypassed),
            (self._disk_stats, None if disk is None else disk.evictions),
            self._store_stats,
            self._latency,
        )
