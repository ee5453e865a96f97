"""The plugin's ``StorageWriter`` (see :mod:`asyncstore.torch.dcp`): each rank writes its
items as one checkpoint object through the checkpoint engine, with one
:class:`~asyncstore.SaveConfig` for every rank's object; the
coordinator commits the checkpoint by writing DCP's metadata last."""

from __future__ import annotations

import io
import logging
import os
import secrets
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._config import DEFAULT_SAVE_CHUNK_BYTES, DEFAULT_STAGING_BYTES, SaveConfig
from .._loop import run_sync
from ..checkpoint import SaveResult
from ..checkpoint.engine import (
    METADATA,
    DistributedVersion,
    build_save_config,
    encode_metadata,
    is_rank_object,
    objects_named,
    read_metadata,
    start_save,
)
from ..errors import AsyncStoreError, IntegrityError, InvalidArgument, NotFound
from ..stores import open_store
from ._dcpguard import refuse_shared_group
from ._dcpplace import checked_url, done, openable, place

_logger = logging.getLogger("asyncstore.checkpoint")

__all__ = ["StorageWriter", "VersionWriter"]


async def _commit(url: str, metadata: Metadata, options: dict[str, Any]) -> None:
    # .metadata replaces the one there (if any) at once; then the objects that only the
    # replaced checkpoint named go. Nothing else is touched: another save into the same
    # directory may be writing (what killed saves left is gc()'s, which knows when none is).
    async with open_store(url, **options) as store:
        try:
            replaced = objects_named(await read_metadata(store, ""))
        except (NotFound, IntegrityError):
            replaced = set()  # nothing there, or damaged: its objects are left alone
        await store.put(METADATA, encode_metadata(metadata))
        stale = replaced - objects_named(metadata)
        foreign = []
        try:
            for name in sorted(stale):
                # The replaced .metadata says what to remove, but it may be crafted or copied
                # from elsewhere: only a rank object a save wrote here goes.
                if await is_rank_object(store, "", name):
                    await store.delete(name)
                else:
                    foreign.append(name)
        except (AsyncStoreError, OSError) as exc:
            # The checkpoint is committed: a failed tidy-up must not report it as failed.
            _logger.warning("%s: could not remove the replaced checkpoint's objects (%s)", url, exc)
        if foreign:
            _logger.warning(
                "%s: the replaced %s named %d objects that are not rank objects of a save "
                "there (%s); left alone",
                url,
                METADATA,
                len(foreign),
                ", ".join(repr(name) for name in foreign[:5]) + (", …" if len(foreign) > 5 else ""),
            )


async def _exists(url: str, options: dict[str, Any]) -> bool:
    async with open_store(url, **options) as store:
        try:
            await store.stat(METADATA)
        except NotFound:
            return False
        return True


class StorageWriter(_StorageWriter):
    """DCP's ``StorageWriter`` over asyncstore: ``dcp.save(state, storage_writer=
    StorageWriter("s3://bucket/run1/step-1000", store_options={...}))``.

    Args:
        url: the checkpoint's directory (any store URL, or a local path); DCP's
            ``checkpoint_id``, when given, takes its place.
        store_options: options for :func:`asyncstore.open_store`.
        compression, level, chunk_bytes, staging_bytes, exclude, metadata, priority: as
            for :func:`asyncstore.save`, for every rank's object (``metadata`` is kept in
            each one's manifest).
        save_config: the same options as one :class:`~asyncstore.SaveConfig`, instead of
            the keywords.
        overwrite: replace a checkpoint already at the URL (the default, as DCP's
            ``FileSystemWriter``; the one there stays whole until the new one is complete).
            With ``False``, a save where a checkpoint exists fails before anything is
            written: :class:`~asyncstore.InvalidArgument`, whose message says "Checkpoint
            already exists" as DCP's does (DCP raises it as a ``CheckpointException``).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        store_options: dict[str, Any] | None = None,
        compression: Literal["auto", "zstd"] | None = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        priority: Literal["low", "normal"] = "low",
        chunk_bytes: int = DEFAULT_SAVE_CHUNK_BYTES,
        overwrite: bool = True,
        level: int = 1,
        exclude: Iterable[str] = (),
        metadata: dict[str, Any] | None = None,
        save_config: SaveConfig | None = None,
    ) -> None:
        super().__init__()
        self.url, self.store_options = place(url, store_options, "StorageWriter")
        if not isinstance(overwrite, bool):
            raise InvalidArgument(f"StorageWriter: overwrite={overwrite!r}: pass a bool")
        self.overwrite = overwrite
        # Checked here, not on every rank's first write.
        self.save_config = build_save_config("StorageWriter", save_config, locals())
        self.is_coordinator = False
        self._rank = 0
        self._save = secrets.token_hex(8)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new checkpoint (at ``checkpoint_id``, when given)."""
        if checkpoint_id is not None:
            self.url = checked_url(checkpoint_id, "StorageWriter")
        if self.url is None:
            raise InvalidArgument("StorageWriter has no URL: pass one, or a checkpoint_id")

    def __bool__(self) -> bool:
        # DCP's save asks ``if storage_writer:`` first thing, on the thread it saves on and
        # before any collective: the one moment a save that would hang (a background save on
        # the default group) can be refused on every rank without a collective to report it
        # (set_up_storage_writer runs inside the first one, whose gather of the error could
        # itself meet DDP's all-reduces).
        refuse_shared_group(self.url or "the checkpoint")
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Start a save on this rank (DCP calls this on every rank for every save): note
        whether the rank writes the metadata, and name the object it writes anew."""
        assert self.url is not None
        refuse_shared_group(self.url)
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if not isinstance(rank, int):
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._rank = rank
        # New for every save, on every rank: DCP may reuse an earlier save's plan (plan
        # caching), so the name cannot come from the plan; an object the current
        # .metadata names is never written over.
        self._save = secrets.token_hex(8)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """This rank's plan, unchanged; on the coordinator, with ``overwrite=False``, once
        it is clear that no checkpoint is at the URL.

        Raises:
            InvalidArgument: ``overwrite=False`` and a checkpoint exists at the URL
                ("Checkpoint already exists", as DCP says).
        """
        if not self.overwrite and self.is_coordinator:
            # One rank asks, before any rank writes: DCP gathers this step's errors and
            # raises them on every rank, so no rank writes a byte.
            assert self.url is not None
            if run_sync(_exists(self.url, self.store_options)):
                raise InvalidArgument(
                    f"Checkpoint already exists at {self.url} and overwrite=False: save to "
                    "another checkpoint_id, or pass StorageWriter(..., overwrite=True) to "
                    "replace it (the one there stays whole until the new one is complete)"
                )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Every rank's plan, unchanged (each rank names its own object)."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as one checkpoint object; the results name each entry."""
        assert self.url is not None
        name = f"__{self._rank}_{self._save}.ckpt"
        entries: dict[str, torch.Tensor] = {}
        results = []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = bytearray(data.getbuffer())
                tensor = (
                    torch.frombuffer(raw, dtype=torch.uint8)
                    if raw
                    else torch.empty(0, dtype=torch.uint8)
                )
            else:
                assert isinstance(data, torch.Tensor)
                tensor = data.detach()
                if not tensor.is_contiguous() or (
                    tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
                ):
                    # A view: saved alone, not with the whole storage it lies in.
                    tensor = tensor.clone(memory_format=torch.contiguous_format)
            entry = _entry_name(item.index.fqn, i, entries)
            entries[entry] = tensor
            size = tensor.numel() * tensor.element_size()
            results.append(WriteResult(item.index, size, (name, entry)))
        if entries:
            run_sync(self._write(f"{self.url}/{name}", entries))
        return done(results)

    async def _write(self, target: str, entries: dict[str, torch.Tensor]) -> None:
        handle = await start_save(entries, target, self.save_config, self.store_options)
        self._written(await handle)

    def _written(self, result: SaveResult) -> None:
        """Called on each rank once its object is written."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write DCP's metadata (the coordinator, once every rank has written): the
        checkpoint becomes visible, replacing the one there; then remove what only the
        replaced one, or saves killed mid-way, wrote."""
        assert self.url is not None
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        run_sync(_commit(self.url, metadata, self.store_options))
        self._committed()

    def _committed(self) -> None:
        """Called on the coordinator once the checkpoint is complete."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a place this plugin can open: a local path, or a
        ``file://``, ``memory://NAME`` or ``s3://BUCKET`` URL (DCP takes the first plugin
        that says yes, so any other URL is left to the plugins that know it)."""
        return openable(checkpoint_id)


class VersionWriter(StorageWriter):
    """The writer of ``version``, one numbered version of a Checkpointer's run: with the
    checkpointer's options, reporting to it as the save goes; on the coordinator, the
    version commits once it is complete."""

    def __init__(self, version: DistributedVersion) -> None:
        super().__init__(
            version.url, store_options=version.store_options, save_config=version.save_config
        )
        self.version = version
        self.counted = False  # set by a caller that counts the save itself (dcp_save)

    def _written(self, result: SaveResult) -> None:
        self.version.written(result)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start the version's save; it has its own place, so ``checkpoint_id`` must be
        ``None``."""
        if checkpoint_id is not None:
            raise InvalidArgument(
                f"checkpoint_id={checkpoint_id!r}: this writer saves a Checkpointer's version "
                f"at {self.url}; pass no checkpoint_id (or use a plain StorageWriter)"
            )
        super().reset()

    def _committed(self) -> None:
        try:
            run_sync(self.version.commit(count=not self.counted))
        except Exception as exc:
            # The version is committed: what follows (retention, tidying) is the
            # checkpointer's, and its failure (say, it was closed first) must not report the
            # save as failed.
            _logger.warning(
                "%s is saved, but its checkpointer could not run retention after it (%s)",
                self.url,
                exc,
            )

    def __reduce__(self) -> Any:
        raise InvalidArgument(
            f"the writer of {self.url} belongs to a Checkpointer of this process and cannot "
            "be sent to another one: use dcp.async_save's default thread mode with it (or a "
            "plain StorageWriter, which has no retention)"
        )


def _entry_name(fqn: str, position: int, taken: dict[str, Any]) -> str:
    """The entry of a write item in its rank object: the state's name (so ``exclude``
    patterns, messages and ``asyncstore inspect`` speak of ``model.layer.bias``), made
    unique by the item's position where one rank writes several pieces of one name. The
    reader finds entries through DCP's metadata, whatever their names (older saves used
    the positions alone)."""
    name = fqn if isinstance(fqn, str) and fqn else str(position)
    while name in taken:
        name = f"{name}#{position}"
    return name
