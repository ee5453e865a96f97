"""DCP's two format conversions for asyncstore's distributed layout:
:func:`dcp_to_torch_save` and :func:`torch_save_to_dcp`, with the names, argument order and
results of ``torch.distributed.checkpoint.format_utils``'s, so that switching the import is
enough; they take store URLs (``s3://``, ``file://``) as well as paths, and a
:class:`~asyncstore.torch.Checkpointer`'s run with a ``step``.

Both run in the calling process alone, as DCP's do (``no_dist``: no process group is needed,
and one that is initialized is not used). ``asyncstore export`` of a distributed checkpoint
and ``asyncstore import`` are these functions with a progress bar.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.futures import Future

from .._config import SaveConfig
from .._loop import run_sync
from ..checkpoint.engine import dcp_prefix, put_whole
from ..errors import AsyncStoreError, IntegrityError, InvalidArgument, NotFound
from ..stores import is_local, open_store
from ._checkpoint import Checkpointer
from ._torchload import load
from .dcp import StorageReader, StorageWriter

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]

# A Checkpointer opened by a conversion into a run keeps every version: deleting is left to
# the run's own Checkpointer (its keep_last) or ``asyncstore prune``.
_KEEP_ALL = 2**62


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike[str] | Checkpointer,
    torch_save_path: str | os.PathLike[str],
    *,
    step: int | None = None,
    store_options: dict[str, Any] | None = None,
    file_store_options: dict[str, Any] | None = None,
    weights_only: bool = False,
    progress: Any = None,
) -> str:
    """Write the distributed checkpoint at ``dcp_checkpoint_dir`` as one ``torch.save`` file
    at ``torch_save_path``: the whole state, every sharded tensor assembled at its full
    shape, the file ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes
    from DCP's own layout. Returns the URL written.

    Every chunk read is verified; the file is written atomically (``torch_save_path`` holds
    what it held before, or nothing, until the whole file is there). Like DCP's, this holds
    the whole state in memory, and here the file's bytes too.

    Args:
        dcp_checkpoint_dir: a directory written by :class:`asyncstore.torch.dcp.StorageWriter`
            (a path or URL); with ``step``, a run (its URL, or a
            :class:`~asyncstore.torch.Checkpointer`) whose distributed version of ``step``
            is read.
        torch_save_path: where the file goes: a path or URL.
        step: the version of the run at ``dcp_checkpoint_dir``.
        store_options: options for ``open_store`` of the checkpoint's store (a
            Checkpointer's own are used for it).
        file_store_options: options for the file's store; by default ``store_options``
            when both are S3 or both local, none otherwise.
        weights_only: check every non-tensor value with torch's restricted unpickler (and
            its allow-list) first. ``False`` as DCP's: a crafted checkpoint can run code, so
            pass ``True`` for one you do not trust.
        progress: a ``tqdm`` bar (or any object with ``reset(total=)`` and ``update(n)``)
            that counts the tensor bytes read; ``asyncstore export`` passes one.

    Raises:
        NotFound: there is no complete distributed checkpoint there (or no distributed
            version of ``step``).
        IntegrityError: it is damaged, or not in asyncstore's layout.
        UnsafeCheckpoint: with ``weights_only=True``, a value it refuses (named).
        InvalidArgument: a bad argument.
    """
    src, options = _dcp_place(dcp_checkpoint_dir, step, store_options, "dcp_to_torch_save")
    dst = _file(torch_save_path, "dcp_to_torch_save", "torch_save_path")
    _flag(weights_only, "dcp_to_torch_save")
    _bar(progress, "dcp_to_torch_save")
    file_options = _file_options(file_store_options, options, src, dst, "dcp_to_torch_save")
    return _write_torch_save(
        src, dst, options, file_options, weights_only=weights_only, bar=progress
    )


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike[str],
    dcp_checkpoint_dir: str | os.PathLike[str] | Checkpointer,
    *,
    step: int | None = None,
    store_options: dict[str, Any] | None = None,
    file_store_options: dict[str, Any] | None = None,
    weights_only: bool = False,
    save_config: SaveConfig | None = None,
    progress: Any = None,
) -> str:
    """Save the state dict in the ``torch.save`` file at ``torch_save_path`` as a distributed
    checkpoint in asyncstore's layout at ``dcp_checkpoint_dir``, as
    ``torch.distributed.checkpoint.format_utils.torch_save_to_dcp`` does in DCP's own;
    ``dcp.load(state, storage_reader=StorageReader(url))`` then loads it at any world size.
    Returns the checkpoint's URL.

    The checkpoint appears whole or not at all (its ``.metadata`` is written last); one that
    was there stays whole until the new one replaces it. A checkpoint file of
    :func:`asyncstore.torch.save` is read too.

    Args:
        torch_save_path: the file: a path or URL.
        dcp_checkpoint_dir: the checkpoint's directory (a path or URL); with ``step``, a run
            (its URL, or a :class:`~asyncstore.torch.Checkpointer`) to save the distributed
            version of ``step`` of. A run's URL gets a Checkpointer for the call that keeps
            every version; a Checkpointer's own options and retention apply, as for its
            ``dcp_save``.
        step: the version of the run at ``dcp_checkpoint_dir``.
        store_options: options for ``open_store`` of the checkpoint's store (a
            Checkpointer's own are used for it).
        file_store_options: options for the file's store; by default ``store_options``
            when both are S3 or both local, none otherwise.
        weights_only: load the file with torch's restricted unpickler. ``False`` as DCP's
            (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces it, as there): a crafted file can run
            code, so pass ``True`` for one you do not trust.
        save_config: how every rank object is saved (compression, level, chunk size…);
            the defaults when ``None``. With a Checkpointer, its own configuration applies.
        progress: a ``tqdm`` bar (or any object with ``reset(total=)`` and ``update(n)``)
            that counts the file's tensor bytes, once read and once written; ``asyncstore
            import`` passes one.

    Raises:
        NotFound: there is no file at ``torch_save_path``.
        InvalidArgument: the file holds no dict (DCP saves state dicts), or a bad argument.
        UnsafeCheckpoint: with ``weights_only=True``, the file holds what it refuses.
    """
    what = "torch_save_to_dcp"
    src = _file(torch_save_path, what, "torch_save_path")
    _flag(weights_only, what)
    _bar(progress, what)
    if save_config is not None and not isinstance(save_config, SaveConfig):
        raise InvalidArgument(
            f"{what}: save_config={save_config!r}: pass an asyncstore.SaveConfig or None"
        )
    run_url, options = _run_or_directory(dcp_checkpoint_dir, step, store_options, what)
    file_options = _file_options(file_store_options, options, run_url, src, what)
    if isinstance(dcp_checkpoint_dir, Checkpointer) and save_config is not None:
        raise InvalidArgument(
            f"{what}: save_config={save_config!r} with a Checkpointer, which saves with its "
            "own: pass save_config=None"
        )
    return _write_dcp(
        src,
        dcp_checkpoint_dir if isinstance(dcp_checkpoint_dir, Checkpointer) else run_url,
        file_options,
        options,
        step=step,
        weights_only=weights_only,
        bar=progress,
        config=save_config,
    )


def _write_torch_save(
    src: str,
    dst: str,
    options: dict[str, Any],
    file_options: dict[str, Any],
    *,
    weights_only: bool,
    bar: Any = None,
) -> str:
    """:func:`dcp_to_torch_save` of the checked checkpoint URL ``src`` to ``dst``; ``bar``
    (a ``tqdm``, or ``None``) counts the tensor bytes read."""
    state = _load_whole(src, options, weights_only, bar)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    del state
    return run_sync(put_whole(dst, file_options, buffer.getbuffer()))


def _write_dcp(
    src: str,
    dst: str | Checkpointer,
    file_options: dict[str, Any],
    options: dict[str, Any],
    *,
    step: int | None,
    weights_only: bool,
    bar: Any = None,
    config: SaveConfig | None = None,
) -> str:
    """:func:`torch_save_to_dcp` of the file ``src`` to the checkpoint directory ``dst``,
    or with ``step`` to that version of the run at ``dst`` (a URL, or a Checkpointer whose
    own options apply), saved with ``config`` (the defaults when ``None``); ``bar`` (a
    ``tqdm``, or ``None``) counts the file's tensor bytes, once read and once written."""
    state = read_state(src, file_options, weights_only=weights_only)
    if bar is not None:
        bar.reset(total=2 * _tensor_bytes(state))
        bar.update(_tensor_bytes(state))
    if isinstance(dst, Checkpointer):
        assert step is not None
        url = _save_version(dst, step, state)
    elif step is None:
        _save(state, StorageWriter(dst, store_options=options, save_config=config))
        url = run_sync(_store_url(dst, options))
    else:
        with Checkpointer(
            dst, store_options=options, keep_last=_KEEP_ALL, save_config=config
        ) as ckpt:
            url = _save_version(ckpt, step, state)
    if bar is not None:
        bar.update(_tensor_bytes(state))
    return url


def _save_version(ckpt: Checkpointer, step: int, state: dict[str, Any]) -> str:
    writer = ckpt.dcp_writer(step)
    _save(state, writer)
    assert writer.url is not None
    return writer.url


def read_state(src: str, file_options: dict[str, Any], *, weights_only: bool) -> dict[str, Any]:
    """The state dict in the file at ``src`` (a ``torch.save`` file, or an asyncstore
    checkpoint), loaded as DCP's ``torch_save_to_dcp`` loads it."""
    state = load(src, weights_only=weights_only, store_options=file_options)
    if not isinstance(state, dict):
        raise InvalidArgument(
            f"{src} holds a {type(state).__name__}, not a state dict: DCP saves dicts (save "
            "{'model': model.state_dict(), ...} with torch.save first)"
        )
    return state


async def _store_url(url: str, options: dict[str, Any]) -> str:
    async with open_store(url, **options) as store:
        return store.url


def _save(state: dict[str, Any], writer: StorageWriter) -> None:
    # DCP's own conversion (torch_save_to_dcp's saver), through asyncstore, in this
    # process alone.
    assert writer.url is not None
    try:
        _save_state_dict(state, storage_writer=writer, no_dist=True)
    except CheckpointException as exc:
        raise _cause(exc, writer.url, "written") from None


def _load_whole(src: str, options: dict[str, Any], weights_only: bool, bar: Any) -> dict[str, Any]:
    # DCP's own conversion (dcp_to_torch_save's planner and loader), read through
    # asyncstore, in this process alone.
    state: dict[str, Any] = {}
    reader = _CountingReader(src, store_options=options, weights_only=weights_only)
    reader.bar = bar
    try:
        _load_state_dict(
            state,
            storage_reader=reader,
            planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except CheckpointException as exc:
        if reader.failure is not None:  # DCP reports this one as an AssertionError
            raise reader.failure from None
        raise _cause(exc, src, "read") from None
    return state


def _cause(exc: CheckpointException, url: str, done: str) -> Exception:
    # DCP wraps what a step raised (with its traceback) per rank: the user wants ours.
    causes = [failure[0] for failure in exc.failures.values()]
    for cause in causes:
        if isinstance(cause, AsyncStoreError):
            return cause
    said = "; ".join(f"{type(cause).__name__}: {cause}" for cause in causes)
    return IntegrityError(f"{url} could not be {done} as a distributed checkpoint ({said})")


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _dcp_place(
    where: object, step: int | None, store_options: object, what: str
) -> tuple[str, dict[str, Any]]:
    # The checkpoint directory's URL and store options, for reading.
    run, options = _run_or_directory(where, step, store_options, what)
    if step is None:
        return run, options
    url = f"{run}/{dcp_prefix(step)}".rstrip("/")
    reader = StorageReader(url, store_options=options)
    try:
        reader.read_metadata()
    except NotFound:
        raise NotFound(
            f"{run}: there is no distributed version of step {step} (a version saved with "
            "Checkpointer.save is one object: asyncstore.torch.export writes it as a "
            "torch.save file)"
        ) from None
    return url, options


def _run_or_directory(
    where: object, step: object, store_options: object, what: str
) -> tuple[str, dict[str, Any]]:
    # A Checkpointer's run and its own options, or a checked URL and the options given.
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise InvalidArgument(f"{what}: step={step!r}: pass a version's step, an int >= 0")
    if not isinstance(where, Checkpointer):
        return _directory(where, what), _options(store_options, what, "store_options")
    if step is None:
        raise InvalidArgument(f"{what}: a Checkpointer needs step=: the version of its run")
    if store_options is not None:
        raise InvalidArgument(
            f"{what}: store_options={store_options!r} with a Checkpointer, which has its "
            "own: pass store_options=None"
        )
    return where.url, where.store_options


def _directory(where: object, what: str) -> str:
    if isinstance(where, os.PathLike):
        where = os.fspath(where)
    if not isinstance(where, str) or not where.strip("/"):
        raise InvalidArgument(
            f"{what}: dcp_checkpoint_dir={where!r}: pass a directory's path or URL (or, "
            "with step=, a run's URL or a Checkpointer)"
        )
    return where.rstrip("/")


def _file(where: object, what: str, name: str) -> str:
    if isinstance(where, os.PathLike):
        where = os.fspath(where)
    if not isinstance(where, str) or not where or where.endswith("/"):
        raise InvalidArgument(
            f"{what}: {name}={where!r}: pass a file's path or URL, such as 'model.pt' or "
            "'s3://bucket/export/model.pt'"
        )
    return where


def _bar(progress: object, what: str) -> None:
    if progress is not None and not (
        callable(getattr(progress, "reset", None)) and callable(getattr(progress, "update", None))
    ):
        raise InvalidArgument(
            f"{what}: progress={progress!r}: pass a tqdm bar (an object with reset(total=) "
            "and update(n)) or None"
        )


def _flag(weights_only: object, what: str) -> None:
    if not isinstance(weights_only, bool):
        raise InvalidArgument(f"{what}: weights_only={weights_only!r}: pass True or False")


def _options(options: object, what: str, name: str) -> dict[str, Any]:
    if options is not None and not isinstance(options, dict):
        raise InvalidArgument(f"{what}: {name}={options!r}: pass a dict or None")
    return dict(options or {})


def _file_options(
    given: object, options: dict[str, Any], one: str, other: str, what: str
) -> dict[str, Any]:
    # The file's store takes the checkpoint's options only where they are for a store of
    # the same kind (an S3 checkpoint converted to a local file takes none).
    if given is not None:
        return _options(given, what, "file_store_options")
    return options if _kind(one) == _kind(other) else {}


def _kind(url: str) -> str:
    return "file" if is_local(url) else url.partition("://")[0].lower()


class _CountingReader(StorageReader):
    """The plugin's reader, reading one rank object at a time and counting the tensor
    bytes read on a progress bar (when it has one)."""

    bar: Any = None
    failure: AsyncStoreError | None = None

    def read_metadata(self) -> Metadata:
        """As the plugin's, keeping its error for the caller."""
        try:
            return super().read_metadata()
        except AsyncStoreError as exc:
            self.failure = exc
            raise

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """As the plugin's, and size the bar: every tensor's bytes, whole."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._dtypes = {
            fqn: meta.properties.dtype
            for fqn, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        if self.bar is not None:
            self.bar.reset(
                total=sum(
                    math.prod(meta.size) * meta.properties.dtype.itemsize
                    for meta in metadata.state_dict_metadata.values()
                    if isinstance(meta, TensorStorageMetadata)
                )
            )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """As the plugin's, one rank object after another, the bar moving after each."""
        if self.bar is None:
            return super().read_data(plan, planner)
        groups: dict[object, list[ReadItem]] = {}
        for item in plan.items:
            where = self.storage_data.get(item.storage_index)
            groups.setdefault(where[0] if isinstance(where, tuple) else None, []).append(item)
        done: Future[None] | None = None
        for items in groups.values():
            done = super().read_data(dataclasses.replace(plan, items=items), planner)
            done.wait()
            self.bar.update(sum(self._item_bytes(item) for item in items))
        return done if done is not None else super().read_data(plan, planner)

    def _item_bytes(self, item: ReadItem) -> int:
        dtype = self._dtypes.get(item.storage_index.fqn)
        return 0 if dtype is None else math.prod(item.lengths) * dtype.itemsize
