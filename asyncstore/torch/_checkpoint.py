"""``torch.save`` / ``torch.load`` replacements over the checkpoint engine, for sync code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import os
import pickle
import warnings
from typing import TYPE_CHECKING, Any, Unpack

import torch
import torch.utils.serialization

from .._concurrency import ExitStep, at_exit, to_thread
from .._loop import bridge_loop, run_sync
from ..checkpoint import Checkpointer as _AsyncCheckpointer
from ..checkpoint import CheckpointerStats, SaveHandle, SaveResult, VerifyReport, Version
from ..checkpoint import load as _load
from ..checkpoint import read_manifest as _read_manifest
from ..checkpoint import save as _save
from ..checkpoint._load import LoadOptions
from ..checkpoint._save import SaveOptions
from ..checkpoint._target import put_whole as _put_whole
from ..errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreError,
    StoreUnavailable,
)
from ._dcpmethods import DistributedMethods

if TYPE_CHECKING:
    pass

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


async def _save_and_wait(obj: Any, f: Any, options: dict[str, Any]) -> SaveResult:
    handle = await _save(obj, f, **options)
    return await handle.wait()


def _save_options(
    func: str,
    options: dict[str, Any],
    pickle_module: Any,
    pickle_protocol: Any,
    use_new_zipfile: Any,
    disable_byteorder_record: Any,
) -> dict[str, Any]:
    # torch.save's keywords, checked, beside asyncstore's own options.
    _check_options(options, SaveOptions.__optional_keys__, func)
    for name, value in (
        ("_use_new_zipfile_serialization", use_new_zipfile),
        ("_disable_byteorder_record", disable_byteorder_record),
    ):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{func}({name}={value!r}): pass True or False")
    if pickle_module is pickle:
        pickle_module = None
    return {**options, "pickle_module": pickle_module, "pickle_protocol": pickle_protocol}


def save(
    obj: Any,
    f: Any,
    pickle_module: Any = pickle,
    pickle_protocol: int | None = None,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    **options: Unpack[SaveOptions],
) -> SaveResult:
    """Save ``obj`` like ``torch.save``, and return once the checkpoint is committed.

    ``f`` is what ``torch.save`` accepts (a path, a PathLike, a writable binary file object)
    or a URL (``"s3://bucket/run/step-100.ckpt"``, ``"file:///…"``). A path or URL is
    written atomically: it holds the old checkpoint (or nothing) until the new one is
    complete. Options (``compression``, ``level``, ``chunk_bytes``, ``staging_bytes``,
    ``exclude``, ``metadata``, ``store_options``, ``priority``) as for
    :func:`asyncstore.save`.

    Every keyword of ``torch.save`` is accepted: ``pickle_module`` (``dill``, say) pickles
    the structure, ``pickle_protocol`` is its protocol (default 4, where torch's is 2).
    ``_use_new_zipfile_serialization`` and ``_disable_byteorder_record`` choose between
    torch's own containers and byte-order records: asyncstore writes its own format either
    way, whose byte order is always little-endian and recorded by the format itself (see
    docs/checkpoints.md, "Drop-in for torch.save and torch.load").
    """
    kwargs = _save_options(
        "save",
        dict(options),
        pickle_module,
        pickle_protocol,
        _use_new_zipfile_serialization,
        _disable_byteorder_record,
    )
    return run_sync(_save_and_wait(obj, f, kwargs))


def save_async(
    obj: Any,
    f: Any,
    pickle_module: Any = pickle,
    pickle_protocol: int | None = None,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    **options: Unpack[SaveOptions],
) -> concurrent.futures.Future[SaveResult]:
    """Start saving ``obj`` and return once its tensors are snapshotted.

    The training loop may change its tensors as soon as this returns. Compression and
    writing go on in asyncstore's background thread; the returned future gives the
    :class:`~asyncstore.SaveResult` (``future.result()`` waits for the commit) or raises
    the save's error. Errors in the arguments raise here, at once. Options and
    ``torch.save``'s keywords as for :func:`save`.
    """
    kwargs = _save_options(
        "save_async",
        dict(options),
        pickle_module,
        pickle_protocol,
        _use_new_zipfile_serialization,
        _disable_byteorder_record,
    )
    try:
        handle = run_sync(_save(obj, f, **kwargs))
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


_TRUE = ("1", "y", "yes", "true")


def _weights_only(weights_only: Any, pickle_module: Any) -> bool:
    """``weights_only`` as ``torch.load`` settles it: ``None`` is ``True`` (``False`` with a
    ``pickle_module``); ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces ``True``, and
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` ``False`` where the caller did not choose."""
    if weights_only is not None and not isinstance(weights_only, bool):
        raise InvalidArgument(f"weights_only={weights_only!r}: pass True, False or None")
    force = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    force_not = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    if force and force_not:
        raise InvalidArgument(
            "TORCH_FORCE_WEIGHTS_ONLY_LOAD and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD are both set: "
            "unset one of them"
        )
    if force:
        return True
    if weights_only is None:
        if force_not:
            warnings.warn(
                "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set and weights_only was not passed: "
                "loading with weights_only=False",
                UserWarning,
                stacklevel=3,
            )
            return False
        return pickle_module is None
    return weights_only


def load(
    f: Any,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    **options: Any,
) -> Any:
    """Load a checkpoint like ``torch.load``, verifying every chunk.

    Reads checkpoints written by :func:`save` and plain ``torch.save`` files alike, so code
    can switch without converting anything. Options (``weights_only``, ``keys``, ``into``,
    ``safe_globals``, ``store_options``) as for :func:`asyncstore.load`.

    Every keyword of ``torch.load`` is accepted. ``weights_only=None`` (the default) means
    what it means to ``torch.load``: ``True``, or ``False`` with a ``pickle_module``, and
    the ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` / ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    variables apply. ``pickle_module`` unpickles the structure (``weights_only=False``
    only). ``mmap=True`` builds tensors stored raw over a memory map of a local file
    instead of reading them into memory (``None`` is torch's configured default). The
    unpickler's keywords (``encoding``, ``errors``, ``fix_imports``) are passed to it. A
    plain ``torch.save`` file gets all of them through ``torch.load`` itself.
    """
    ours = {k: v for k, v in options.items() if k in LoadOptions.__optional_keys__}
    unpickler_args = {k: v for k, v in options.items() if k not in ours}
    if mmap is None:
        mmap = bool(torch.utils.serialization.config.load.mmap)
    chosen = _weights_only(weights_only, pickle_module)
    return run_sync(
        _load(
            f,
            map_location=map_location,
            weights_only=chosen,
            pickle_module=pickle_module,
            mmap=mmap,
            pickle_load_args=unpickler_args,
            # torch keeps this per thread; the load runs on asyncstore's.
            mmap_flags=torch.serialization.get_default_mmap_options(),
            **ours,
        )
    )


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
    return await _put_whole(dst, store_options, buffer.getbuffer())


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
