"""Concurrency primitives: one way to do each thing, and when to use it.

Every module of asyncstore starts tasks, runs threads and shields cleanup through this
module, so that each of these questions has one answer:

- **Cleanup that must not stop halfway** (abort an upload, close a file, return a slab):
  ``await shield(coro)``. It runs ``coro`` to its end even if the caller is cancelled
  meanwhile, then re-raises the cancellation.
- **Waiting for work that others share** (a single-flight fetch, a save handle):
  ``await wait_shared(task)``. Cancelling the waiter leaves the work running for the others.
- **Blocking calls** (file I/O, SQLite, compression): ``await to_thread(func, *args)``.
  If the caller is cancelled it waits for the thread to finish before re-raising, because
  the thread may hold memory the caller would otherwise reuse or free (a staging slab, a
  tensor being filled). ``background=True`` runs work that nobody waits for on threads of
  low priority, so that a training step's threads get the cores first.
- **Background tasks**: a component owns a :class:`TaskSet`; ``spawn`` starts a named task
  and tracks it, ``aclose`` cancels and awaits every task still running, and the failure of
  a task nobody awaits is logged once.
- **Bounded fan-out** (ranges of one object, blocks of a range, spans of chunks to read):
  ``await bounded_map(func, items, limit=n)`` runs ``func`` on every item, ``n`` at a time,
  and returns the results in order; the first failure stops the rest and is raised as it is.
  A stream too long to hold (millions of keys to warm from a generator or an async
  iterator, samples to upload): ``await bounded_each(func, items, limit=n)``, which takes
  an item only when there is room for its call and drops the results.
- **Retries** (a request, an upload to a mirror): ``await with_retries(call, ...)``, one
  policy for the whole library: exponential backoff with full jitter, a bounded number of
  attempts, a predicate saying what is worth retrying.
- **Fork and exit**: :func:`after_fork_in_child` and :func:`at_exit` register hooks in one
  place, run in an explicit order (:class:`ExitStep`).

One choice per primitive, so that a reader never wonders why two look alike:

==========================  ==================================================================
tasks                       asyncio, started only here (:class:`TaskSet`, :func:`bounded_map`,
                            :func:`bounded_each`)
lock, semaphore, event,     ``asyncio.Lock``, ``asyncio.Semaphore``, ``asyncio.Event``,
queue                       ``asyncio.Queue``: no pass through the event loop when free, and
                            they hold under both kinds of cancellation described below
bounding threads            an ``asyncio.Semaphore`` given to :func:`to_thread` as ``limiter``
timeouts                    ``anyio.move_on_after`` / ``anyio.fail_after``: cancel scopes that
                            nest, and that :func:`shield` holds back like any cancellation
sleeping                    ``asyncio.sleep``
I/O and locks               never I/O under a lock: the locked part decides, without awaiting,
                            and returns the I/O still to do (see :mod:`.stores._s3pool`);
                            callers that want the same result wait on a shared future
==========================  ==================================================================

Why not anyio's primitives alone: ``anyio.CancelScope(shield=True)`` and
``anyio.to_thread.run_sync`` protect against anyio's own cancel scopes, but not against a
plain ``task.cancel()``, which is how asyncio cancels (``asyncio.wait_for``, a cancelled
``run_coroutine_threadsafe`` future of the sync bridge, ``asyncio.timeout``). Under such a
cancellation a shielded block is interrupted at its next ``await`` and a worker thread is
abandoned while it still runs. The primitives here hold under both kinds.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # its exit hook must be registered before ours
import contextlib
import enum
import functools
import logging
import os
import random
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from .errors import StoreClosed

T = TypeVar("T")
R = TypeVar("R")

__all__ = [
    "ExitStep",
    "abandon",
    "TaskSet",
    "after_fork_in_child",
    "at_exit",
    "backoff_delay",
    "bounded_each",
    "bounded_map",
    "forget_errors",
    "shield",
    "to_thread",
    "wait_shared",
    "with_retries",
]

logger = logging.getLogger("asyncstore")
_retry_logger = logging.getLogger("asyncstore.retry")

# -- cancellation ------------------------------------------------------------------------------


async def shield(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile, then re-raise
    the cancellation (once the work is done).

    Use it for cleanup that must not stop halfway. It runs ``awaitable`` in a task of its
    own; a cancellation that arrives meanwhile, whether from an anyio cancel scope or from
    ``task.cancel()``, is held back until that task ends.
    """
    task = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            # Re-raised as caught: an anyio cancel scope recognizes its own cancellation.
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    return task.result()


async def wait_shared(future: Awaitable[T]) -> T:
    """Await work that other callers share (a single-flight fetch, a save in progress).

    Cancelling the waiter cancels only the wait: the work goes on for the others. Use
    :func:`shield` instead when the waiter itself must not stop before the work ends.
    """
    return await asyncio.shield(future)


# -- threads -----------------------------------------------------------------------------------

# The niceness of background threads: a training step's threads get the cores whenever they
# want them; checkpoint uploads and encoding run in what they leave.
LOW_PRIORITY = 19

# Threads start on demand, up to this many; callers that need a tighter bound pass a limiter
# (the local store's max_inflight, the cache's disk threads).
MAX_THREADS = 64

_EXECUTORS: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
_EXECUTORS_LOCK = threading.Lock()


def _lower_priority() -> None:
    # Per thread on Linux (a thread id names one thread); elsewhere this is best effort.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY)


def _executor(background: bool) -> concurrent.futures.ThreadPoolExecutor:
    with _EXECUTORS_LOCK:
        executor = _EXECUTORS.get(background)
        if executor is None:
            executor = _EXECUTORS[background] = concurrent.futures.ThreadPoolExecutor(
                max_workers=MAX_THREADS if not background else max(4, (os.cpu_count() or 1) + 4),
                thread_name_prefix="asyncstore-background" if background else "asyncstore",
                initializer=_lower_priority if background else None,
            )
        return executor


async def to_thread(
    func: Callable[..., T],
    *args: Any,
    limiter: contextlib.AbstractAsyncContextManager[Any] | None = None,
    background: bool = False,
) -> T:
    """Run ``func(*args)`` in a worker thread and return its result.

    If the caller is cancelled, this waits for the thread to finish, then re-raises: the
    thread may be using memory the caller owns. ``limiter`` (an ``anyio.CapacityLimiter``
    or ``asyncio.Semaphore``) bounds how many such calls run at once. ``background=True``
    runs on a thread of low priority (nice 19), for work nobody is waiting for.
    """
    async with limiter if limiter is not None else contextlib.nullcontext():
        future = asyncio.get_running_loop().run_in_executor(
            _executor(background), functools.partial(func, *args)
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            # The caller is gone: the thread's error, if any, is nobody's to report (asyncio
            # would log it as never retrieved, beside the error that cancelled the caller).
            forget_errors([future])
            raise


# -- background tasks --------------------------------------------------------------------------


class TaskSet:
    """The background tasks of one component: started named, tracked until they end,
    cancelled and awaited when the component closes.

    A task started with ``detached=True`` is one nobody awaits (a write batch, a refill): if
    it fails, the set logs the error once, at ERROR. Other tasks are awaited by whoever
    started them, who gets their error.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str, detached: bool = False
    ) -> asyncio.Task[T]:
        """Start ``coro`` as a task named ``name`` owned by this set.

        Raises:
            StoreClosed: the set was closed (its component is closing).
        """
        if self._closed:
            coro.close()
            raise StoreClosed(f"{self._owner} is closed; no new work is started")
        task = asyncio.get_running_loop().create_task(coro, name=f"asyncstore: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._log_failure if detached else self._tasks.discard)
        return task

    def _log_failure(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: asyncio does not log it a second time
        if exc is not None:
            logger.error(
                "%s: background task %r failed", self._owner, task.get_name(), exc_info=exc
            )

    def __len__(self) -> int:
        return len(self._tasks)

    async def join(self) -> None:
        """Wait until every task running now has ended (without cancelling any)."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks)

    def cancel(self) -> None:
        """Cancel every task still running, without waiting (from synchronous code; prefer
        :meth:`aclose`, which also waits). The set starts no task afterwards."""
        self._closed = True
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel every task still running and wait for all of them to end.

        Idempotent. The set starts no task afterwards. Waiting is shielded: a cancelled
        close still leaves no task of this set running.
        """
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await shield(asyncio.wait(tasks))


async def abandon(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and return once it has ended, whatever it held released, even if
    the caller is cancelled meanwhile; its error is not reported (the caller has its own)."""
    task.cancel()
    await shield(asyncio.wait([task]))
    forget_errors([task])


def forget_errors(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Mark the errors of these finished tasks as seen: their owner is closing and nobody
    will read them, so asyncio must not log them as never retrieved."""
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()


# -- bounded fan-out ---------------------------------------------------------------------------


async def bounded_map(
    func: Callable[[T], Awaitable[R]], items: Iterable[T], *, limit: int, name: str = "map"
) -> list[R]:
    """Return ``[await func(item) for item in items]``, running at most ``limit`` calls at once.

    The results come in the order of ``items``. The first call to fail stops the others
    (those running are cancelled and awaited, the rest never start) and its error is raised
    as it is, not wrapped in an exception group: parallel pieces of one job fail for one
    reason in practice, and the caller handles that reason. Cancelling the caller cancels
    every call and waits for them to end before re-raising. ``name`` names the tasks.
    """
    todo = list(enumerate(items))
    results: list[R] = [None] * len(todo)  # type: ignore[list-item]  # each slot is filled
    if len(todo) <= 1 or limit <= 1:
        for index, item in todo:  # nothing to overlap: no task to start
            results[index] = await func(item)
        return results
    pending = iter(todo)

    async def worker() -> None:
        for index, item in pending:  # shared: each item goes to one worker
            results[index] = await func(item)

    await _all_or_nothing(worker, min(limit, len(todo)), name)
    return results


class _End:
    """What a stream's next item is once there is none."""


_END = _End()


async def bounded_each(
    func: Callable[[T], Awaitable[object]],
    items: Iterable[T] | AsyncIterable[T],
    *,
    limit: int,
    name: str = "each",
) -> int:
    """Await ``func(item)`` for every item of a stream, at most ``limit`` calls at once, and
    return how many calls there were (all of them succeeded, when it returns).

    For streams too long to hold (a million keys to warm, a dataset to upload): an item is
    taken from ``items`` (an iterable, a generator or an async iterable) only when a call
    has ended and left room for it, and results are dropped, so memory holds ``limit``
    items whatever the stream's length. Failure and cancellation as in :func:`bounded_map`;
    an error raised by ``items`` itself stops the calls the same way.
    """
    count = 0
    take: Callable[[], Awaitable[T | _End]]
    if isinstance(items, AsyncIterable):
        stream = aiter(items)
        turn = asyncio.Lock()  # an async generator takes one caller at a time

        async def take_async() -> T | _End:
            async with turn:
                return await anext(stream, _END)

        take = take_async
    else:
        lazy = iter(items)

        async def take_sync() -> T | _End:
            return next(lazy, _END)

        take = take_sync

    async def worker() -> None:
        nonlocal count
        while not isinstance(item := await take(), _End):
            await func(item)
            count += 1

    if limit <= 1:
        await worker()  # nothing to overlap: no task to start
    else:
        await _all_or_nothing(worker, limit, name)
    return count


async def _all_or_nothing(
    worker: Callable[[], Coroutine[Any, Any, None]], count: int, name: str
) -> None:
    # Runs count copies of worker as tasks until all end or one fails; see bounded_map.
    loop = asyncio.get_running_loop()
    workers = [loop.create_task(worker(), name=f"asyncstore: {name} {n}") for n in range(count)]
    done: set[asyncio.Task[None]] = set()
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if len(done) < len(workers):  # a failure, or the caller's cancellation: stop the rest
            for task in workers:
                task.cancel()
            await shield(asyncio.wait(workers))
    forget_errors(workers)  # one error is raised; the others are the same failure, or cancels
    for task in workers:  # in start order: the first to fail among those done first
        if task in done and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


# -- retries -----------------------------------------------------------------------------------


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """The pause before retry number ``attempt`` (1 for the first retry): full jitter, a delay
    drawn uniformly from ``[0, min(cap, base * 2**(attempt - 1)))``.

    Full jitter spreads the retries of many clients that failed together, so they do not come
    back in lockstep and overload a recovering server again ("Exponential Backoff And Jitter",
    AWS Architecture Blog, 2015).
    """
    return random.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    max_attempts: int,
    base_delay: float,
    max_delay: float,
    retryable: Callable[[BaseException], bool],
    exhausted: Callable[[Exception, int], Exception],
    what: str,
    on_retry: Callable[[Exception, int, float], None] | None = None,
) -> T:
    """Run ``call`` until it succeeds, retrying the failures ``retryable`` accepts after a
    pause of :func:`backoff_delay`.

    After ``max_attempts`` attempts the last failure is handed to ``exhausted(exc, attempts)``,
    whose error is raised from it. Failures that are not retryable propagate at once, and so
    does cancellation. Before each pause, ``on_retry(exc, attempt, delay)`` is called (by
    default a DEBUG line naming ``what``): a caller that owes its users a warning logs it there.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as exc:
            if not retryable(exc):
                raise
            if attempt >= max_attempts:
                raise exhausted(exc, attempt) from exc
            delay = backoff_delay(attempt, base_delay, max_delay)
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            else:
                _retry_logger.debug(
                    "%s failed (attempt %d of %d: %s); retrying in %.3f s",
                    what,
                    attempt,
                    max_attempts,
                    type(exc).__name__,
                    delay,
                )
            await asyncio.sleep(delay)


# -- fork and exit -----------------------------------------------------------------------------


class ExitStep(enum.IntEnum):
    """The order of asyncstore's exit hooks, lowest first.

    Pending saves must finish while the background loop still runs, so they come before
    the loop stops; the threads' pools are shut down last.
    """

    FINISH_SAVES = 10
    """``save_async`` saves not yet committed: the interpreter waits for them, as it would
    for ``torch.save``."""
    STOP_LOOP = 20
    """The sync bridge's event loop and its thread."""
    STOP_THREADS = 30
    """Worker thread pools."""


_EXIT_HOOKS: list[tuple[int, int, Callable[[], None]]] = []
_FORK_HOOKS: list[tuple[int, Callable[[], None]]] = []


def at_exit(step: ExitStep, hook: Callable[[], None]) -> None:
    """Run ``hook`` at interpreter exit, in the order of ``step`` (hooks of one step in the
    order they were registered). An exception in one hook is logged; the others still run."""
    _EXIT_HOOKS.append((int(step), len(_EXIT_HOOKS), hook))


def after_fork_in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in a forked child, before anything else of asyncstore runs there.

    Hooks drop what the child did not inherit: the parent's threads, its event loop, locks
    another thread held at the fork. They run in the order they were registered.
    """
    _FORK_HOOKS.append((len(_FORK_HOOKS), hook))


def _run_exit_hooks() -> None:
    for _, _, hook in sorted(_EXIT_HOOKS, key=lambda item: item[:2]):
        try:
            hook()
        except Exception:
            logger.exception("an asyncstore exit hook failed")


def _run_fork_hooks() -> None:
    for _, hook in _FORK_HOOKS:
        hook()


def _forget_executors() -> None:
    # The parent's threads do not exist in the child, and a lock held by one is never freed.
    global _EXECUTORS_LOCK
    _EXECUTORS.clear()
    _EXECUTORS_LOCK = threading.Lock()


def _stop_executors() -> None:
    with _EXECUTORS_LOCK:
        executors = list(_EXECUTORS.values())
        _EXECUTORS.clear()
    for executor in executors:
        executor.shutdown(wait=False, cancel_futures=True)


after_fork_in_child(_forget_executors)
at_exit(ExitStep.STOP_THREADS, _stop_executors)
# Before Python's own thread-pool shutdown, not after: at interpreter exit, concurrent.futures
# stops its pools (each refuses new work from then on) before the atexit module's handlers
# run, so a pending save waited for there could not start one more thread and failed. Hooks
# registered with threading run in reverse order of registration: after the pools' hook,
# which is registered when concurrent.futures.thread is first imported (done above).
_register_early = getattr(threading, "_register_atexit", None)
if _register_early is not None:
    _register_early(_run_exit_hooks)
else:  # pragma: no cover - other interpreters
    atexit.register(_run_exit_hooks)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_run_fork_hooks)
