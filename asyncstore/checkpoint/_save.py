"""``save``: check the arguments, take the target, and run a :class:`SaveJob` on it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal, TypedDict

from .._concurrency import abandon, shield
from .._config import DEFAULT_SAVE_CHUNK_BYTES, DEFAULT_STAGING_BYTES, SaveConfig, build
from ..errors import InvalidArgument
from ..stores import Store
from ._codec import Codecs, Known
from ._contexts import current
from ._handle import SaveHandle
from ._packfile import PackId
from ._pickle import PROTOCOL, check_protocol, pickle_structure
from ._pipeline import PackTarget, SaveJob
from ._staging import staging_pool
from ._tail import Tail
from ._target import Resolved, Sink, open_sink, resolve
from ._torchformat import DEFAULT_PROTOCOL as TORCH_PROTOCOL
from ._torchformat import save_torch_format

__all__ = ["save", "save_packed", "start_save", "build_save_config", "SaveOptions"]


class SaveOptions(TypedDict, total=False):
    """The keyword options of :func:`save`, for the static types of the sync adapters that
    forward them: :class:`SaveConfig`'s fields and ``store_options`` (a test keeps the two
    in step)."""

    compression: Literal["auto", "zstd"] | None
    level: int
    chunk_bytes: int
    staging_bytes: int
    exclude: Iterable[str]
    metadata: dict[str, Any] | None
    store_options: dict[str, Any] | None
    priority: Literal["low", "normal"]
    format: Literal["asyncstore", "torch"]


# One save per target at a time, per event loop (a lock is bound to its loop).
_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]]
_LOCKS = weakref.WeakKeyDictionary()


def build_save_config(where: str, given: object, options: Mapping[str, Any]) -> SaveConfig:
    """The one :class:`SaveConfig` of the save entry point ``where`` (``"save()"``,
    ``"Checkpointer"``, …), validated once and then handed down unchanged: ``given`` (a
    ``SaveConfig`` passed as ``save_config=``) or one built from the entry point's keyword
    options, taken from ``options`` by their names (its ``locals()``: the names are written
    once, here and in :class:`SaveConfig`, not at every entry point); a field it lacks
    keeps its default.

    Raises:
        InvalidArgument: a bad option (named, with the entry point), ``given`` is not a
            ``SaveConfig``, or both ``given`` and keyword options other than the defaults.
    """
    values = {name: options[name] for name in SaveConfig.__struct_fields__ if name in options}
    exclude = values.get("exclude", ())
    # A single pattern is a str; any iterable of them is fine, but only a list converts.
    if isinstance(exclude, str):
        values["exclude"] = [exclude]
    elif isinstance(exclude, Iterable) and not isinstance(exclude, bytes | dict):
        values["exclude"] = list(exclude)
    if values.get("metadata", {}) is None:
        values["metadata"] = {}
    config = build(SaveConfig, values, where)
    if given is None:
        return config
    if not isinstance(given, SaveConfig):
        raise InvalidArgument(
            f"{where}: save_config={given!r}: pass a SaveConfig (or the options as keywords)"
        )
    if config != SaveConfig():
        changed = [
            name
            for name in SaveConfig.__struct_fields__
            if getattr(config, name) != getattr(SaveConfig(), name)
        ]
        raise InvalidArgument(
            f"{where}: save_config was given with {', '.join(changed)} as keywords: pass the "
            "save options one way, all in the SaveConfig or all as keywords"
        )
    return given


async def save(
    obj: Any,
    target: Any,
    *,
    compression: Literal["auto", "zstd"] | None = "auto",
    level: int = 1,
    chunk_bytes: int = DEFAULT_SAVE_CHUNK_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    exclude: Iterable[str] = (),
    metadata: dict[str, Any] | None = None,
    store_options: dict[str, Any] | None = None,
    priority: Literal["low", "normal"] = "low",
    pickle_module: Any = None,
    pickle_protocol: int | None = None,
    format: Literal["asyncstore", "torch"] = "asyncstore",
) -> SaveHandle:
    """Save ``obj`` (a state dict, or any picklable object holding tensors) as a checkpoint.

    Returns once the tensors' bytes are snapshotted: the caller may then change them.
    Compression, checksums and writing go on in the background; ``await`` the returned
    :class:`SaveHandle` for the :class:`SaveResult`. Until it commits, the target holds its
    previous content (or nothing); a failure or cancellation leaves it so. Cancelling this
    call abandons the save (the returned handle's :meth:`~SaveHandle.cancel` does the same
    later) and returns once its memory and temp files are released.

    Args:
        obj: what to save; tensors anywhere inside it are saved as ``torch.save`` would.
        target: a URL (``"s3://bucket/run/step-100.ckpt"``, ``"file:///…"``), a local path,
            a ``(store, key)`` pair, or a writable binary file object (not atomic).
        compression: ``"auto"`` probes each storage's first chunk and compresses only where
            it shrinks and keeps up with the target's measured write speed; ``"zstd"``
            always; ``None`` never. Elements of 2 and 4 bytes are byte-shuffled first.
        level: zstd level (1 is fast; higher is smaller and slower).
        chunk_bytes: chunk size: the unit of compression, checksums and ranged reads.
        staging_bytes: the staging pool's budget. A state larger than it streams through
            with back-pressure: the call then returns only when the rest fits.
        exclude: name patterns (``fnmatch``) of entries stored raw whatever ``compression``.
        metadata: a dict kept in the manifest (step, time, anything msgpack can hold).
        store_options: options for ``open_store`` when ``target`` is a URL or path.
        priority: ``"low"`` (the default) checksums and compresses on threads of the lowest
            priority (nice 19), so a training step's threads get the cores whenever they
            want them and the save goes on in what they leave; ``"normal"`` when the save
            should finish as soon as possible. The snapshot (what the caller waits for)
            always runs at normal priority.
        pickle_module: the module whose ``Pickler`` pickles the structure (``dill``, for
            objects ``pickle`` cannot save), as for ``torch.save``; default ``pickle``. Load
            such a checkpoint with the same ``pickle_module`` and ``weights_only=False``.
        pickle_protocol: the pickle protocol of the structure, 2 to
            ``pickle.HIGHEST_PROTOCOL``; default 4 (with ``format="torch"``, torch's: 2).
        format: ``"asyncstore"`` (the default): asyncstore's format, with verified loads,
            compression, ranged reads and differential saves; ``asyncstore.load`` reads it,
            ``torch.load`` does not (``asyncstore export`` converts). ``"torch"``: the file
            ``torch.save`` writes, byte for byte, for code that reads it with
            ``torch.load``; written through the same stores, atomically, and with the same
            snapshot (see docs/checkpoints.md, "torch's format"). ``compression``,
            ``level``, ``chunk_bytes``, ``exclude`` and ``metadata`` mean nothing there
            and are refused unless left as they are (``compression=None`` is accepted);
            ``staging_bytes`` bounds the host memory the snapshot copies into.

    Only one save per target runs at a time in an event loop; a second waits for the first
    to commit before its snapshot.

    Raises:
        InvalidArgument: a bad argument (named in the message).
        UnsafeCheckpoint: ``obj`` cannot be pickled.
    """
    started = time.perf_counter()
    if format not in ("asyncstore", "torch"):
        raise InvalidArgument(
            f"format={format!r}: pass 'asyncstore' (the default: verified loads, compression, "
            "ranged and differential saves) or 'torch' (the file torch.save writes, for "
            "torch.load)"
        )
    config = build_save_config("save()", None, locals())
    if format == "torch":
        _refuse_for_torch(config, compression)
        protocol = TORCH_PROTOCOL if pickle_protocol is None else check_protocol(pickle_protocol)
        contexts = current()  # torch keeps them per thread: read on the caller's
        resolved = resolve(target, store_options, writing=True)
        release_target = await _lock(resolved)
        return await save_torch_format(
            obj,
            resolved,
            release_target,
            started,
            pickle_module=pickle_module,
            pickle_protocol=protocol,
            staging_bytes=config.staging_bytes,
            background=config.priority == "low",
            contexts=contexts,
        )
    pickling = (pickle_module, check_protocol(pickle_protocol))
    return await start_save(obj, target, config, store_options, started, pickling)


async def start_save(
    obj: Any,
    target: Any,
    config: SaveConfig,
    store_options: dict[str, Any] | None = None,
    started: float | None = None,
    pickling: tuple[Any, int] = (None, PROTOCOL),
    tail: Tail | None = None,
) -> SaveHandle:
    """:func:`save` in asyncstore's format with the options of ``config``, validated by
    the caller (:func:`build_save_config`) and used as they are; ``started`` is when the
    caller's save began (now, by default). ``tail`` follows the file as it is written (for
    a mirror's upload), when it is a local file."""
    resolved = resolve(target, store_options, writing=True)
    when = time.perf_counter() if started is None else started
    return await _start(obj, resolved, config, when, None, pickling, tail)


# The options of asyncstore's format that torch's has no place for (besides compression).
_NOT_FOR_TORCH = ("level", "chunk_bytes", "exclude", "metadata")


def _refuse_for_torch(config: SaveConfig, compression: object) -> None:
    # Never a silent no-op: an option that cannot apply to torch's format is refused.
    default = SaveConfig()
    given = [
        f"{name}={getattr(config, name)!r}"
        for name in _NOT_FOR_TORCH
        if getattr(config, name) != getattr(default, name)
    ]
    if compression == "zstd":
        given.insert(0, "compression='zstd'")
    if given:
        raise InvalidArgument(
            f"format='torch' with {', '.join(given)}: torch's format stores every tensor "
            "raw and has no chunks, exclusions or metadata; leave these out, or save in "
            "asyncstore's format (format='asyncstore', the default)"
        )


async def save_packed(
    obj: Any,
    store: Store,
    key: str,
    pack: str,
    known: Known,
    ids: dict[str, PackId],
    config: SaveConfig,
    tail: Tail | None = None,
) -> SaveHandle:
    """:func:`save` to ``key`` in ``store`` as a differential checkpoint (format version 2)
    with the options of ``config``: chunks ``known`` from earlier versions' packs are
    stored as references to them, the others go to the new pack ``pack`` (a key relative
    to ``key``'s directory), which commits before the checkpoint that points into it.
    ``ids`` holds the identity of every pack ``known`` points into (checked by the caller),
    recorded in the manifest. ``tail`` follows the pack's file as it is written (for a
    mirror's upload), when it is a local file."""
    started = time.perf_counter()
    resolved = resolve((store, key), None, writing=True)
    return await _start(obj, resolved, config, started, (pack, known, ids), tail=tail)


async def _start(
    obj: Any,
    resolved: Resolved,
    config: SaveConfig,
    started: float,
    packed: tuple[str, Known, dict[str, PackId]] | None,
    pickling: tuple[Any, int] = (None, PROTOCOL),
    tail: Tail | None = None,
) -> SaveHandle:
    # ``tail`` follows the file that takes the data: the pack when there is one.
    # torch's contexts (skip_data()) are per thread: read on the caller's before waiting
    # for the target, after which this task may resume anywhere.
    contexts = current()
    release_target = await _lock(resolved)
    sink: Sink | None = None
    pack: PackTarget | None = None
    try:
        structure, storages, entries = pickle_structure(obj, *pickling, contexts=contexts)
        pool = staging_pool(config.chunk_bytes)
        pool.set_budget(config.staging_bytes)
        where = resolved.url.rpartition("/")[0]
        remote = resolved.store is not None and resolved.store.remote
        codecs = Codecs(config.compression, config.level, config.exclude, where, remote)
        sink = await open_sink(resolved)
        if tail is not None and packed is None:
            sink = tail.attach(sink)
        if packed is not None:
            name, known, ids = packed
            pack_sink = await open_sink(resolved.sibling(name))
            if tail is not None:
                pack_sink = tail.attach(pack_sink)
            pack = PackTarget(pack_sink, name, known, ids)
        job = SaveJob(
            sink,
            structure,
            storages,
            entries,
            config.metadata,
            pool,
            codecs,
            background=config.priority == "low",
            release_target=release_target,
            pack=pack,
        )
    except BaseException as exc:
        # Before the job exists, nothing but the sinks and the target is held.
        if pack is not None:
            await shield(_abort(pack.sink, exc))
        if sink is not None:
            await shield(_abort(sink, exc))
        await shield(release_target())
        raise
    # From here the job releases everything, however the save ends.
    writer = job.start(started)
    try:
        await job.snapshot()
    except asyncio.CancelledError:
        # A cancellation can arrive after the snapshot is taken, while it lets go of its part
        # of the job. The caller gets no handle then, so nobody could wait for the writer or
        # stop it: abandon the save, and return only once it has released what it holds.
        await abandon(writer)
        raise
    return SaveHandle(writer, resolved.url)


async def _lock(resolved: Resolved) -> Callable[[], Awaitable[None]]:
    """Wait until no other save of this event loop writes ``resolved``, then hold it; the
    function returned lets go of it and closes its store."""
    locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
    lock = locks.setdefault(resolved.url, asyncio.Lock())
    try:
        await lock.acquire()
    except BaseException:
        await shield(resolved.aclose())
        raise
    return functools.partial(_release, resolved, lock)


async def _release(resolved: Resolved, lock: asyncio.Lock) -> None:
    try:
        await resolved.aclose()
    finally:
        lock.release()


async def _abort(sink: Sink, exc: BaseException) -> None:
    with contextlib.suppress(Exception):  # the original error is the one to report
        await sink.abort(exc)
