"""Pickling a checkpoint's structure, with tensor storages as persistent ids.

As ``torch.save`` does, every tensor is pickled as a rebuild of a view (offset, sizes,
strides) into a storage, and each storage is pickled as a persistent id: its bytes travel
separately, in chunks. Views, non-contiguous tensors and storages shared by several tensors
(tied weights) therefore come back exactly as they were, sharing included.

Loading is ``_unpickle.py``'s job.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

from ..errors import IntegrityError, InvalidArgument, Unpicklable, Unsupported
from ._contexts import TorchContexts, current, entered

__all__ = [
    "StoragePickler",
    "SavedStorage",
    "check_protocol",
    "dtype_name",
    "dtype_of",
    "pickle_structure",
]

PROTOCOL = 4


class SavedStorage:
    """A storage met while pickling: its bytes are saved as chunks.

    ``zeros``: saved under ``torch.serialization.skip_data()``, so its chunks hold zeros
    and its own bytes are never read. A storage on the meta device (``location`` is
    ``"meta"``) has no bytes at all: it is recorded without chunks and loads back on meta.
    """

    __slots__ = ("dtype", "id", "location", "name", "storage", "zeros")

    def __init__(
        self,
        id: int,
        storage: torch.UntypedStorage,
        dtype: torch.dtype,
        name: str,
        location: str | None = None,
        zeros: bool = False,
    ) -> None:
        self.id = id
        self.storage = storage
        self.dtype = dtype
        self.location = str(storage.device) if location is None else location
        self.name = name
        self.zeros = zeros and self.location != "meta"

    @property
    def nbytes(self) -> int:
        return int(self.storage.nbytes())

    @property
    def meta(self) -> bool:
        """Whether it is a meta storage: a size and no bytes (no chunks, no staging)."""
        return self.location == "meta"


_NOT_STORAGES = frozenset(
    {tuple, list, dict, collections.OrderedDict, int, float, bool, str, bytes, type(None)}
    | {torch.Size, torch.dtype, torch.device, torch.Tensor, torch.nn.Parameter}
)

_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest records for ``dtype`` (``"float32"``, ``"bfloat16"``…)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_of(name: str) -> torch.dtype:
    """The dtype a manifest names.

    Raises:
        IntegrityError: ``name`` is no torch dtype (a damaged or crafted manifest).
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype


class _StorageIds:
    """What a pickler needs to replace every tensor storage with ``("storage", id,
    dtype)``: mixed into ``pickle.Pickler`` (:class:`StoragePickler`) or the ``Pickler`` of
    the caller's ``pickle_module`` (``dill``, say)."""

    def _track(self, storages: dict[int, SavedStorage], skip_data: bool = False) -> None:
        self.storages = storages  # by the storage's C pointer, shared across picklers
        self.entry = ""  # the top-level entry being pickled, for names in messages
        self.seen: set[int] = set()  # storage ids this pickler referenced
        self.names: dict[int, str] = {}  # storage C pointer -> dotted path of a tensor on it
        self.skip_data = skip_data  # under torch.serialization.skip_data(): bytes are zeros

    def persistent_id(self, obj: Any) -> tuple[str, int, str] | None:
        # Called for every object pickled (thousands per state dict): leave the common
        # ones at once.
        if type(obj) in _NOT_STORAGES:
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, torch.uint8
        else:
            return None
        key = untyped._cdata
        saved = self.storages.get(key)
        if saved is None:
            name = self.names.get(key) or self.entry or "<object>"
            # A FakeTensor saved under skip_data(materialize_fake_tensors=True) has a meta
            # storage that stands for one on its fake device: saved there, as zeros.
            fake = getattr(obj, "_fake_device", None)
            location = None if fake is None else str(fake)
            zeros = self.skip_data or (fake is not None and untyped.device.type == "meta")
            saved = SavedStorage(len(self.storages), untyped, dtype, name, location, zeros)
            self.storages[key] = saved
        self.seen.add(saved.id)
        return ("storage", saved.id, dtype_name(dtype))


class StoragePickler(_StorageIds, pickle.Pickler):
    """Pickles an object, replacing every tensor storage with ``("storage", id, dtype)``."""

    def __init__(
        self,
        file: io.BytesIO,
        storages: dict[int, SavedStorage],
        protocol: int = PROTOCOL,
        skip_data: bool = False,
    ) -> None:
        super().__init__(file, protocol=protocol)
        self._track(storages, skip_data)


_PICKLERS: dict[type, type] = {}  # a pickle module's Pickler -> that Pickler with _StorageIds


def _pickler(
    module: Any,
    file: io.BytesIO,
    storages: dict[int, SavedStorage],
    protocol: int,
    skip_data: bool = False,
) -> Any:
    """A pickler writing to ``file``: :class:`StoragePickler`, or one built on the
    ``Pickler`` of ``module`` (the caller's ``pickle_module``)."""
    if module is None or module is pickle:
        return StoragePickler(file, storages, protocol, skip_data)
    base = getattr(module, "Pickler", None)
    if not isinstance(base, type):
        raise InvalidArgument(
            f"pickle_module={module!r} has no Pickler class: pass a module such as pickle or dill"
        )
    cls = _PICKLERS.get(base)
    if cls is None:
        cls = _PICKLERS[base] = type("StoragePickler", (_StorageIds, base), {})
    pickler = cls(file, protocol=protocol)
    pickler._track(storages, skip_data)
    return pickler


def check_protocol(protocol: object) -> int:
    """``pickle_protocol`` as given to ``save`` (``None``: asyncstore's, 4), checked."""
    if protocol is None:
        return PROTOCOL
    if (
        not isinstance(protocol, int)
        or isinstance(protocol, bool)
        or not 2 <= protocol <= pickle.HIGHEST_PROTOCOL
    ):
        raise InvalidArgument(
            f"pickle_protocol={protocol!r}: pass a pickle protocol from 2 to "
            f"{pickle.HIGHEST_PROTOCOL}, or leave it out (asyncstore uses {PROTOCOL})"
        )
    return protocol


def pickle_structure(
    obj: Any,
    pickle_module: Any = None,
    protocol: int = PROTOCOL,
    contexts: TorchContexts | None = None,
) -> tuple[bytes, list[SavedStorage], dict[str, list[int]] | None]:
    """Pickle ``obj`` (with ``pickle_module``'s Pickler, when given, and ``protocol``);
    returns the bytes, the storages in order, and for a dict with str keys, each key's
    storage ids (so that a partial load reads only those).

    ``contexts``: the caller's torch contexts, read on its thread; by default
    ``_contexts.current()`` (those carried here, else this thread's). Under
    ``torch.serialization.skip_data()`` every storage is recorded as usual but marked to be
    saved as zeros, and torch's own tensor pickling runs as it does under it (a tensor on
    the meta device warns, a nested tensor is refused).

    Raises:
        Unpicklable: ``obj`` cannot be pickled (an :class:`UnsafeCheckpoint`).
        InvalidArgument: a tensor that cannot be saved under ``skip_data()`` (a nested
            or quantized tensor: also a ``RuntimeError``, as torch raises).
    """
    if contexts is None:
        contexts = current()
    skip = contexts.skip_data
    storages: dict[int, SavedStorage] = {}
    entries: dict[str, list[int]] | None = None
    buffer = io.BytesIO()
    names = _tensor_paths(obj)
    try:
        # Pickling runs on this thread with no await inside: torch's per-thread state is
        # the caller's only for that long.
        with entered(contexts):
            pickler = _pickler(pickle_module, buffer, storages, protocol, skip)
            pickler.names = names
            pickler.dump(obj)
            if type(obj) in (dict, collections.OrderedDict) and all(
                isinstance(k, str) for k in obj
            ):
                entries = _entry_storages(obj, storages, names, pickle_module, protocol, skip)
    except InvalidArgument:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise Unpicklable(f"the object cannot be saved: {exc}") from exc
    except RuntimeError as exc:
        if not skip:
            raise
        # torch refuses, under skip_data(), tensors whose bytes it cannot leave out.
        raise Unsupported(
            f"the object cannot be saved under torch.serialization.skip_data(): {exc}"
        ) from exc
    return buffer.getvalue(), list(storages.values()), entries


def _entry_storages(
    obj: dict[str, Any],
    storages: dict[int, SavedStorage],
    names: dict[int, str],
    pickle_module: Any,
    protocol: int,
    skip: bool,
) -> dict[str, list[int]]:
    # Which storages each entry uses, so that a partial load reads only those: a plain
    # tensor's is known; anything else gets a pass of its own, which pickles only tensor
    # metadata (every storage is known by now, so ids do not change).
    entries: dict[str, list[int]] = {}
    by_id = {saved.id: saved for saved in storages.values()}
    for key, value in obj.items():
        known = _plain_tensor_storage(value, storages)
        if known is not None:
            entries[key] = known
            continue
        probe = _pickler(pickle_module, io.BytesIO(), storages, protocol, skip)
        probe.entry, probe.names = key, names
        probe.dump(value)
        entries[key] = sorted(probe.seen)
        if len(by_id) != len(storages):  # a __reduce__ made new tensors this time
            by_id = {saved.id: saved for saved in storages.values()}
        for sid in probe.seen:
            if by_id[sid].name == "<object>":
                by_id[sid].name = key  # a tensor inside an object: named by its entry
    return entries


def _plain_tensor_storage(value: Any, storages: dict[int, SavedStorage]) -> list[int] | None:
    # The storage ids a plain dense tensor was pickled with (none for a meta tensor, which
    # torch pickles by its shape alone); None for anything whose pickle may hold more
    # (Python attributes, nested or quantized tensors): those are probed.
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if value.layout != torch.strided or value.is_quantized or value.is_nested:
        return None
    if getattr(value, "__dict__", None):
        return None  # attributes (w.scale = tensor) are pickled with it
    if value.is_meta:
        return []
    saved = storages.get(value.untyped_storage()._cdata)
    return None if saved is None else [saved.id]


def _tensor_paths(obj: Any, limit: int = 100_000) -> dict[int, str]:
    """Dotted paths (``model.layers.0.weight``) of the tensors in nested dicts, lists and
    tuples, by storage: names for messages and ``exclude`` patterns."""
    names: dict[int, str] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack and limit:
        limit -= 1
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            try:
                key = value.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):
                continue  # no storage of its own (a sparse tensor): named by its entry
            names.setdefault(key, path or "<object>")
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list | tuple):
            stack.extend(
                (f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(value)))
            )
    return names
