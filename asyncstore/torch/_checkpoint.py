"""``torch.save`` / ``torch.load`` replacements over the checkpoint engine, for sync code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Unpack

import torch

from .._concurrency import ExitStep, at_exit, to_thread
from .._loop import bridge_loop, run_sync
from ..checkpoint import Checkpointer as _AsyncCheckpointer
from ..checkpoint import CheckpointerStats, SaveHandle, SaveResult, VerifyReport, Version
from ..checkpoint import load as _load
from ..checkpoint import read_manifest as _read_manifest
from ..checkpoint import save as _save
from ..checkpoint._load import LoadOptions
from ..checkpoint._save import SaveOptions
from ..checkpoint._target import resolve as _resolve
from ..errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreError,
    StoreUnavailable,
)

if TYPE_CHECKING:
    from . import dcp

__all__ = ["Checkpointer", "save", "save_async", "load", "export"]

logger = logging.getLogger("asyncstore.checkpoint")

# Saves started with save_async and not finished: the interpreter waits for them at exit,
# as it would for torch.save, rather than dropping them with the background thread.
_PENDING: set[concurrent.futures.Future[SaveResult]] = set()


def _finish_pending() -> None:
    pending = list(_PENDING)
    if pending:
        logger.warning("waiting for %d checkpoint save(s) to finish before exiting", len(pending))
    for future in pending:
        try:
            future.result()
        except Exception:
            logger.exception("a checkpoint save failed at exit")


at_exit(ExitStep.FINISH_SAVES, _finish_pending)  # while the background loop still runs


def _check_options(options: dict[str, Any], allowed: frozenset[str], func: str) -> None:
    # The async functions would raise a bare TypeError for a misspelt option.
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise InvalidArgument(
            f"{func}() got unknown option(s) {', '.join(f'{name}=' for name in unknown)}; the "
            f"options are: {', '.join(sorted(allowed))}"
        )


async def _save_and_wait(obj: Any, f: Any, options: SaveOptions) -> SaveResult:
    handle = await _save(obj, f, **options)
    return await handle.wait()


def save(obj: Any, f: Any, **options: Unpack[SaveOptions]) -> SaveResult:
    """Save ``obj`` like ``torch.save``, and return once the checkpoint is committed.

    ``f`` is what ``torch.save`` accepts (a path, a PathLike, a writable binary file object)
    or a URL (``"s3://bucket/run/step-100.ckpt"``, ``"file:///…"``). A path or URL is
    written atomically: it holds the old checkpoint (or nothing) until the new one is
    complete. Options (``compression``, ``level``, ``chunk_bytes``, ``staging_bytes``,
    ``exclude``, ``metadata``, ``store_options``, ``priority``) as for
    :func:`asyncstore.save`.
    """
    _check_options(dict(options), SaveOptions.__optional_keys__, "save")
    return run_sync(_save_and_wait(obj, f, options))


def save_async(
    obj: Any, f: Any, **options: Unpack[SaveOptions]
) -> concurrent.futures.Future[SaveResult]:
    """Start saving ``obj`` and return once its tensors are snapshotted.

    The training loop may change its tensors as soon as this returns. Compression and
    writing go on in asyncstore's background thread; the returned future gives the
    :class:`~asyncstore.SaveResult` (``future.result()`` waits for the commit) or raises
    the save's error. Errors in the arguments raise here, at once. Options as for
    :func:`save`.
    """
    _check_options(dict(options), SaveOptions.__optional_keys__, "save_async")
    try:
        handle = run_sync(_save(obj, f, **options))
    except (NotFound, PermissionDenied, StoreError, StoreUnavailable) as exc:
        # The store's errors (a server down, a missing bucket) are the save's outcome,
        # given by the future like those that come after the snapshot.
        failed: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        failed.set_exception(exc)
        return failed
    return _pending(handle)


def _pending(handle: SaveHandle) -> concurrent.futures.Future[SaveResult]:
    # A future for the commit, waited for at interpreter exit if still running.
    future = asyncio.run_coroutine_threadsafe(handle.wait(), bridge_loop())
    _PENDING.add(future)
    future.add_done_callback(_PENDING.discard)
    return future


def load(f: Any, map_location: Any = None, **options: Unpack[LoadOptions]) -> Any:
    """Load a checkpoint like ``torch.load``, verifying every chunk.

    Reads checkpoints written by :func:`save` and plain ``torch.save`` files alike, so code
    can switch without converting anything. ``weights_only=True`` by default. Options
    (``weights_only``, ``keys``, ``into``, ``safe_globals``, ``store_options``) as for
    :func:`asyncstore.load`.
    """
    _check_options(dict(options), LoadOptions.__optional_keys__, "load")
    return run_sync(_load(f, map_location=map_location, **options))


def export(src: Any, dst: Any, *, store_options: dict[str, Any] | None = None) -> str:
    """Write the asyncstore checkpoint at ``src`` as a plain ``torch.save`` file at ``dst``,
    for code that reads checkpoints with ``torch.load`` (which cannot read asyncstore's
    format). Returns the URL written.

    The checkpoint is loaded with ``weights_only=True`` and every chunk verified, its
    tensors on the CPU (``torch.load(dst, map_location=...)`` places them later); then
    ``dst`` is written atomically: it holds what it held before (or nothing) until the
    whole file is there. The file is built in memory first, so this needs about twice the
    checkpoint's size in memory.

    Args:
        src: the checkpoint: a path, a URL or a ``(store, key)`` pair.
        dst: where the ``torch.save`` file goes: a local path, a URL
            (``"s3://bucket/export/model.pt"``) or a ``(store, key)`` pair.
        store_options: options for ``open_store`` when ``src`` or ``dst`` is a URL or path.

    Raises:
        NotFound: there is nothing at ``src``.
        IntegrityError: ``src`` is not an asyncstore checkpoint, or it is damaged.
        UnsafeCheckpoint: it holds objects ``weights_only=True`` refuses.
        InvalidArgument: ``dst`` is a file object, or another bad argument.
    """
    return run_sync(_export(src, dst, store_options))


async def _export(src: Any, dst: Any, store_options: dict[str, Any] | None) -> str:
    if not isinstance(dst, str | os.PathLike | tuple):
        raise InvalidArgument(
            f"export(dst={dst!r}): pass a path, a URL or a (store, key) pair; the file is "
            "written atomically, which a file object cannot be"
        )
    # The manifest first: a torch.save file at src is refused rather than copied.
    await _read_manifest(src, store_options=store_options)
    state = await _load(src, map_location="cpu", store_options=store_options)
    buffer = io.BytesIO()
    await to_thread(torch.save, state, buffer)
    del state
    target = _resolve(dst, store_options, writing=True)
    try:
        assert target.store is not None
        assert target.key is not None
        await target.store.put(target.key, buffer.getbuffer())  # atomic in every store
        return target.url
    finally:
        await target.aclose()


def _agreed(find: Callable[[], int], group: Any = None) -> int:
    """``find()`` on rank 0, broadcast to every rank of ``group`` (the default group when
    ``None``; its error too, raised on every rank); in one process, ``find()``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return find()
    outcome: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", find())
        except Exception as exc:  # told to every rank, which would wait forever otherwise
            error = exc
            kind = (
                "missing"
                if isinstance(exc, NotFound)
                else "damaged"
                if isinstance(exc, IntegrityError)
                else "failed"
            )
            outcome[0] = (kind, str(exc))
    dist.broadcast_object_list(outcome, src=0, group=group)
    kind, value = outcome[0]
    if error is not None:
        raise error
    if kind == "missing":
        raise NotFound(value)
    if kind == "damaged":
        raise IntegrityError(value)
    if kind == "failed":
        raise StoreError(f"rank 0 could not find the version to load: {value}")
    return int(value)


class Checkpointer:
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

    @property
    def url(self) -> str:
        """Where the versions live."""
        return self._ckpt.url

    def save(
        self, state: Any, step: int, *, metadata: dict[str, Any] | None = None
    ) -> concurrent.futures.Future[SaveResult]:
        """Save ``state`` as the version of ``step``; return once it is snapshotted."""
        return _pending(run_sync(self._ckpt.save(state, step, metadata=metadata)))

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

    # -- torch.distributed.checkpoint ----------------------------------------------------------

    def dcp_writer(self, step: int) -> dcp.StorageWriter:
        """A ``torch.distributed.checkpoint`` storage writer that saves the distributed
        version of ``step``: on every rank, ``dcp.save(state,
        storage_writer=ckpt.dcp_writer(step))`` (or ``dcp.async_save``).

        Each rank writes its shards under ``step-000001000.dcp/`` with this checkpointer's
        compression, staging and priority; the version exists once the coordinator has
        written its ``.metadata``. Then, on the coordinator, it replaces a single-object
        version of the same step, what killed distributed saves of earlier steps left is
        removed, and retention runs in the background as after :meth:`save` (closing the
        checkpointer waits for it).

        Raises:
            InvalidArgument: ``step`` is not an int >= 0, or the checkpointer has a mirror
                (every rank writes straight to the run's store: point the checkpointer at
                the shared store instead).
        """
        from . import dcp

        ckpt = self._ckpt
        step = ckpt._check_step(step)
        if ckpt._mirror is not None:
            raise InvalidArgument(
                f"dcp_writer: the checkpointer at {ckpt.url} has a mirror, which distributed "
                "saves do not use (every rank writes straight to the store): point a "
                "Checkpointer without mirror at the shared store (s3://...) instead"
            )
        run_sync(ckpt._ensure_open())
        config = ckpt.config
        writer = dcp._VersionWriter(
            ckpt._dcp_url(step),
            step=step,
            on_commit=lambda: run_sync(ckpt._dcp_committed(step)),
            store_options=ckpt._store_options,
            compression=config.compression,
            staging_bytes=config.staging_bytes,
            priority=config.priority,
            chunk_bytes=config.chunk_bytes,
        )
        ckpt._dcp_writers.add(writer)
        return writer

    def dcp_group(self) -> Any:
        """The process group this checkpointer's distributed saves and loads run their
        collectives on: a gloo group of every rank of the default group, made on first use
        (collectively: every rank calls the ``dcp_*`` methods in the same order, as DCP
        needs anyway); ``None`` outside an initialized process group.

        A group of its own, because DCP's collectives must not share a group with the
        training's: an ``async_save`` on the default group runs its collectives on a
        background thread while DDP's backward all-reduces on the same group, and on gloo
        the two interleave and deadlock (PyTorch's advice is a separate group for
        checkpoint collectives). Pass it as ``process_group=`` when calling DCP directly.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def dcp_save(self, state: dict[str, Any], step: int, *, planner: Any = None) -> None:
        """Save ``state`` as the distributed version of ``step``, on every rank
        (collectively), returning once it is committed: ``dcp.save`` with
        :meth:`dcp_writer` and :meth:`dcp_group`. ``planner`` goes to ``dcp.save``.

        Raises:
            InvalidArgument: as :meth:`dcp_writer`.
        """
        from torch.distributed.checkpoint import state_dict_saver

        state_dict_saver.save(
            state,
            storage_writer=self.dcp_writer(step),
            planner=planner,
            process_group=self.dcp_group(),
        )

    def dcp_async_save(
        self, state: dict[str, Any], step: int, *, planner: Any = None
    ) -> concurrent.futures.Future[Any]:
        """Save ``state`` as the distributed version of ``step`` in the background, on
        every rank (collectively): ``dcp.async_save`` with :meth:`dcp_writer` and
        :meth:`dcp_group`, so that its collectives never meet the training's (the default
        group's DDP all-reduces). Returns once ``state`` is staged (copied): training may
        change it at once. Wait for the returned future before the next save.

        Raises:
            InvalidArgument: as :meth:`dcp_writer`.
        """
        from torch.distributed.checkpoint import state_dict_saver

        future = state_dict_saver.async_save(
            state,
            storage_writer=self.dcp_writer(step),
            planner=planner,
            process_group=self.dcp_group(),
        )
        assert isinstance(future, concurrent.futures.Future)
        return future

    def dcp_reader(self, step: int | None = None) -> dcp.StorageReader:
        """A ``torch.distributed.checkpoint`` storage reader of the distributed version of
        ``step``, or of the newest one whose ``.metadata`` verifies: on every rank,
        ``dcp.load(state, storage_reader=ckpt.dcp_reader())``. :meth:`dcp_load` does the
        same and falls back to an older version when a rank finds the newest damaged.

        With ``step=None`` under an initialized process group, rank 0 finds the version and
        tells the others (collectively: call it on every rank), so that every rank loads the
        same version even if a save commits meanwhile.

        Raises:
            NotFound: there is no distributed version (of ``step``, or at all).
            IntegrityError: with ``step=None``, no version's ``.metadata`` verifies.
            InvalidArgument: ``step`` is not an int >= 0.
        """
        from . import dcp

        ckpt = self._ckpt
        if step is not None:
            step = ckpt._check_step(step)
        found = self._agreed_dcp(step, {})
        return dcp.StorageReader(ckpt._dcp_url(found), store_options=ckpt._store_options)

    def dcp_load(
        self, state: dict[str, Any], step: int | None = None, *, planner: Any = None
    ) -> int:
        """Load a distributed version into ``state`` in place, on every rank (collectively),
        and return its step: ``step = ckpt.dcp_load(state)``.

        With ``step=None``, the newest version that loads whole. Rank 0 passes over versions
        whose ``.metadata`` does not verify; when any rank finds a chunk damaged or a rank
        object missing during the load (DCP reports every rank's failure to all of them),
        the version is marked damaged, a warning names it and what failed, and every rank
        loads the next older version, which fills every entry of ``state`` again. With
        ``step``, that version only. ``planner`` goes to ``dcp.load``.

        Raises:
            NotFound: there is no distributed version (of ``step``, or at all).
            IntegrityError: the version of ``step`` is damaged, or every version is (each
                named with what failed).
            InvalidArgument: ``step`` is not an int >= 0.
            torch.distributed.checkpoint.api.CheckpointException: any other failure of the
                load (say, a ``state`` whose shapes are not the checkpoint's), as
                ``dcp.load`` raises it.
        """
        from torch.distributed.checkpoint import state_dict_loader
        from torch.distributed.checkpoint.api import CheckpointException

        from . import dcp

        ckpt = self._ckpt
        if step is not None:
            step = ckpt._check_step(step)
        failed: dict[int, str] = {}  # step -> what failed (rank 0's copy decides)
        while True:
            found = self._agreed_dcp(step, failed)
            url = ckpt._dcp_url(found)
            reader = dcp.StorageReader(url, store_options=ckpt._store_options)
            try:
                state_dict_loader.load(
                    state, storage_reader=reader, planner=planner, process_group=self.dcp_group()
                )
            except CheckpointException as exc:
                damage = [
                    (rank, error)
                    for rank, (error, _) in sorted(exc.failures.items())
                    if isinstance(error, IntegrityError | NotFound)
                ]
                if not damage:
                    raise
                rank, error = damage[0]
                why = f"rank {rank}: {error}"
                ckpt._dcp_damaged(found)
                if step is not None:
                    raise IntegrityError(f"step {found} ({url}) does not load: {why}") from None
                failed[found] = why
                logger.warning("%s does not load (%s); loading an older version", url, why)
            else:
                return found

    def _agreed_dcp(self, step: int | None, failed: dict[int, str]) -> int:
        # The version every rank loads: ``step``'s, or the newest that may load (rank 0's
        # choice, collectively under a process group).
        group = self.dcp_group()
        if step is not None:
            return _agreed(lambda: self._dcp_versions(step)[-1].step, group)
        return _agreed(lambda: self._loadable_dcp(failed), group)

    def _dcp_versions(self, step: int | None) -> list[Version]:
        # The distributed versions (of ``step`` only, when given), oldest first.
        versions = [v for v in self.versions() if v.kind == "dcp"]
        if step is not None:
            versions = [v for v in versions if v.step == step]
        if not versions:
            which = "of step {step}" if step is not None else "at all"
            raise NotFound(
                f"{self.url} holds no distributed version {which.format(step=step)} "
                "(step-*.dcp/ with its .metadata): save one with dcp_writer(step)"
            )
        return versions

    def _loadable_dcp(self, failed: dict[int, str]) -> int:
        # The newest distributed version not known to be damaged whose .metadata verifies.
        from . import dcp

        ckpt = self._ckpt
        for version in reversed(self._dcp_versions(None)):
            step = version.step
            if step in failed:
                continue
            url = ckpt._dcp_url(step)
            if version.state == "damaged":
                failed[step] = "found damaged earlier"
                continue
            try:
                dcp.StorageReader(url, store_options=ckpt._store_options).read_metadata()
            except (IntegrityError, NotFound) as exc:  # NotFound: deleted since it was listed
                failed[step] = str(exc)
                if isinstance(exc, IntegrityError):
                    ckpt._dcp_damaged(step)
                    logger.warning("%s is damaged (%s); passing over it", url, exc)
                continue
            return step
        raise IntegrityError(
            f"no distributed version of {self.url} loads: "
            + "; ".join(f"step {s}: {why}" for s, why in sorted(failed.items(), reverse=True))
        )

    def close(self) -> None:
        """Wait for the saves' retention and release the store; closing twice is harmless."""
        if not self._closed:
            self._closed = True
            run_sync(self._ckpt.aclose())

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
