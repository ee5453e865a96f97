"""A distributed version of a :class:`Checkpointer`'s run that this process is saving: the
seam between the checkpointer (versions, stats, retention) and a DCP storage writer
(``asyncstore.torch``'s), which writes the version's objects and reports as it goes.

Kept apart from the checkpointer so that the checkpoint engine never imports
``torch.distributed``: the writer holds one of these, not the other way round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._config import SaveConfig
from . import _distributed as dist_layout
from ._handle import SaveResult
from ._versions import dcp_prefix, version_key

if TYPE_CHECKING:
    from ._manager import Checkpointer

__all__ = ["DistributedVersion"]


class DistributedVersion:
    """The distributed version of ``step`` of a :class:`Checkpointer`'s run, as one process
    saves it (from :meth:`Checkpointer.dcp_version`; every rank has its own).

    Attributes:
        step: the version's step.
        url: its directory (``<run>/step-000001000.dcp``), where every rank writes.
        store_options: the options of the run's store, to open that directory with.
        save_config: the options every rank's object is saved with: the checkpointer's.
        committed: set once :meth:`commit` ran; until then, the checkpointer's
            :meth:`~Checkpointer.gc` and later saves leave the version's objects alone.
    """

    def __init__(self, owner: Checkpointer, step: int, url: str) -> None:
        self.step = step
        self.url = url
        self.store_options: dict[str, Any] = owner.store_options
        self.save_config: SaveConfig = owner.config.save
        self.committed = False
        self._owner = owner

    def written(self, result: SaveResult) -> None:
        """This rank's object is written (``result`` is its save's): its bytes count in
        the checkpointer's :meth:`~Checkpointer.stats`. Call it on the checkpointer's
        event loop."""
        stats = self._owner._stats
        stats.bytes_written += result.stored_bytes
        stats.bytes_skipped += result.skipped_bytes

    async def counted(self, blocking: float, total: float | None) -> None:
        """The whole save ended on this rank (``total`` is ``None`` when it failed): it
        counts as a save in :meth:`~Checkpointer.stats`, ``blocking`` seconds of it the
        caller's wait, as a :meth:`~Checkpointer.save` does. For a caller that runs the
        save (``dcp_save``) and so knows when it ends, on every rank."""
        stats = self._owner._stats
        if total is None:
            stats.failed += 1
            return
        stats.saves += 1
        stats.blocking_seconds += blocking
        stats.last_blocking_seconds = blocking
        stats.last_total_seconds = total

    async def commit(self, *, count: bool = True) -> None:
        """The version is complete (the coordinator wrote its ``.metadata``): it replaces a
        single-object version of its step, what killed distributed saves of earlier steps
        left goes, and retention runs in the background, as after a save. ``count``: the
        save is counted here (on the coordinator only), its caller not counting it with
        :meth:`counted` (DCP was called directly)."""
        self.committed = True
        owner = self._owner
        store = owner._store
        await store.delete(version_key(self.step))
        owner._packs.forget(store, version_key(self.step))
        _, unfinished = await owner._view.scan(store)
        writing = owner._dcp_writing()
        for earlier in unfinished:
            if earlier < self.step and earlier not in writing:
                await dist_layout.remove_unnamed(store, dcp_prefix(earlier), set())
        if count:
            owner._stats.saves += 1
        owner._tasks.spawn(owner._retain(), name="retention", detached=True)
