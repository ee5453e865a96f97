"""A ``torch.distributed.checkpoint`` storage plugin over any asyncstore store.

``dcp.save(state, storage_writer=StorageWriter(url))`` and
``dcp.load(state, storage_reader=StorageReader(url))`` keep DCP's planning, resharding and
collectives, and put the bytes through asyncstore's checkpoint engine: each rank writes its
items as one checkpoint object (compressed where it pays, every chunk checksummed, staged
in bounded memory, atomic), and the coordinator writes DCP's metadata last, so a checkpoint
is complete or invisible. A load reads, from each rank's object, only the entries its plan
asks for, and verifies every chunk it reads.

Layout under ``url``: ``__<rank>_<save>.ckpt`` per rank that wrote items (``<save>`` new for
every save, so saving again into the same directory never writes over the checkpoint there
until the new one is complete), and ``.metadata`` (DCP's ``Metadata``, checksummed; read back
with an unpickler that builds only DCP's metadata classes). See
:mod:`asyncstore.checkpoint._distributed`.

With a :class:`asyncstore.torch.Checkpointer`, ``ckpt.dcp_writer(step)`` and
``ckpt.dcp_reader()`` save and load numbered versions of a run, with its retention.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._config import DEFAULT_SAVE_CHUNK_BYTES, DEFAULT_STAGING_BYTES
from .._loop import run_sync
from ..checkpoint import SaveResult
from ..checkpoint import load as _load
from ..checkpoint import save as _save
from ..checkpoint._distributed import (
    METADATA,
    RANK_OBJECT,
    encode_metadata,
    is_rank_object,
    objects_named,
    read_metadata,
)
from ..checkpoint._save import _config as _save_config
from ..errors import (
    AsyncStoreError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    UnsafeCheckpoint,
    _plain,
)
from ..stores import Store, open_store
from ..stores._open import is_local, local_path
from ._dcpguard import refuse_shared_group, refuse_untaken, untaken_optimizer_entries

_logger = logging.getLogger("asyncstore.checkpoint")

__all__ = ["StorageReader", "StorageWriter"]


def _url(checkpoint_id: Any, what: str) -> str:
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    url = checkpoint_id.rstrip("/") if isinstance(checkpoint_id, str) else ""
    if not url or url.endswith(":/"):
        raise InvalidArgument(
            f"{what}: checkpoint_id={checkpoint_id!r}: pass a directory URL or path, such as "
            "'s3://bucket/run1/step-1000' or '/ckpt/step-1000'"
        )
    return url


def _openable(checkpoint_id: object) -> bool:
    # What open_store can open: a plain path, file://, memory://NAME, s3://BUCKET. DCP asks
    # each plugin in turn and takes the first that says yes, so a yes here for a URL we
    # cannot open would take it from a plugin that can (and fail later, further from the
    # cause).
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or "\x00" in checkpoint_id:
        return False
    if not is_local(checkpoint_id):
        scheme, _, rest = checkpoint_id.partition("://")
        return scheme.lower() in ("memory", "s3") and bool(rest.split("/", 1)[0])
    try:
        local_path(_url(checkpoint_id, "validate_checkpoint_id"))
    except AsyncStoreError:
        return False
    return True


def _place(
    url: str | os.PathLike[str] | None, store_options: object, what: str
) -> tuple[str | None, dict[str, Any]]:
    """The checked URL (if any) and store options of a writer or reader."""
    if store_options is not None and not isinstance(store_options, dict):
        raise InvalidArgument(f"{what}: store_options={store_options!r}: pass a dict or None")
    return (None if url is None else _url(url, what)), dict(store_options or {})


def _forced_weights_only() -> bool:
    # As torch.load reads it: DCP's planner calls torch.load(weights_only=False), which
    # this variable turns into True.
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


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


async def _read_metadata(url: str, options: dict[str, Any]) -> Metadata:
    async with open_store(url, **options) as store:
        return await read_metadata(store, "")


class StorageWriter(_StorageWriter):
    """DCP's ``StorageWriter`` over asyncstore: ``dcp.save(state, storage_writer=
    StorageWriter("s3://bucket/run1/step-1000", store_options={...}))``.

    Args:
        url: the checkpoint's directory (any store URL, or a local path); DCP's
            ``checkpoint_id``, when given, takes its place.
        store_options: options for :func:`asyncstore.open_store`.
        compression, staging_bytes, priority, chunk_bytes: as for :func:`asyncstore.save`.
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
    ) -> None:
        super().__init__()
        self.url, self.store_options = _place(url, store_options, "StorageWriter")
        if not isinstance(overwrite, bool):
            raise InvalidArgument(f"StorageWriter: overwrite={overwrite!r}: pass a bool")
        self.overwrite = overwrite
        # Checked here, not on every rank's first write.
        _save_config(compression, 1, chunk_bytes, staging_bytes, (), None, priority)
        self._save_options: dict[str, Any] = {
            "compression": compression,
            "staging_bytes": staging_bytes,
            "priority": priority,
            "chunk_bytes": chunk_bytes,
            "store_options": self.store_options,
        }
        self.is_coordinator = False
        self._rank = 0
        self._save = secrets.token_hex(8)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new checkpoint (at ``checkpoint_id``, when given)."""
        if checkpoint_id is not None:
            self.url = _url(checkpoint_id, "StorageWriter")
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
            entry = str(i)
            entries[entry] = tensor
            size = tensor.numel() * tensor.element_size()
            results.append(WriteResult(item.index, size, (name, entry)))
        if entries:
            run_sync(self._write(f"{self.url}/{name}", entries))
        return _done(results)

    async def _write(self, target: str, entries: dict[str, torch.Tensor]) -> None:
        handle = await _save(entries, target, **self._save_options)
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
        return _openable(checkpoint_id)


class _VersionWriter(StorageWriter):
    """The writer of one numbered version of a :class:`asyncstore.torch.Checkpointer`'s
    run: ``on_commit`` runs on the coordinator once the version is complete."""

    def __init__(
        self,
        url: str,
        *,
        step: int,
        on_commit: Callable[[], None],
        on_written: Callable[[SaveResult], None],
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        self.step = step
        self.committed = False  # read by the checkpointer: its step is not a leftover
        self.counted = False  # set by a caller that counts the save itself (dcp_save)
        self._on_commit = on_commit
        self._on_written = on_written

    def _written(self, result: SaveResult) -> None:
        self._on_written(result)

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
        self.committed = True
        try:
            self._on_commit()
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
        self.url, self.store_options = _place(url, store_options, "StorageReader")
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
            self.url = _url(checkpoint_id, "StorageReader")
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
        return _done(None)

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
                    f"refuses ({_plain(exc)}); allow its classes with "
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
        return _openable(checkpoint_id)
