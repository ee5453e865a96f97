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

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(4, (os.cpu_count() or 1) + 4),
                thread_name_prefix="asyncstore-checkpoint",
            )
        return _EXECUTOR


async def run_thread(
    func: Callable[..., T], *args: Any, limiter: asyncio.Semaphore | None = None
) -> T:
    """Run ``func(*args)`` in a worker thread; if cancelled, wait for it, then re-raise."""
    async with limiter if limiter is not None else contextlib.nullcontext():
        future = asyncio.get_running_loop().run_in_executor(
            _executor(), functools.partial(func, *args)
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
    global _EXECUTOR, _LOCK
    _EXECUTOR = None
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
