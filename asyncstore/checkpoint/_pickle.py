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

from ..errors import IntegrityError, InvalidArgument, UnsafeCheckpoint

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
    """A storage met while pickling: its bytes are saved as chunks."""

    __slots__ = ("dtype", "id", "location", "name", "storage")

    def __init__(
        self, id: int, storage: torch.UntypedStorage, dtype: torch.dtype, name: str
    ) -> None:
        self.id = id
        self.storage = storage
        self.dtype = dtype
        self.location = str(storage.device)
        self.name = name

    @property
    def nbytes(self) -> int:
        return int(self.storage.nbytes())


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

    def _track(self, storages: dict[int, SavedStorage]) -> None:
        self.storages = storages  # by the storage's C pointer, shared across picklers
        self.entry = ""  # the top-level entry being pickled, for names in messages
        self.seen: set[int] = set()  # storage ids this pickler referenced
        self.names: dict[int, str] = {}  # storage C pointer -> dotted path of a tensor on it

    def persistent_id(self, obj: Any) -> tuple[str, int, str] | None:
        # Called for every object pickled (thousands per state dict): leave the common
        # ones at once.
        if type(obj) in _NOT_STORAGES:
            if type(obj) in _TENSORS and obj.is_meta:
                self._refuse_meta(obj)
            return None
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            self._refuse_meta(obj)
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, torch.uint8
        else:
            return None
        if untyped.device.type == "meta":
            self._refuse_meta(None)
        key = untyped._cdata
        saved = self.storages.get(key)
        if saved is None:
            name = self.names.get(key) or self.entry or "<object>"
            saved = SavedStorage(len(self.storages), untyped, dtype, name)
            self.storages[key] = saved
        self.seen.add(saved.id)
        return ("storage", saved.id, dtype_name(dtype))

    def _refuse_meta(self, tensor: torch.Tensor | None) -> None:
        # A meta tensor pickles without a storage (torch rebuilds it from its shape alone), so
        # it would save without error and then fail every weights_only load.
        name = self.names.get(tensor.untyped_storage()._cdata) if tensor is not None else None
        if name in (None, "<object>"):
            name = self.entry or None
        raise UnsafeCheckpoint(_meta_message("the object" if name is None else repr(name)))


class StoragePickler(_StorageIds, pickle.Pickler):
    """Pickles an object, replacing every tensor storage with ``("storage", id, dtype)``."""

    def __init__(
        self, file: io.BytesIO, storages: dict[int, SavedStorage], protocol: int = PROTOCOL
    ) -> None:
        super().__init__(file, protocol=protocol)
        self._track(storages)


_PICKLERS: dict[type, type] = {}  # a pickle module's Pickler -> that Pickler with _StorageIds


def _pickler(
    module: Any, file: io.BytesIO, storages: dict[int, SavedStorage], protocol: int
) -> Any:
    """A pickler writing to ``file``: :class:`StoragePickler`, or one built on the
    ``Pickler`` of ``module`` (the caller's ``pickle_module``)."""
    if module is None or module is pickle:
        return StoragePickler(file, storages, protocol)
    base = getattr(module, "Pickler", None)
    if not isinstance(base, type):
        raise InvalidArgument(
            f"pickle_module={module!r} has no Pickler class: pass a module such as pickle or dill"
        )
    cls = _PICKLERS.get(base)
    if cls is None:
        cls = _PICKLERS[base] = type("StoragePickler", (_StorageIds, base), {})
    pickler = cls(file, protocol=protocol)
    pickler._track(storages)
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


def _meta_message(name: str) -> str:
    return (
        f"{name} is a tensor on the meta device, which has no data to save; materialise it "
        "first (for example with module.to_empty(device='cpu') and then loading or "
        "initialising its weights)"
    )


def pickle_structure(
    obj: Any, pickle_module: Any = None, protocol: int = PROTOCOL
) -> tuple[bytes, list[SavedStorage], dict[str, list[int]] | None]:
    """Pickle ``obj`` (with ``pickle_module``'s Pickler, when given, and ``protocol``);
    returns the bytes, the storages in order, and for a dict with str keys, each key's
    storage ids (so that a partial load reads only those)."""
    storages: dict[int, SavedStorage] = {}
    entries: dict[str, list[int]] | None = None
    buffer = io.BytesIO()
    names = _tensor_paths(obj)
    try:
        pickler = _pickler(pickle_module, buffer, storages, protocol)
        pickler.names = names
        pickler.dump(obj)
        if type(obj) in (dict, collections.OrderedDict) and all(isinstance(k, str) for k in obj):
            # Which storages each entry uses, so that a partial load reads only those: a
            # tensor's is known; anything else gets a pass of its own, which pickles only
            # tensor metadata (every storage is known by now, so ids do not change).
            entries = {}
            by_id = {saved.id: saved for saved in storages.values()}
            for key, value in obj.items():
                saved = _plain_tensor_storage(value, storages)
                if saved is not None:
                    entries[key] = [saved.id]
                    continue
                probe = _pickler(pickle_module, io.BytesIO(), storages, protocol)
                probe.entry, probe.names = key, names
                probe.dump(value)
                entries[key] = sorted(probe.seen)
                if len(by_id) != len(storages):  # a __reduce__ made new tensors this time
                    by_id = {saved.id: saved for saved in storages.values()}
                for sid in probe.seen:
                    if by_id[sid].name == "<object>":
                        by_id[sid].name = key  # a tensor inside an object: named by its entry
    except InvalidArgument:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UnsafeCheckpoint(f"the object cannot be saved: {exc}") from exc
    return buffer.getvalue(), list(storages.values()), entries


def _plain_tensor_storage(value: Any, storages: dict[int, SavedStorage]) -> SavedStorage | None:
    # The one storage a plain dense tensor was pickled with; None for anything whose pickle
    # may hold more (Python attributes, nested or quantized tensors): those are probed.
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if value.layout != torch.strided or value.is_quantized or value.is_nested:
        return None
    if getattr(value, "__dict__", None):
        return None  # attributes (w.scale = tensor) are pickled with it
    return storages.get(value.untyped_storage()._cdata)


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
