"""Loading a checkpoint: which chunks to read, and the object built from them.

The manifest says which storages each entry uses, so ``keys=`` and ``into=`` read only
theirs (through :class:`ChunkReader`); the pickled structure is then unpickled with a
``persistent_load`` that hands each storage id its storage. A file that is not an
asyncstore checkpoint is passed to ``torch.load``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, TypedDict

import torch

from .._concurrency import shield, to_thread
from .._config import LoadConfig, build
from ..errors import IntegrityError, InvalidArgument, UnsafeCheckpoint, Unsupported
from . import _format as fmt
from ._contexts import current, entered
from ._into import check_read, fill, placeholders, plan_into, select
from ._pickle import dtype_of
from ._reader import ChunkReader, check_memory, fixed_storage, manifest_of
from ._target import Source, open_source, resolve
from ._torchfile import TorchOptions, load_torch_file
from ._unpickle import PlainUnpickler, RestrictedUnpickler, allow_list, custom_unpickler

__all__ = ["load", "read_manifest", "verify", "LoadOptions"]

# verify() reads storages in batches of about this many bytes: its memory, whatever the
# checkpoint's size (a storage larger than it is read alone).
_VERIFY_BATCH = 256 * 1024 * 1024


class LoadOptions(TypedDict, total=False):
    """The keyword options of :func:`load` (for the sync adapter that forwards them)."""

    weights_only: bool
    keys: Iterable[str] | None
    into: dict[str, Any] | None
    safe_globals: Iterable[Any]
    store_options: dict[str, Any] | None


async def read_manifest(
    source: Any, *, store_options: dict[str, Any] | None = None
) -> fmt.Manifest:
    """A checkpoint's manifest, verified: its metadata, storages, chunks and digest.

    ``source`` as for :func:`load`. Reads only the footer and the manifest.

    Raises:
        IntegrityError: it is not an asyncstore checkpoint, or it is damaged.
        NotFound: there is nothing at ``source``.
    """
    resolved = resolve(source, store_options, writing=False)
    try:
        src = open_source(resolved)
        try:
            manifest = await manifest_of(src)
        finally:
            await src.aclose()
        if manifest is None:
            raise IntegrityError(f"{src.url} is not an asyncstore checkpoint")
        return manifest
    finally:
        await resolved.aclose()


async def verify(source: Any, *, store_options: dict[str, Any] | None = None) -> fmt.Manifest:
    """Check every checksum of the checkpoint at ``source`` (the footer, the manifest, the
    structure and every chunk, in its packs too) without building any tensor; return its
    manifest.

    Reads about 256 MiB at a time (a larger storage alone), so it checks a checkpoint
    larger than this machine's memory. ``source`` as for :func:`load`.

    Raises:
        IntegrityError: it is damaged (the message names the chunk, the tensor and where),
            or it is not an asyncstore checkpoint.
        NotFound: there is nothing at ``source``.
    """
    async with _reading(source, store_options) as (src, reader):
        if reader is None:
            raise IntegrityError(f"{src.url} is not an asyncstore checkpoint")
        manifest = reader.manifest
        await reader.structure()
        batch: list[fmt.Storage] = []
        size = 0
        for entry in manifest.storages:
            if entry.location == "meta":
                continue  # a size and no bytes: nothing to check
            if batch and size + entry.nbytes > _VERIFY_BATCH:
                await reader.storages(batch)  # read, checked, and dropped
                batch, size = [], 0
            batch.append(entry)
            size += entry.nbytes
        if batch:
            await reader.storages(batch)
        return manifest


@contextlib.asynccontextmanager
async def _reading(
    source: Any, store_options: dict[str, Any] | None
) -> AsyncIterator[tuple[Source, ChunkReader | None]]:
    """The source, and a reader of its chunks (its packs opened), or ``None`` when it is
    not an asyncstore checkpoint; everything closed on the way out, after every thread
    reading through it is done."""
    resolved = resolve(source, store_options, writing=False)
    src = open_source(resolved)
    reader: ChunkReader | None = None
    try:
        manifest = await manifest_of(src)
        if manifest is not None:
            reader = ChunkReader(src, manifest)
            await reader.open_packs()
        yield src, reader
    finally:
        if reader is not None:
            await shield(reader.aclose())
        await shield(src.aclose())
        await resolved.aclose()


def _check_map_location(map_location: Any) -> None:
    # The caller's argument: a device that does not parse is theirs to fix (InvalidArgument),
    # whereas a bad device name read from the checkpoint is the checkpoint's (IntegrityError).
    if map_location is None or (callable(map_location) and not isinstance(map_location, type)):
        return  # a callable is torch.load's: passed on for a torch.save file, refused for ours
    if isinstance(map_location, Mapping):
        targets = list(map_location.items())
    elif isinstance(map_location, str | torch.device):
        targets = [(None, map_location)]
    else:
        raise InvalidArgument(
            f"map_location={map_location!r}: pass a device ('cpu', 'cuda:0'), a torch.device "
            "or a dict from saved to target locations"
        )
    for saved, target in targets:
        where = "map_location" if saved is None else f"map_location[{saved!r}]"
        if (saved is not None and not isinstance(saved, str)) or not isinstance(
            target, str | torch.device
        ):
            raise InvalidArgument(
                f"{where}={target!r}: map saved locations (str) to devices, such as "
                "{'cuda:0': 'cpu'}"
            )
        try:
            torch.device(target)
        except RuntimeError:
            raise InvalidArgument(
                f"{where}={target!r} is not a device: pass one such as 'cpu', 'cuda:0' or "
                "torch.device('cuda', 1)"
            ) from None


def _device_for(location: str, map_location: Any) -> torch.device:
    if map_location is None:
        target = location
    elif isinstance(map_location, Mapping):
        target = str(map_location.get(location, location))
    else:
        target = str(map_location)
    try:
        device = torch.device(target)
    except RuntimeError:
        raise IntegrityError(
            f"the checkpoint names a device {target!r} that does not exist"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Unsupported(
            f"the checkpoint holds tensors saved on {location!r} but CUDA is not available "
            "here: pass map_location='cpu'"
        )
    return device


def _to(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    if storage.device == device:
        return storage
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    try:
        return flat.to(device).untyped_storage()
    except (RuntimeError, AssertionError) as exc:  # torch raises both for a missing backend
        raise Unsupported(
            f"tensors cannot be placed on {str(device)!r} here ({exc}): pass a "
            "map_location this machine has, such as 'cpu'"
        ) from None


async def load(
    source: Any,
    *,
    map_location: Any = None,
    weights_only: bool = True,
    keys: Iterable[str] | None = None,
    into: dict[str, Any] | None = None,
    safe_globals: Iterable[Any] = (),
    store_options: dict[str, Any] | None = None,
    pickle_module: Any = None,
    mmap: bool = False,
    pickle_load_args: Mapping[str, Any] | None = None,
    mmap_flags: int | None = None,
) -> Any:
    """Load a checkpoint written by :func:`asyncstore.save` (or a ``torch.save`` file).

    Every chunk is verified against its checksum before use.

    Args:
        source: a URL, a local path, a ``(store, key)`` pair or a readable, seekable binary
            file object.
        map_location: where tensors go: a device (``"cpu"``, ``"cuda:1"``), or a dict from
            saved locations to devices; default: where they were saved from.
        weights_only: only tensors, containers and plain values are unpickled (the default;
            a crafted checkpoint cannot run code). ``False`` unpickles anything: only for
            checkpoints you trust.
        keys: for a saved dict, load only these entries; only their chunks are read.
        into: a dict of existing tensors (a model's ``state_dict()``, or a dict of them
            such as ``{"model": model.state_dict(), "step": 0}``) to fill in place, one
            storage at a time: no second copy of the model is made. Dicts, lists and tuples
            inside it are filled at any depth; other values are replaced by the saved ones.
            Returns ``into``.
        safe_globals: extra classes or functions ``weights_only=True`` may unpickle.
        store_options: options for ``open_store`` when ``source`` is a URL or path.
        pickle_module: as for ``torch.load``: the module whose ``Unpickler`` unpickles the
            structure (with ``weights_only=False`` only; its errors are raised as they are).
        mmap: as for ``torch.load``: tensors stored raw (not compressed) in a local file
            are built over a private memory map of it, not read into memory; their bytes
            are still checksummed once (through the map). Compressed storages are decoded
            into memory, as without it.
        pickle_load_args: the unpickler's keywords (``encoding``, ``errors``,
            ``fix_imports``), as ``torch.load`` takes them.
        mmap_flags: ``mmap.MAP_PRIVATE`` (changes to the tensors stay in memory) or
            ``mmap.MAP_SHARED`` (they reach the file: the file is the tensors' writable
            home, so the storages mapped so are not verified; a later load without
            ``MAP_SHARED`` of a file changed through such a map fails its checksums); by
            default what ``torch.serialization.set_default_mmap_options`` set for the
            calling thread.

    torch's contexts of the calling thread are honoured, as ``torch.load`` honours them:
    under ``torch.serialization.skip_data()`` storages are allocated (zeros) and no tensor
    byte is read or verified; under ``FakeTensorMode`` tensors are fake (a meta storage
    each, on the saved device after ``map_location``) and no tensor byte is read or
    allocated. Neither combines with ``into=``. A tensor saved on the meta device loads on
    it.

    Raises:
        IntegrityError: a byte of the checkpoint changed; the message names the tensor,
            the chunk and the URL.
        UnsafeCheckpoint: ``weights_only=True`` met a global outside the allow-list.
        NotFound: there is no checkpoint at ``source``.
        InvalidArgument: a bad argument, ``keys``/``into`` naming entries the checkpoint
            does not have, or ``into`` under ``skip_data()`` or ``FakeTensorMode``.
    """
    # torch's contexts of the caller (skip_data(), FakeTensorMode), read before any hop to
    # another thread.
    contexts = current()
    if isinstance(keys, str):
        raise InvalidArgument(
            f"keys={keys!r}: pass a list of entry names such as ['model'], not one str"
        )
    config = build(
        LoadConfig,
        {
            "weights_only": weights_only,
            "keys": list(keys) if isinstance(keys, Iterable) else keys,
        },
        "load()",
    )
    weights_only = config.weights_only
    _check_map_location(map_location)
    if keys is not None and into is not None:
        raise InvalidArgument("pass keys= or into=, not both (into= loads the keys it has)")
    wanted = None if config.keys is None else list(config.keys)
    options = TorchOptions(pickle_module, mmap, pickle_load_args, mmap_flags, contexts)
    if into is not None and not contexts.reads_data:
        raise InvalidArgument(
            f"into= fills tensors with the checkpoint's bytes, which are not read under "
            f"{contexts.describe()}: load without into=, or outside that context"
        )
    if weights_only and pickle_module is not None:
        raise Unsupported(
            f"pickle_module={pickle_module!r} cannot be used with weights_only=True (its "
            "Unpickler would run instead of the checked one): pass weights_only=False for a "
            "checkpoint you trust"
        )
    safe_globals = allow_list(safe_globals)
    if into is not None:
        if not isinstance(into, dict):
            raise InvalidArgument(
                f"into= takes a dict such as model.state_dict(), not {type(into).__name__}"
            )
        wanted = list(into)
    async with _reading(source, store_options) as (src, reader):
        if reader is None:
            size = await src.size()
            head = await src.read(0, min(size, len(fmt.MAGIC)))
            if head == fmt.MAGIC:
                raise IntegrityError(
                    f"{src.url} is an asyncstore checkpoint whose footer is damaged or missing "
                    "(cut short?); load an earlier one"
                )
            if not head.startswith((b"PK\x03\x04", b"\x80")):
                raise IntegrityError(
                    f"{src.url} is neither an asyncstore checkpoint nor a torch.save file"
                )
            obj = await load_torch_file(src, map_location, weights_only, safe_globals, options)
            return select(obj, wanted, into, src.url)
        return await _load(reader, map_location, weights_only, wanted, into, safe_globals, options)


async def _load(
    reader: ChunkReader,
    map_location: Any,
    weights_only: bool,
    wanted: list[str] | None,
    into: dict[str, Any] | None,
    safe_globals: Iterable[Any],
    options: TorchOptions,
) -> Any:
    src, manifest = reader.source, reader.manifest
    if callable(map_location):
        raise InvalidArgument(
            f"map_location={map_location!r}: an asyncstore checkpoint takes a device ('cpu', "
            "'cuda:0'), a torch.device or a dict from saved to target locations, not a callable"
        )
    by_id = {entry.id: entry for entry in manifest.storages}
    needed = set(by_id)
    if wanted is not None:
        if manifest.entries is None:
            raise InvalidArgument(
                f"{src.url} does not hold a dict with str keys: keys= and into= need one"
            )
        missing = [k for k in wanted if k not in manifest.entries]
        if missing:
            some = ", ".join(repr(k) for k in list(manifest.entries)[:8])
            raise InvalidArgument(
                f"{src.url} has no entries {missing!r} (it has {some}"
                f"{', …' if len(manifest.entries) > 8 else ''})"
            )
        needed = {sid for k in wanted for sid in manifest.entries[k]}
    structure = await reader.structure()
    if into is not None:
        # Tensors of into= are filled in place, one storage at a time, later. An entry whose
        # value in into= is a plain value (a step count, None) is replaced whole: its
        # storages are read with the structure, as keys= does.
        assert manifest.entries is not None
        needed = {
            sid
            for key, value in into.items()
            if not isinstance(value, torch.Tensor | dict | list | tuple)
            for sid in manifest.entries[key]
        }
    storages = await _read(reader, by_id, needed, map_location, options)
    meta: dict[int, int] = {}  # meta storage's C pointer -> storage id (for into=)

    persistent_load = storage_loader(src.url, by_id, storages, meta)

    def in_contexts(load: Callable[[], Any]) -> Callable[[], Any]:
        # torch's rebuild functions read the caller's contexts (FakeTensorMode makes fake
        # tensors) and map_location (wrapper subclasses) on the thread that unpickles.
        def run() -> Any:
            with entered(options.contexts, map_location):
                return load()

        return run

    async def unpickle() -> Any:
        meta.clear()
        stream = io.BytesIO(structure)
        args = options.pickle_load_args
        if weights_only:
            unpickler: Any = RestrictedUnpickler(
                stream, persistent_load, src.url, safe_globals, **args
            )
        elif options.pickle_module is not None:
            # The caller's module (dill, say): its errors are its own, raised as they are.
            unpickler = custom_unpickler(options.pickle_module, stream, persistent_load, args)
            return await to_thread(in_contexts(unpickler.load))
        else:
            unpickler = PlainUnpickler(stream, persistent_load, **args)
        try:
            # In a thread: the checked unpickler is pure Python, and a structure of 100,000
            # tensors would hold the event loop for seconds (torch.save files load there too).
            return await to_thread(in_contexts(unpickler.load))
        except (IntegrityError, InvalidArgument, UnsafeCheckpoint):
            raise
        except Exception as exc:
            raise IntegrityError(
                f"{src.url}: the pickled structure cannot be loaded ({exc})"
            ) from exc

    obj = await unpickle()
    if wanted is None:
        return obj
    if into is None:
        check_read(src.url, meta, [(k, obj[k]) for k in wanted])
        return type(obj)((k, obj[k]) for k in wanted)
    plan = plan_into(obj, into)
    # Values that replace what into= holds (an entry the checkpoint has and into='s dict
    # lacks, a list where into= has None) are new objects: their tensors need their bytes.
    # They are found only now, in the structure: read their storages and unpickle again.
    more = placeholders(src.url, meta, plan, manifest.entries)
    if more:
        storages.update(await _read(reader, by_id, more, map_location, options))
        obj = await unpickle()
        plan = plan_into(obj, into)
    check_read(src.url, meta, [(top, value) for top, _, _, value in plan.sets])
    await fill(reader, by_id, plan, meta, src.url)
    return into


def storage_loader(
    url: str,
    by_id: Mapping[int, fmt.Storage],
    storages: Mapping[int, torch.UntypedStorage],
    placeholders: dict[int, int],
) -> Callable[[Any], torch.storage.TypedStorage]:
    """The ``persistent_load`` that unpickles a checkpoint's structure: each storage the
    pickle names gets its bytes from ``storages``, or, when they were not read, a
    placeholder on the meta device (no memory) whose C pointer is recorded in
    ``placeholders`` with the storage's id. A name the manifest lacks is an
    :class:`IntegrityError`."""

    def persistent_load(pid: Any) -> torch.storage.TypedStorage:
        if not (isinstance(pid, tuple) and len(pid) == 3 and pid[0] == "storage"):
            raise IntegrityError(f"{url}: the structure names an unknown object {pid!r}")
        _, sid, dtype = pid
        entry = by_id.get(sid)
        if entry is None:
            raise IntegrityError(f"{url}: the structure names a storage {sid!r} it lacks")
        storage = storages.get(sid)
        if storage is None:
            storage = torch.UntypedStorage(entry.nbytes, device="meta")  # type: ignore[no-untyped-call]
            placeholders[storage._cdata] = sid
        return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=storage, dtype=dtype_of(dtype), _internal=True
        )

    return persistent_load


async def _read(
    reader: ChunkReader,
    by_id: dict[int, fmt.Storage],
    sids: set[int],
    map_location: Any,
    options: TorchOptions,
) -> dict[int, torch.UntypedStorage]:
    out: dict[int, torch.UntypedStorage] = {}
    devices: dict[int, torch.device] = {}
    zeros: list[tuple[fmt.Storage, torch.device]] = []
    wanted: list[fmt.Storage] = []
    contexts = options.contexts
    for sid in sorted(sids):
        entry = by_id[sid]
        if contexts.fake_mode is not None:
            out[sid] = _fake_storage(entry)
            continue
        if entry.location == "meta":
            out[sid] = _meta_storage(entry.nbytes)  # a size and no bytes, as saved
            continue
        device = devices[sid] = _device_for(entry.location, map_location)
        if device.type == "meta":
            out[sid] = _meta_storage(entry.nbytes)  # map_location="meta": nothing to read
        elif contexts.skip_data:
            zeros.append((entry, device))
        else:
            wanted.append(entry)
    if zeros:
        # skip_data(): storages of the saved sizes, allocated but not read (zeros, where
        # torch leaves whatever the allocator had).
        check_memory(sum(entry.nbytes for entry, _ in zeros), reader.source.url)
        for entry, device in zeros:
            storage, memory = fixed_storage(entry.nbytes)
            if entry.nbytes:
                torch.frombuffer(memory, dtype=torch.uint8).zero_()
            out[entry.id] = _to(storage, device)
    if wanted:
        if options.mmap:
            read = await reader.mapped_storages(wanted, shared=options.mmap_shared)
        else:
            read = await reader.storages(wanted)
        out.update((sid, _to(storage, devices[sid])) for sid, storage in read.items())
    return out


def _meta_storage(nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage(nbytes, device="meta")  # type: ignore[no-untyped-call]


def _fake_storage(entry: fmt.Storage) -> torch.UntypedStorage:
    # As torch.load builds them under FakeTensorMode: a meta storage (no memory) that
    # says where it would live; torch's rebuild functions make fake tensors on it there
    # (map_location applied).
    try:
        torch.device(entry.location)
    except RuntimeError:
        raise IntegrityError(
            f"the checkpoint names a device {entry.location!r} that does not exist"
        ) from None
    storage = _meta_storage(entry.nbytes)
    storage._fake_device = entry.location  # type: ignore[assignment]
    return storage
