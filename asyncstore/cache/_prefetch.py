"""The lookahead prefetch scheduler: keep the next items in flight before they are asked for.

A training loop that reads small objects one at a time waits a full round trip per item. The
:class:`Prefetcher` walks the plan of keys ahead of the consumer, keeping a window of fetches
in flight — bounded by items, bytes and requests — and yields results in exactly the plan's
order. With ``lookahead="auto"`` it sizes the window itself: deeper after the consumer had to
wait, shallower while ready items pile up unread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from itertools import islice
from operator import itemgetter
from typing import Any, Literal, Self, cast

import msgspec

from .._concurrency import TaskSet, forget_errors
from .._config import DEFAULT_MAX_INFLIGHT, DEFAULT_PREFETCH_BYTES, PrefetchConfig, build
from .._resource import AsyncResource
from ..errors import InvalidArgument
from ..stores import Store, check_key
from ._disk import DiskRow
from ._stats import LatencyWindow
from ._tiered import TieredCache

__all__ = ["Prefetcher", "PrefetchStats", "RowPrefetcher"]

AUTO_START = 8
"""Initial depth with ``lookahead="auto"``: a few round trips' worth of small objects."""

PLAN_AHEAD = 4096
"""Keys read from the plan ahead of the fetch window, to tell a plan-aware cache what comes
next. Bounded, so a plan of ten million keys is never held whole."""

# A plan-aware prefetcher reads the plan this many keys at a time, once per fill while fewer
# than PLAN_AHEAD are known ahead of the window: the cache knows PLAN_AHEAD keys ahead all
# along rather than from PLAN_AHEAD down to none between reads, the first items of an epoch
# wait for a read of this many keys only (one read of PLAN_AHEAD took 6-9 ms at the start
# of a warm epoch of 4,000 samples), and each read is a short burst of work on the loop.
_PLAN_READ = 256

# Fetches started before any item's size is known (see _fill).
_FIRST_FETCHES = 4

# A consumer wait shorter than this is scheduling noise, not a stall.
_STALL_SECONDS = 0.0005


def _valid(key: object, url: str) -> bool:
    try:
        check_key(key, url)
    except InvalidArgument:
        return False
    return True


class PrefetchStats(msgspec.Struct):
    """A snapshot of a :class:`Prefetcher`'s counters.

    Attributes:
        items: items yielded to the consumer.
        skipped: items skipped after an error (``on_error="skip"``).
        fetched: fetches started.
        stalls: items the consumer had to wait for.
        stall_fraction: ``stalls / items``.
        wait_seconds: total time the consumer spent waiting.
        wait_p50, wait_p95, wait_p99: per-item consumer wait, seconds, recent items.
        accuracy: fetched items that were consumed, over fetched items.
        depth: the current lookahead depth.
    """

    items: int
    skipped: int
    fetched: int
    stalls: int
    stall_fraction: float
    wait_seconds: float
    wait_p50: float
    wait_p95: float
    wait_p99: float
    accuracy: float
    depth: int


class Prefetcher(AsyncResource):
    """Yield ``(key, data)`` for every key of a plan, in order, fetching ahead.

    Args:
        source: a store or a :class:`~asyncstore.TieredCache` to read from.
        keys: the plan: any iterable or async iterable of keys, consumed lazily.
        lookahead: items kept fetched or in flight ahead of the consumer, or ``"auto"`` to
            adapt it (start at 8; double after a stall; shrink by one while more than half
            the window sits ready and unread).
        max_inflight: fetches in flight at once (S3 clients degrade beyond about 32).
        max_bytes: fetched bytes held ahead of the consumer; no new fetch starts beyond it,
            except one when nothing is held or in flight (an item larger than ``max_bytes``
            comes, alone).
        on_error: ``"raise"`` raises a failed key's error when the consumer reaches it;
            ``"skip"`` skips the key and counts it.

    Use it as an async context manager and iterate it; leaving the loop early, an error or
    a cancellation stops every fetch in flight.
    """

    def __init__(
        self,
        source: Store | TieredCache,
        keys: Iterable[str] | AsyncIterable[str],
        *,
        lookahead: int | Literal["auto"] = "auto",
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        max_bytes: int = DEFAULT_PREFETCH_BYTES,
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        if not isinstance(source, Store | TieredCache):
            raise InvalidArgument(f"source={source!r} is neither a store nor a TieredCache")
        if not isinstance(keys, Iterable | AsyncIterable) or isinstance(keys, str | bytes):
            raise InvalidArgument(
                f"keys={keys!r}: pass an iterable or async iterable of keys, not a single key"
            )
        config = self._config = build(
            PrefetchConfig,
            {
                "lookahead": lookahead,
                "max_inflight": max_inflight,
                "max_bytes": max_bytes,
                "on_error": on_error,
            },
            "Prefetcher",
        )
        self._source = source
        self._keys: Iterator[str] | AsyncIterator[str] = (
            aiter(keys) if isinstance(keys, AsyncIterable) else iter(keys)
        )
        self._auto = config.lookahead == "auto"
        self._depth = AUTO_START if config.lookahead == "auto" else config.lookahead
        self._max_depth = 4096
        self._max_inflight = config.max_inflight
        self._max_bytes = config.max_bytes
        self._skip = config.on_error == "skip"
        self._plan_cache: TieredCache | None = None
        if isinstance(source, TieredCache) and source.policy == "plan":
            self._plan_cache = source
        # Keys read from the plan; those from _next on are not fetched yet (a list and a
        # position, so a run of warm keys is looked up with one call, see _fill_window).
        self._ahead: list[str] = []
        self._next = 0
        self._warm_cache = source if isinstance(source, TieredCache) else None
        # Plan order: each key with its fetch, or with its bytes when they were local already
        # (no future to make and resolve for the common warm-epoch case).
        self._window: deque[tuple[str, asyncio.Future[bytes] | bytes]] = deque()
        self._want = 0  # items a take() call wants ready at once
        self._inflight = 0  # fetch tasks not finished
        self._fetches = 0  # fetches in the window, finished or not
        self._refill: asyncio.Future[None] | None = None
        self._tasks = TaskSet("the Prefetcher")  # fetches and refills
        self._filling = asyncio.Lock()
        self._exhausted = False
        # What reading the plan raised: the plan ends there, and the consumer gets the error
        # after the items of the keys read before it.
        self._plan_error: Exception | None = None
        self._ready_bytes = 0
        self._avg_size: float | None = None
        self._items = self._skipped = self._fetched = self._stalls = 0
        self._wait = 0.0
        self._waits = LatencyWindow()
        self._over = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop every fetch in flight and drop what was fetched ahead; closing twice is fine."""
        await super().aclose()

    def _holds_resources(self) -> bool:
        return bool(getattr(self, "_window", None))  # fetches in flight, or bytes fetched

    async def _on_close(self) -> None:
        self._refill = None
        window, self._window = self._window, deque()
        self._fetches = 0
        await self._tasks.aclose()
        forget_errors(item for _, item in window if isinstance(item, asyncio.Future))
        self._inflight = 0
        self._ahead, self._next = [], 0
        self._ready_bytes = 0

    # -- iteration ---------------------------------------------------------------------------

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        if not self._open():
            raise StopAsyncIteration
        while True:
            await self._fill()
            if not self._window:
                await self._end()
                raise StopAsyncIteration
            item = await self._pop()
            if item is not None:
                self._refill_soon()
                return item

    def _open(self) -> bool:
        if self._state == "new":
            self._state = "open"
        return self._state == "open"

    async def _pop(self) -> tuple[str, bytes] | None:
        # Wait for the head of the window and take it; None for a key skipped after an error.
        head = self._window[0][1]
        if not isinstance(head, asyncio.Future):  # it was local: ready, nothing to wait for
            items: list[tuple[str, bytes]] = []
            self._take_ready(items, 1)
            return items[0]
        waited = None if head.done() else await self._wait_for(head)
        return await self._take_head(waited)

    async def _wait_for(self, fetch: asyncio.Future[bytes]) -> float:
        # Wait for the head's fetch without taking it (the caller looks at it again first),
        # counting the wait and a stall once.
        started = time.perf_counter()
        await asyncio.wait([fetch])
        waited = time.perf_counter() - started
        self._wait += waited
        if waited > _STALL_SECONDS:
            self._stalls += 1
            self._grow()
        return waited

    async def _take_head(self, waited: float | None) -> tuple[str, bytes] | None:
        # Take the head, a finished fetch: its bytes, None when skipped after an error, or
        # its error (closing). ``waited``: how long the consumer waited for it, None when it
        # was ready before it was wanted.
        try:
            return self._take_finished(waited)
        except Exception:
            await self.aclose()
            raise

    def _take_finished(self, waited: float | None) -> tuple[str, bytes] | None:
        # _take_head but for closing: its error is raised as it is.
        key, fetch = self._window.popleft()
        self._fetches -= 1
        assert isinstance(fetch, asyncio.Future)  # the caller saw it done
        if waited is None:
            self._over += 1
        self._waits.add(waited or 0.0)
        self._adapt()
        try:
            data = fetch.result()
        except Exception:
            if self._skip:
                self._skipped += 1
                return None
            raise
        self._ready_bytes -= len(data)
        self._items += 1
        return key, data

    def _take_ready(self, items: list[tuple[str, bytes]], most: int) -> None:
        # Move the window's leading run of local items (bytes, not fetches) to ``items``,
        # up to ``most``: _pop's bookkeeping once for the run.
        window = self._window
        count = min(most - len(items), len(window))
        if not self._fetches:  # no fetch in the window: every item is local
            taken = [window.popleft() for _ in range(count)]
        else:
            taken = []
            while len(taken) < count and not isinstance(window[0][1], asyncio.Future):
                taken.append(window.popleft())
        items += cast("list[tuple[str, bytes]]", taken)
        self._items += len(taken)
        self._over += len(taken)
        self._ready_bytes -= sum(map(len, map(itemgetter(1), taken)))
        self._waits.add_zeros(len(taken))
        self._adapt()

    async def _read_plan(self) -> None:
        # Read a slice of the plan ahead and tell a plan-aware cache about it.
        keys = self._keys
        if not isinstance(keys, AsyncIterator):
            self._read_plan_now()
            return
        want = self._plan_want()
        batch: list[str] = []
        try:
            while len(batch) < want:
                batch.append(await anext(keys))
        except StopAsyncIteration:
            self._exhausted = True
        except Exception as exc:
            self._plan_failed(exc)
        self._planned(batch)

    def _read_plan_now(self) -> None:
        # _read_plan for a plan that is a plain iterable: no await.
        want = self._plan_want()
        batch: list[str] = []
        try:
            batch.extend(islice(cast("Iterator[str]", self._keys), want))  # kept if it raises
        except Exception as exc:
            self._plan_failed(exc)
        else:
            self._exhausted = len(batch) < want
        self._planned(batch)

    def _plan_failed(self, exc: Exception) -> None:
        # The plan raised while read: it ends here (the keys read before stay planned).
        self._plan_error = exc
        self._exhausted = True

    async def _end(self) -> None:
        # The window is empty and the plan read to its end: close, raising the error that
        # ended the plan, if one did.
        error, self._plan_error = self._plan_error, None
        await self.aclose()
        if error is not None:
            raise error

    def _plan_want(self) -> int:
        return _PLAN_READ if self._plan_cache is not None else max(64, self._depth)

    def _planned(self, batch: list[str]) -> None:
        # Keys read from the plan: told to a plan-aware cache, and queued to be fetched.
        if batch and self._plan_cache is not None:
            try:
                self._plan_cache.plan(batch)
            except InvalidArgument:  # a bad key: planned without it, its read raises in order
                self._plan_cache.plan([key for key in batch if _valid(key, self.url)])
        ahead = self._ahead
        if self._next * 2 >= len(ahead):  # the keys already taken, dropped now and then
            del ahead[: self._next]
            self._next = 0
        ahead += batch

    def _refill_now(self, limit: int) -> None:
        # A refill, without awaiting as far as it goes: local runs, a plain plan's keys read
        # ahead. Fetches to start and an async plan to read are left to a background refill.
        if not self._filling.locked() and not self._fill_local(limit):
            if not self._plan_short():
                return
            if not isinstance(self._keys, AsyncIterator):
                self._read_plan_now()  # the plan-aware cache told PLAN_AHEAD keys ahead
                return
        self._refill_soon()

    def _refill_soon(self) -> None:
        # Keep the window full while the consumer works on what it got: without this, new
        # fetches (and reads of already-local items) would start only at its next call.
        if self._refill is None or self._refill.done():
            self._refill = self._tasks.spawn(self._fill(), name="prefetch refill", detached=True)

    async def _fill(self) -> None:
        async with self._filling:  # one filler at a time: the consumer or the refill task
            await self._fill_window()

    async def _fill_window(self) -> None:
        # Start fetches until the window is as deep as wanted, or a bound says stop.
        limit = max(self._depth, self._want)
        window = self._window
        while self._fill_local(limit):
            start = self._next
            if start == len(self._ahead):
                await self._read_plan()  # an async plan (a plain one is read by _fill_local)
                continue
            inflight = self._inflight
            if inflight >= self._max_inflight:
                break
            # Bytes in flight count against max_bytes at the average item size seen so far;
            # until one item has arrived, sizes are unknown: start only a few fetches. An
            # empty window always gets one: items larger than max_bytes come one at a time
            # (an empty window after filling means the plan is done).
            if self._avg_size is None:
                if inflight >= _FIRST_FETCHES:
                    break
            elif window and self._ready_bytes + (inflight + 1) * self._avg_size > self._max_bytes:
                break
            key = self._ahead[start]
            self._next = start + 1
            self._fetched += 1
            self._inflight += 1
            window.append((key, self._tasks.spawn(self._fetch(key), name="prefetch")))
            self._fetches += 1
        if self._plan_short():
            await self._read_plan()  # the plan-aware cache told PLAN_AHEAD keys ahead

    def _fill_local(self, limit: int) -> bool:
        # The part of a fill that needs no await: runs of keys already local go in the window
        # with their bytes, a run per call (no task, no future, no wait: the common warm-epoch
        # case), and a plain iterable plan is read as needed. True when the window has room
        # left and the next key needs a fetch, or a read of an async plan.
        window = self._window
        while len(window) < limit and self._ready_bytes < self._max_bytes:
            ahead, start = self._ahead, self._next
            if start == len(ahead):
                if self._exhausted:
                    return False
                if isinstance(self._keys, AsyncIterator):
                    return True
                self._read_plan_now()
                continue
            if self._warm_cache is None:
                return True
            # Bytes ready count against max_bytes at the size seen so far.
            room = 1  # until a size is known
            if self._avg_size is not None:
                # Empty items (an average of 0) take no room: the window bounds them.
                left = (self._max_bytes - self._ready_bytes) / max(self._avg_size, 1.0)
                room = max(1, min(limit - len(window), int(left)))
            run = self._ready_run(self._warm_cache, ahead, start, start + room)
            if not run:
                return True
            size = sum(map(len, run))
            window.extend(zip(ahead[start : start + len(run)], run, strict=True))
            self._next = start + len(run)
            self._fetched += len(run)
            self._ready_bytes += size
            self._seen(size / len(run))
        return False

    def _plan_short(self) -> bool:
        # Fewer than PLAN_AHEAD keys read ahead of the window for a plan-aware cache.
        return (
            self._plan_cache is not None
            and not self._exhausted
            and len(self._ahead) - self._next < PLAN_AHEAD
        )

    def _seen(self, size: float) -> None:
        # The average item size, over recent items (or runs of them).
        self._avg_size = size if self._avg_size is None else 0.8 * self._avg_size + 0.2 * size

    async def _fetch(self, key: str) -> bytes:
        # _inflight was counted when the task was created (it may not have started yet).
        try:
            data = await self._source.get(key)
        finally:
            self._inflight -= 1
        self._ready_bytes += len(data)
        self._seen(len(data))
        return data

    # -- adaptive depth ----------------------------------------------------------------------

    def _grow(self) -> None:
        if self._auto:
            self._depth = min(self._max_depth, self._depth * 2)
            self._over = 0

    def _adapt(self) -> None:
        # Shrink slowly while more than half the window is ready and unread: the consumer is
        # the bottleneck, and the extra depth only holds memory.
        if not self._auto or self._depth <= 1:
            return
        ready = len(self._window) - self._inflight
        if ready * 2 > self._depth and self._over >= 64:
            self._depth -= 1
            self._over = 0

    def _ready_run(self, cache: TieredCache, keys: list[str], start: int, stop: int) -> list[bytes]:
        # The leading run of keys[start:stop] that is local (see TieredCache.get_ready).
        return cache.get_ready(keys, start, stop)

    async def take(self, most: int, *, least: int = 1) -> list[tuple[str, bytes]]:
        """Wait for the next ``least`` items, then add whatever else is ready, up to
        ``most`` items.

        For consumers that pay per call (a thread hop per call from a sync caller): the
        window may grow to ``most`` for items that are already local, and the window is
        refilled once per call rather than once per item. A consumer that cannot use fewer
        than ``least`` items anyway (a DataLoader collecting a batch) saves the calls that
        would each bring a few. Fewer come back only at the end of the plan, or before a
        failed item (the next call raises its error); ``[]`` means the plan is done.

        ``least=0`` never waits for a fetch: it gives the items ready now, stopping before
        the first one in flight or failed, and ``[]`` may also mean that none is ready yet
        (:attr:`closed` tells the end of the plan). Items it gives count as not waited for.
        """
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise InvalidArgument(f"most={most!r}: pass a positive int")
        if isinstance(least, bool) or not isinstance(least, int) or not 0 <= least <= most:
            raise InvalidArgument(f"least={least!r}: pass an int from 0 to most={most}")
        # Kept after the call: the background refill prepares the next take() as deep.
        self._want = most
        items: list[tuple[str, bytes]] = []
        if not self._open():
            return items
        waited: float | None = None  # how long this call has waited for the head
        while len(items) < most:
            if not self._window:
                await self._fill()
                if not self._window:
                    if self._plan_error is not None and (items or not least):
                        break  # what came before the plan's error first
                    await self._end()  # the end of the plan
                    break
            head = self._window[0][1]
            if not isinstance(head, asyncio.Future):
                self._take_ready(items, most)  # a run of local items: no await per item
                continue
            if not head.done():
                if len(items) >= least:
                    break  # give what is ready now rather than wait
                await self._fill()  # about to wait for it: keep fetches going meanwhile
                waited = (waited or 0.0) + await self._wait_for(head)
                if self._state != "open":
                    break  # closed while waiting
                continue  # look again: a failed head ends the call with what came before it
            if (items or not least) and not self._skip and head.exception():
                break  # what came before a failed key first; the next call raises its error
            item = await self._take_head(waited)
            waited = None
            if item is not None:
                items.append(item)
        if self._state == "open":
            self._refill_soon()
        return items

    def take_nowait(self, most: int) -> list[tuple[str, bytes]]:
        """The items ready now, up to ``most``, without awaiting anything: for a callback on
        the event loop, where :meth:`take` would need a task.

        It gives what ``take(most, least=0)`` gives, stopping before the first item in
        flight or failed, and refills the window as :meth:`take` does: items already local
        at once, new fetches in the background. ``[]`` means that none is ready now, or that
        the plan is done: only :meth:`take` tells the end of the plan (:attr:`closed`).
        Items it gives count as not waited for.

        Raises:
            InvalidArgument: ``most`` is not a positive int.
        """
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise InvalidArgument(f"most={most!r}: pass a positive int")
        self._want = most
        items: list[tuple[str, bytes]] = []
        if not self._open():
            return items
        window, limit = self._window, max(self._depth, most)
        while len(items) < most:
            if not window and not self._filling.locked():
                self._fill_local(limit)
            if not window:
                break
            head = window[0][1]
            if not isinstance(head, asyncio.Future):
                self._take_ready(items, most)
                continue
            if not head.done() or head.cancelled():
                break
            if head.exception() is not None and not self._skip:
                break  # raised by the next take(), after what came before it
            item = self._take_finished(None)
            if item is not None:
                items.append(item)
        self._refill_now(limit)
        return items

    # -- stats -------------------------------------------------------------------------------

    @property
    def config(self) -> PrefetchConfig:
        """The prefetcher's options, validated."""
        return self._config

    @property
    def url(self) -> str:
        """The URL of the store it reads from, directly or through a cache."""
        return self._source.url

    def stats(self) -> PrefetchStats:
        """A snapshot of the counters."""
        p50, p95, p99 = self._waits.percentiles()
        consumed = self._items + self._skipped
        return PrefetchStats(
            items=self._items,
            skipped=self._skipped,
            fetched=self._fetched,
            stalls=self._stalls,
            stall_fraction=self._stalls / self._items if self._items else 0.0,
            wait_seconds=self._wait,
            wait_p50=p50,
            wait_p95=p95,
            wait_p99=p99,
            accuracy=consumed / self._fetched if self._fetched else 0.0,
            depth=self._depth,
        )


class RowPrefetcher(Prefetcher):
    """A :class:`Prefetcher` over a :class:`TieredCache` that hands on each warm disk-tier
    hit as a :class:`~asyncstore.cache._disk.DiskRow` (where the entry lies, not its bytes)
    while :attr:`rows` is true. Its items come through :meth:`take_rows`, for a consumer
    that reads the rows on its own thread with :meth:`TieredCache.row_reader`, hands the
    bytes back with :meth:`TieredCache.settle`, and gets a row it could not read with
    :meth:`TieredCache.get` (StreamingDataset's consumer).

    Read on the event loop, each warm disk hit made the consumer's thread and the loop's
    hand the GIL to each other at every system call; read by the consumer, as a plain file
    read would be, the loop only looks ahead.
    """

    def __init__(
        self, source: TieredCache, keys: Iterable[str] | AsyncIterable[str], **options: Any
    ) -> None:
        super().__init__(source, keys, **options)
        self.rows = True
        """Whether disk hits come as rows; the consumer turns it off once a row could not be
        read (the loop then reads ahead again, through threads)."""

    def _ready_run(self, cache: TieredCache, keys: list[str], start: int, stop: int) -> list[bytes]:
        if not self.rows:
            return super()._ready_run(cache, keys, start, stop)
        # Rows travel where bytes do: they count against max_bytes by their length.
        return cast("list[bytes]", cache.get_ready_rows(keys, start, stop))

    async def take_rows(self, most: int, *, least: int = 1) -> list[tuple[str, bytes | DiskRow]]:
        """:meth:`take`, whose items may hold rows instead of bytes."""
        items = await Prefetcher.take(self, most, least=least)
        return cast("list[tuple[str, bytes | DiskRow]]", items)

    def take_rows_nowait(self, most: int) -> list[tuple[str, bytes | DiskRow]]:
        """:meth:`take_nowait`, whose items may hold rows instead of bytes."""
        return cast("list[tuple[str, bytes | DiskRow]]", Prefetcher.take_nowait(self, most))

    def take_nowait(self, most: int) -> list[tuple[str, bytes]]:
        """Refused: its items may be rows, which only :meth:`take_rows_nowait` gives.

        Raises:
            TypeError: always.
        """
        raise TypeError("a RowPrefetcher's items may be rows: take them with take_rows_nowait()")

    async def take(self, most: int, *, least: int = 1) -> list[tuple[str, bytes]]:
        """Refused: its items may be rows, which only :meth:`take_rows` gives.

        Raises:
            TypeError: always.
        """
        raise TypeError("a RowPrefetcher's items may be rows: take them with take_rows()")

    async def __anext__(self) -> tuple[str, bytes]:
        raise TypeError("a RowPrefetcher's items may be rows: take them with take_rows()")
