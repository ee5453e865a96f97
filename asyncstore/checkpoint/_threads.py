"""Worker threads for the checkpoint engine that are never abandoned.

The engine hands threads views of staging slabs and of tensors being loaded. If the task
waiting for a thread is cancelled, that memory must not be reused or freed until the
thread is done with it, so :func:`run_thread` waits for the thread even then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_EXECUTORS: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
_LOCK = threading.Lock()

# The niceness of background threads: a training step's threads get the cores whenever they
# want them; checkpoint work runs in what they leave.
LOW_PRIORITY = 19


def _lower_priority() -> None:
    # Per thread on Linux (a thread id names one thread); elsewhere this is best effort.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY)


def _executor(background: bool) -> concurrent.futures.ThreadPoolExecutor:
    with _LOCK:
        executor = _EXECUTORS.get(background)
        if executor is None:
            executor = _EXECUTORS[background] = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(4, (os.cpu_count() or 1) + 4),
                thread_name_prefix="asyncstore-checkpoint" + ("-background" if background else ""),
                initializer=_lower_priority if background else None,
            )
        return executor


async def run_thread(
    func: Callable[..., T],
    *args: Any,
    limiter: asyncio.Semaphore | None = None,
    background: bool = False,
) -> T:
    """Run ``func(*args)`` in a worker thread; if cancelled, wait for it, then re-raise.

    ``background=True`` runs it on a thread of low priority (nice 19), for work nobody is
    waiting for.
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
            raise


async def shielded(awaitable: Any) -> Any:
    """Await ``awaitable`` to the end even if this task is cancelled meanwhile (cleanup
    must not stop halfway), then re-raise the cancellation."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


def _forget() -> None:
    # In a forked child the parent's threads do not exist, and a held lock is never freed.
    global _LOCK
    _EXECUTORS.clear()
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
