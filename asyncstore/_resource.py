"""One lifecycle for every component that holds something: stores, readers, writers, the
cache and the prefetcher.

A resource is ``new`` until it opens (``async with``, or its first use), ``open`` until
:meth:`AsyncResource.aclose`, then ``closed`` for good:

- ``aclose()`` is idempotent and its cleanup is shielded: a cancelled close still releases
  everything (:func:`asyncstore._concurrency.shield`);
- use after close raises :class:`~asyncstore.StoreClosed`, naming the resource and what to do;
- a resource garbage-collected while open and holding something warns with
  ``ResourceWarning``, as an unclosed file does.

Subclasses implement ``_on_open`` and ``_on_close`` (both optional) and describe themselves
for messages with ``_resource_name``.

A resource with a ``stats()`` method joins a process-wide weak registry when it is built and
leaves it when it closes (or is garbage-collected): :func:`asyncstore.metrics.snapshot`
reads every live component's figures from there.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from types import TracebackType
from typing import Any, Literal, Self

from ._concurrency import shield
from .errors import StoreClosed

__all__ = ["AsyncResource", "live", "track", "untrack"]

# Every live component with figures. Weak: the registry never keeps one alive. The lock makes
# a snapshot taken in another thread (a Prometheus scrape) safe against concurrent additions;
# removals by the garbage collector are deferred by WeakSet itself while it is iterated.
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_live_lock = threading.Lock()


def track(component: object) -> None:
    """Add ``component`` (anything with a ``stats()`` method) to the registry of live
    components that :func:`asyncstore.metrics.snapshot` reads."""
    with _live_lock:
        _live.add(component)


def untrack(component: object) -> None:
    """Remove ``component`` from the registry (closing a resource does it)."""
    with _live_lock:
        _live.discard(component)


def live() -> list[Any]:
    """The components registered now, copied under the lock."""
    with _live_lock:
        return list(_live)


class AsyncResource:
    """Base of asyncstore's closeable components: ``new`` → ``open`` → ``closed``."""

    _state: Literal["new", "open", "closed"] = "new"
    # Said after "… is closed; " in StoreClosed messages.
    _reopen_hint = "create a new one"
    # Said after "… was not closed; " in the ResourceWarning.
    _unclosed_hint = "use 'async with' or await aclose()"
    # Whether instances join the metrics registry: those of classes with a stats() method.
    _tracked = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._tracked = callable(getattr(cls, "stats", None))

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Here rather than in __init__: subclasses do not all call super().__init__().
        self = super().__new__(cls)
        if cls._tracked:
            track(self)
        return self

    # -- what subclasses provide ---------------------------------------------------------------

    def _resource_name(self) -> str:
        """How messages name this resource ("the cache over s3://…")."""
        return f"this {type(self).__name__}"

    async def _on_open(self) -> None:
        """Acquire what the resource needs (connections, files); called once."""

    async def _on_close(self) -> None:
        """Release everything; called once, shielded, if the resource had opened."""

    def _holds_resources(self) -> bool:
        """Whether an open instance holds something a ``ResourceWarning`` should report."""
        return True

    # -- the lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._state == "closed"

    def _closed_error(self) -> StoreClosed:
        return StoreClosed(f"{self._resource_name()} is closed; {self._reopen_hint}")

    def _check_open(self) -> None:
        """Raise :class:`StoreClosed` if closed (a ``new`` resource may still open)."""
        if self._state == "closed":
            raise self._closed_error()

    async def _ensure_open(self) -> None:
        if self._state == "open":
            return
        self._check_open()
        # Open before the first await: a second caller meanwhile must not open it again.
        self._state = "open"
        try:
            await self._on_open()
        except BaseException:
            if self._state == "open":
                self._state = "new"  # nothing was acquired: the next use tries again
            raise

    async def __aenter__(self) -> Self:
        await self._ensure_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release everything this holds. Closing twice is harmless, and a close that is
        cancelled still finishes its cleanup before the cancellation goes on."""
        if self._state == "closed":
            return
        was_open = self._state == "open"
        self._state = "closed"
        if self._tracked:
            untrack(self)
        if was_open:
            await shield(self._on_close())

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") == "open" and self._holds_resources():
            warnings.warn(
                f"{self._resource_name()} was not closed; {self._unclosed_hint}",
                ResourceWarning,
                stacklevel=2,
            )
