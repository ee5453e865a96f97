"""The plugin's ``StorageReader`` (see :mod:`asyncstore.torch.dcp`): each rank reads, from
each rank object, only the entries its plan asks for, every chunk verified, and checks
non-tensor values before DCP unpickles them."""

from __future__ import annotations

import ctypes
import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.futures import Future

from .._loop import run_sync
from .._text import plain
from ..checkpoint import load as _load
from ..checkpoint.engine import METADATA, RANK_OBJECT, read_metadata
from ..errors import IntegrityError, InvalidArgument, NotFound, UnsafeCheckpoint
from ..stores import Store, open_store
from ._dcpguard import refuse_untaken, untaken_optimizer_entries
from ._dcpplace import checked_url, done, openable, place

__all__ = ["StorageReader"]


def _forced_weights_only() -> bool:
    # As torch.load reads it: DCP's planner calls torch.load(weights_only=False), which
    # this variable turns into True.
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


async def _read_metadata(url: str, options: dict[str, Any]) -> Metadata:
    async with open_store(url, **options) as store:
        return await read_metadata(store, "")


class StorageReader(_StorageReader):
    """DCP's ``StorageReader`` over asyncstore: ``dcp.load(state, storage_reader=
    StorageReader("s3://bucket/run1/step-1000", store_options={...}))``.

    Every chunk read is verified; a damaged one raises :class:`~asyncstore.IntegrityError`
    naming the item's object and the state's key. Each rank reads only the entries its plan needs.

    ``.metadata`` is checksummed and unpickled with an allow-list of DCP's metadata classes,
    and the ranks' objects are read with ``weights_only=True``. The non-tensor values of the
    state (an ``io.BytesIO``, numpy scalars, your own objects) are pickles that DCP's planner
    unpickles with ``torch.load(weights_only=False)``, as it does for its own
    ``FileSystemReader``: by default this reader loads what DCP loads, by DCP's rules (so
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` restricts them as it does there). A crafted value
    can then run code: for a checkpoint you do not trust, pass ``weights_only=True``.

    Args:
        url: the checkpoint's directory; DCP's ``checkpoint_id``, when given, takes its place.
        store_options: options for :func:`asyncstore.open_store`.
        weights_only: check every non-tensor value with torch's restricted unpickler (and
            its allow-list: ``torch.serialization.add_safe_globals``, ``safe_globals()``)
            before DCP unpickles it; :class:`~asyncstore.UnsafeCheckpoint` names the
            state's key it refuses. ``False`` by default, as DCP; the variable
            ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` turns it on, as it does for ``torch.load``.
        partial_optimizer: allow a load that takes an optimizer's ``param_groups`` but not
            every saved entry of its ``state`` (by default :class:`~asyncstore.InvalidArgument`
            names the entries left out: a template from a fresh optimizer's ``state_dict()``
            has no moments, and DCP would skip AdamW's ``exp_avg`` without a word).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        store_options: dict[str, Any] | None = None,
        weights_only: bool = False,
        partial_optimizer: bool = False,
    ) -> None:
        super().__init__()
        self.url, self.store_options = place(url, store_options, "StorageReader")
        for name, flag in (
            ("weights_only", weights_only),
            ("partial_optimizer", partial_optimizer),
        ):
            if not isinstance(flag, bool):
                raise InvalidArgument(f"StorageReader: {name}={flag!r}: pass a bool")
        self.weights_only = weights_only
        self.partial_optimizer = partial_optimizer
        self._names: list[str] = []  # every entry the checkpoint holds (DCP's flat names)
        self.storage_data: dict[Any, tuple[str, str]] = {}
        self._saved: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start reading a checkpoint (at ``checkpoint_id``, when given)."""
        if checkpoint_id is not None:
            self.url = checked_url(checkpoint_id, "StorageReader")
        if self.url is None:
            raise InvalidArgument("StorageReader has no URL: pass one, or a checkpoint_id")

    def read_metadata(self) -> Metadata:
        """DCP's metadata, written last by the save's coordinator.

        Raises:
            NotFound: there is no complete checkpoint at the URL.
            IntegrityError: ``.metadata`` is damaged, or was not written by this plugin.
        """
        assert self.url is not None
        try:
            return run_sync(_read_metadata(self.url, self.store_options))
        except NotFound:
            raise NotFound(
                f"{self.url} holds no complete DCP checkpoint (no {METADATA}): the save did not "
                "finish, or the URL is wrong"
            ) from None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep where every item lies, and each saved shard's shape and dtype."""
        self.storage_data = dict(metadata.storage_data or {})
        self._names = list(metadata.state_dict_metadata)
        self._saved = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                for chunk in meta.chunks:
                    key = (fqn, tuple(chunk.offsets))
                    self._saved[key] = (tuple(chunk.sizes), meta.properties.dtype)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Every rank's plan, unchanged, once it is clear that together they take every
        saved entry of each optimizer state they load (unless ``partial_optimizer``)."""
        if not self.partial_optimizer:
            assert self.url is not None
            asked = {item.storage_index.fqn for plan in plans for item in plan.items}
            refuse_untaken(self.url, untaken_optimizer_entries(self._names, asked))
        return plans

    def _entry(self, item: ReadItem) -> tuple[str, str]:
        where = self.storage_data.get(item.storage_index)
        if (
            not isinstance(where, tuple)
            or len(where) != 2
            or not all(isinstance(part, str) for part in where)
            or not RANK_OBJECT.match(where[0])
        ):
            raise IntegrityError(
                f"{self.url}/{METADATA} does not say where {item.storage_index} lies"
            )
        return where

    def _chunk_key(self, item: ReadItem) -> tuple[str, tuple[int, ...]]:
        index = item.storage_index
        return index.fqn, tuple(index.offset or ())

    def _fills_whole(self, item: ReadItem, target: torch.Tensor) -> bool:
        # The item is a whole saved shard, and the target the same shape and dtype,
        # contiguous on the CPU: the shard's bytes can be read straight into it.
        saved = self._saved.get(self._chunk_key(item))
        return (
            saved is not None
            and all(offset == 0 for offset in item.storage_offsets)
            and tuple(item.lengths) == saved[0] == tuple(target.shape)
            and target.dtype == saved[1]
            and target.device.type == "cpu"
            and target.is_contiguous()
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items: from each object, only the entries they lie in; a whole
        shard straight into its target tensor's memory, with no copy in between."""
        assert self.url is not None
        wanted: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            wanted.setdefault(self._entry(item)[0], []).append(item)
        store = open_store(self.url, **self.store_options)
        try:
            for name, items in wanted.items():
                self._read_object(store, name, items, planner)
        finally:
            run_sync(store.aclose())
        return done(None)

    def _read_object(
        self, store: Store, name: str, items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        whole: dict[str, torch.Tensor] = {}
        filled: list[tuple[ReadItem, torch.Tensor]] = []
        rest: list[tuple[ReadItem, torch.Tensor | None]] = []
        for item in items:
            entry = self._entry(item)[1]
            target = None
            if item.type == LoadItemType.TENSOR:
                target = planner.resolve_tensor(item).detach()
                if entry not in whole and self._fills_whole(item, target):
                    whole[entry] = target
                    filled.append((item, target))
                    continue
            rest.append((item, target))
        if whole:
            self._load(store, name, [item.storage_index.fqn for item, _ in filled], into=whole)
            for item, target in filled:
                planner.commit_tensor(item, target)
        if not rest:
            return
        keys = sorted({self._entry(item)[1] for item, _ in rest})
        loaded = self._load(store, name, [item.storage_index.fqn for item, _ in rest], keys=keys)
        for item, target in rest:
            entry = self._entry(item)[1]
            value = loaded[entry]
            fqn = item.storage_index.fqn
            if target is None:
                planner.load_bytes(item, io.BytesIO(self._bytes(value, name, fqn)))
                continue
            saved = self._saved.get(self._chunk_key(item))
            if (
                not isinstance(value, torch.Tensor)
                or saved is None
                or (tuple(value.shape), value.dtype) != saved
            ):
                raise IntegrityError(
                    f"{self.url}/{name}: {fqn!r} is not the tensor {METADATA} describes: the "
                    "checkpoint is damaged"
                )
            source = value
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                source = source.narrow(dim, start, length)
            if target.size() != source.size():
                raise IntegrityError(
                    f"{self.url}/{name}: {fqn!r} at {tuple(item.storage_offsets)} has shape "
                    f"{tuple(source.size())}, the plan wants {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)

    def _load(self, store: Store, name: str, fqns: list[str], **options: Any) -> Any:
        # The object's entries are numbered; a refusal names the state's keys read from it.
        shown = ", ".join(repr(fqn) for fqn in sorted(set(fqns))[:5])
        keys = f"{shown}, …" if len(set(fqns)) > 5 else shown
        try:
            return run_sync(_load((store, name), **options))
        except NotFound:
            raise IntegrityError(
                f"{self.url}/{name} is missing, and with it {keys}: the checkpoint lost a "
                "rank's shards (damaged, or deleted outside asyncstore); load an earlier one"
            ) from None
        except InvalidArgument as exc:
            # into= found an entry of another shape or dtype than .metadata says.
            raise IntegrityError(
                f"{self.url}/{name} does not hold the tensors {METADATA} describes for {keys} "
                f"({exc}): the checkpoint is damaged"
            ) from None
        except (IntegrityError, UnsafeCheckpoint) as exc:
            raise type(exc)(f"{exc} (reading {keys})") from None

    def _bytes(self, value: Any, name: str, fqn: str) -> bytes:
        # A non-tensor value: its pickle, as one flat run of uint8 the object holds whole.
        if (
            not isinstance(value, torch.Tensor)
            or value.dtype != torch.uint8
            or value.dim() != 1
            or not value.is_contiguous()
            or value.untyped_storage().nbytes() < value.storage_offset() + value.numel()
        ):
            raise IntegrityError(
                f"{self.url}/{name}: {fqn!r} should be a value's bytes and is not: the "
                "checkpoint is damaged"
            )
        raw = ctypes.string_at(value.data_ptr(), value.numel()) if value.numel() else b""
        if self.weights_only or _forced_weights_only():
            # Checked here, not left to DCP's torch.load, so that a refusal names the key.
            try:
                torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as exc:
                raise UnsafeCheckpoint(
                    f"{self.url}/{name}: {fqn!r} holds a value that weights_only=True "
                    f"refuses ({plain(exc)}); allow its classes with "
                    "torch.serialization.add_safe_globals, or load a checkpoint you trust "
                    "with StorageReader(..., weights_only=False) and without "
                    "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
                ) from None
        return raw

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a place this plugin can open: a local path, or a
        ``file://``, ``memory://NAME`` or ``s3://BUCKET`` URL (DCP takes the first plugin
        that says yes, so any other URL is left to the plugins that know it)."""
        return openable(checkpoint_id)
