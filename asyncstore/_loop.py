"""The sync bridge: one background event loop per process for synchronous callers.

DataLoader workers and training loops are synchronous; asyncstore's core is async and
written once. This module runs an asyncio loop in a daemon thread, created on first use, and
runs coroutines on it for sync callers. After ``fork`` the child never touches the parent's
loop (its thread does not exist there, and its sockets belong to the parent): the bridge is
forgotten in the child and created anew on first use. At interpreter exit the loop is stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._concurrency import ExitStep, after_fork_in_child, at_exit
from .errors import AsyncStoreError

T = TypeVar("T")

__all__ = ["run_sync", "bridge_loop"]


class _Bridge:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._start()
            assert self._loop is not None
            return self._loop

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            ready.set()
            try:
                loop.run_forever()
            finally:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        thread = threading.Thread(target=run, name="asyncstore-loop", daemon=True)
        thread.start()
        ready.wait()
        self._loop, self._thread, self._pid = loop, thread, os.getpid()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        loop = self.loop()
        if threading.current_thread() is self._thread:
            coro.close()
            raise AsyncStoreError(
                "a synchronous asyncstore call was made from asyncstore's own event loop "
                "thread; await the async API there instead"
            )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except (KeyboardInterrupt, concurrent.futures.TimeoutError):
            future.cancel()
            raise

    def stop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None or self._pid != os.getpid():
                return
            self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    def forget(self) -> None:
        # In a forked child: the parent's loop thread was not copied; drop the references
        # without touching the loop (closing it would close the parent's sockets' copies).
        self._lock = threading.Lock()
        self._loop = self._thread = None
        self._pid = 0


_BRIDGE = _Bridge()
at_exit(ExitStep.STOP_LOOP, _BRIDGE.stop)
after_fork_in_child(_BRIDGE.forget)


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the process's background loop and return its result.

    Raises:
        AsyncStoreError: called from the background loop's own thread (it would deadlock).
        concurrent.futures.TimeoutError: ``timeout`` passed; the coroutine is cancelled.
    """
    return _BRIDGE.run(coro, timeout)


def bridge_loop() -> asyncio.AbstractEventLoop:
    """The process's background loop (started if needed)."""
    return _BRIDGE.loop()
