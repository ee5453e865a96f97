"""The ``Checkpointer`` for sync code: the async one's methods run on the loop bridge."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from .._loop import run_sync
from ..checkpoint import Checkpointer as _AsyncCheckpointer
from ..checkpoint import CheckpointerStats, SaveResult, VerifyReport, Version
from ._dcpmethods import DistributedMethods
from ._torchsave import pending

__all__ = ["Checkpointer"]


class Checkpointer(DistributedMethods):
    """:class:`asyncstore.Checkpointer` for synchronous training loops.

    The same options and methods; each returns at the same moment as the async one, and
    :meth:`save` gives a ``concurrent.futures.Future`` of the :class:`SaveResult` (the
    commit), which the interpreter waits for at exit. Use it as a context manager, or call
    :meth:`close`::

        with asyncstore.torch.Checkpointer("s3://bucket/run1", keep_last=3) as ckpt:
            state = ckpt.load() if ckpt.latest() else None
            ...
            ckpt.save(model.state_dict(), step)  # returns after the snapshot
    """

    def __init__(self, url: Any, **options: Any) -> None:
        self._ckpt = _AsyncCheckpointer(url, **options)
        self._closed = False
        self._group: Any = None  # the gloo group of DCP's collectives, made on first use
        self._dcp_pending: concurrent.futures.Future[Any] | None = None

    @property
    def url(self) -> str:
        """Where the versions live."""
        return self._ckpt.url

    @property
    def store_options(self) -> dict[str, Any]:
        """The options the run's store was opened with (a copy)."""
        return self._ckpt.store_options

    def save(
        self, state: Any, step: int, *, metadata: dict[str, Any] | None = None
    ) -> concurrent.futures.Future[SaveResult]:
        """Save ``state`` as the version of ``step``; return once it is snapshotted."""
        return pending(run_sync(self._ckpt.save(state, step, metadata=metadata)))

    def load(self, step: int | None = None, **options: Any) -> Any:
        """Load the version of ``step``, or the newest that verifies (see
        :meth:`asyncstore.Checkpointer.load` for the options)."""
        return run_sync(self._ckpt.load(step, **options))

    def versions(self) -> list[Version]:
        """Every committed version, oldest first."""
        return run_sync(self._ckpt.versions())

    def latest(self) -> Version | None:
        """The newest committed version, or ``None``."""
        return run_sync(self._ckpt.latest())

    def delete(self, step: int) -> None:
        """Delete the version of ``step``."""
        run_sync(self._ckpt.delete(step))

    def verify(self, step: int, *, raise_on_error: bool = False) -> VerifyReport:
        """Check every checksum of the version of ``step``."""
        return run_sync(self._ckpt.verify(step, raise_on_error=raise_on_error))

    def prune(
        self, keep_last: int, keep_every: int | None = None, *, dry_run: bool = False
    ) -> list[int]:
        """Delete the versions that ``keep_last`` and ``keep_every`` do not keep; returns
        the steps deleted (see :meth:`asyncstore.Checkpointer.prune`)."""
        return run_sync(self._ckpt.prune(keep_last, keep_every, dry_run=dry_run))

    def gc(self) -> int:
        """Remove what killed saves left under version names."""
        return run_sync(self._ckpt.gc())

    def stats(self) -> CheckpointerStats:
        """What this checkpointer did so far: saves, seconds, bytes, deletions."""
        return self._ckpt.stats()

    def close(self) -> None:
        """Wait for the last :meth:`dcp_async_save` and the saves' retention, and release
        the store; closing twice is harmless."""
        if not self._closed:
            self._closed = True
            try:
                self._dcp_wait()
            finally:
                run_sync(self._ckpt.aclose())

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
