"""``save`` / ``save_async`` / ``export``: ``torch.save`` replacements over the checkpoint
engine, for sync code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import os
import pickle
from typing import Any, Unpack

import torch

from .._concurrency import ExitStep, at_exit, to_thread
from .._loop import bridge_loop, run_sync
from ..checkpoint import SaveHandle, SaveResult
from ..checkpoint import load as _load
from ..checkpoint import read_manifest as _read_manifest
from ..checkpoint import save as _save
from ..checkpoint.engine import SaveOptions, capture, carrying
from ..checkpoint.engine import put_whole as _put_whole
from ..errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreError,
    StoreUnavailable,
)

__all__ = ["save", "save_async", "export", "check_options", "pending"]

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


def check_options(options: dict[str, Any], allowed: frozenset[str], func: str) -> None:
    """Raise :class:`InvalidArgument` naming the options of ``func`` not in ``allowed`` (the
    async functions would raise a bare ``TypeError`` for a misspelt one)."""
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
    check_options(options, SaveOptions.__optional_keys__, func)
    for name, value in (
        ("_use_new_zipfile_serialization", use_new_zipfile),
        ("_disable_byteorder_record", disable_byteorder_record),
    ):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{func}({name}={value!r}): pass True or False")
    if options.get("format") == "torch" and (not use_new_zipfile or disable_byteorder_record):
        # They would change the file torch's format writes: never dropped in silence.
        name = (
            "_use_new_zipfile_serialization=False"
            if not use_new_zipfile
            else ("_disable_byteorder_record=True")
        )
        raise InvalidArgument(
            f"{func}({name}, format='torch'): format='torch' writes torch's zip format with "
            "its byte-order record; torch's legacy format and a file without the record are "
            "not supported. Leave the keyword out, or call torch.save for such a file"
        )
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
    ``exclude``, ``metadata``, ``store_options``, ``priority``, ``format``) as for
    :func:`asyncstore.save`.

    Every keyword of ``torch.save`` is accepted: ``pickle_module`` (``dill``, say) pickles
    the structure, ``pickle_protocol`` is its protocol (default 4, where torch's is 2).
    ``_use_new_zipfile_serialization`` and ``_disable_byteorder_record`` choose between
    torch's own containers and byte-order records: asyncstore writes its own format either
    way, whose byte order is always little-endian and recorded by the format itself (see
    docs/checkpoints.md, "Drop-in for torch.save and torch.load"); with ``format="torch"``
    only their defaults are accepted.

    ``format="torch"`` writes the file ``torch.save`` writes (byte for byte), for code that
    reads it with ``torch.load``, through the same stores, atomically (see
    docs/checkpoints.md, "torch's format"); the default, ``"asyncstore"``, is asyncstore's
    own format, with verified loads and compression.

    Under the calling thread's ``torch.serialization.skip_data()``, every storage is saved
    with its size and sharing but its chunks hold zeros (its bytes are never read;
    ``materialize_fake_tensors=True`` saves FakeTensors so), as torch leaves them out.
    Tensors on the meta device are saved as torch saves them, and load back on meta.
    """
    kwargs = _save_options(
        "save",
        dict(options),
        pickle_module,
        pickle_protocol,
        _use_new_zipfile_serialization,
        _disable_byteorder_record,
    )
    # torch's contexts (skip_data()) are per thread: read here, used where it pickles.
    return run_sync(carrying(capture(), _save_and_wait(obj, f, kwargs)))


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
        handle = run_sync(carrying(capture(), _save(obj, f, **kwargs)))
    except (NotFound, PermissionDenied, StoreError, StoreUnavailable) as exc:
        # The store's errors (a server down, a missing bucket) are the save's outcome,
        # given by the future like those that come after the snapshot.
        failed: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        failed.set_exception(exc)
        return failed
    return pending(handle)


def pending(handle: SaveHandle) -> concurrent.futures.Future[SaveResult]:
    """A future for ``handle``'s commit, waited for at interpreter exit if still running."""
    future = asyncio.run_coroutine_threadsafe(handle.wait(), bridge_loop())
    _PENDING.add(future)
    future.add_done_callback(_PENDING.discard)
    return future


def export(
    src: Any,
    dst: Any,
    *,
    store_options: dict[str, Any] | None = None,
    dst_store_options: dict[str, Any] | None = None,
) -> str:
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
        dst_store_options: options for ``dst``'s store when they differ from ``src``'s (an
            S3 checkpoint exported to another endpoint); ``store_options`` by default.

    Raises:
        NotFound: there is nothing at ``src``.
        IntegrityError: ``src`` is not an asyncstore checkpoint, or it is damaged.
        UnsafeCheckpoint: it holds objects ``weights_only=True`` refuses.
        InvalidArgument: ``dst`` is a file object, or another bad argument.
    """
    return run_sync(_export(src, dst, store_options, dst_store_options))


async def _export(
    src: Any,
    dst: Any,
    store_options: dict[str, Any] | None,
    dst_store_options: dict[str, Any] | None,
) -> str:
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
    written = store_options if dst_store_options is None else dst_store_options
    return await _put_whole(dst, written, buffer.getbuffer())
