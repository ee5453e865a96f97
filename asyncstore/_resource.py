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
"""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Literal, Self

from ._concurrency import shield
from .errors import StoreClosed

__all__ = ["AsyncResource"]


class AsyncResource:
    """Base of asyncstore's closeable components: ``new`` → ``open`` → ``closed``."""

    _state: Literal["new", "open", "closed"] = "new"
    # Said after "… is closed; " in StoreClosed messages.
    _reopen_hint = "create a new one"
    # Said after "… was not closed; " in the ResourceWarning.
    _unclosed_hint = "use 'async with' or await aclose()"

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
        if was_open:
            await shield(self._on_close())

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") == "open" and self._holds_resources():
            warnings.warn(
                f"{self._resource_name()} was not closed; {self._unclosed_hint}",
                ResourceWarning,
                stacklevel=2,
            )
