"""What ``weights_only=True`` lets a pickle name, each callable checked before it runs, and
the messages of its refusals.

The allowed globals are torch's (``torch._weights_only_unpickler``): tensors and parameters
(with Python attributes), sparse, nested, meta and wrapper-subclass tensors, dtypes, layouts,
``torch.Size``, ``torch.device``, the containers and plain values, plus whatever the caller
allowed (``safe_globals``, ``torch.serialization.add_safe_globals``, the ``safe_globals()``
context). Every one that builds something from its arguments is wrapped here to check
them first: a tensor view must lie inside its storage, a sparse tensor's indices inside its
shape, and no argument may turn a few bytes of pickle into a large allocation or a long
computation (see ``_unpickle.py`` for what the opcodes check).
"""

from __future__ import annotations

import builtins
import collections
import reprlib
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsafeCheckpoint

__all__ = [
    "MAX_DIMS",
    "MAX_KEY_DEPTH",
    "NEW_OK",
    "REBUILDS",
    "Checks",
    "allowed_globals",
    "check_attributes",
    "check_view",
    "refusal",
    "short",
    "unsupported_global",
]

# More dimensions than any real tensor has; a bound on what one view check walks.
MAX_DIMS = 256
# Tuples nested deeper than this are refused as dict keys or set members: CPython hashes
# nested tuples recursively in C, without a recursion guard (a million levels crash it).
MAX_KEY_DEPTH = 100
# Items a pickle may make the unpickler copy, hash or walk, beyond one per byte of it:
# constructors that copy their argument (set, bytearray, torch.Size) can be called again
# and again on one memoised object, turning a megabyte of pickle into terabytes of work.
_WORK_PER_BYTE = 8
_WORK_FREE = 1 << 20

short = reprlib.Repr()
short.maxstring = short.maxother = 60

# The globals of objects that need a torch module imported first, which registers them
# with torch.serialization.add_safe_globals (torch's wording names the module).
_NJT = (
    "``torch.nested`` and ``torch._dynamo`` must be imported to load nested jagged tensors (NJTs)"
)
_DTENSOR = "``torch.distributed.tensor`` must be imported to load DTensors"
_NEEDS_IMPORT = {
    "torch.nested._internal.nested_tensor.NestedTensor": _NJT,
    "torch.nested._internal.nested_tensor._rebuild_njt": _NJT,
    "torch._dynamo.decorators._DimRange": _NJT,
    **{
        f"torch.distributed.{path}": _DTENSOR
        for path in (
            "device_mesh.DeviceMesh",
            "tensor._dtensor_spec.DTensorSpec",
            "tensor._dtensor_spec.TensorMeta",
            "tensor.DTensor",
            "tensor.placement_types.Partial",
            "tensor.placement_types.Replicate",
            "tensor.placement_types.Shard",
        )
    },
}


def refusal(where: str, what: str) -> UnsafeCheckpoint:
    """The error for a pickle that does something ``weights_only=True`` never allows
    (``what``), worded as ``torch.load`` words its own, so that code matching torch's
    messages keeps working."""
    return UnsafeCheckpoint(
        f"{where}: Weights only load failed: {what}. weights_only=True does not load that: "
        "the file was crafted, or damaged before its checksums were computed. If it is "
        "genuine, please file an issue with the following so that we can make "
        f"`weights_only=True` compatible with your use case: {what!r}. Pass "
        "weights_only=False only if you trust its source: it can run arbitrary code"
    )


def unsupported_global(where: str, module: str, name: str, blocked: bool) -> UnsafeCheckpoint:
    """The error for a global ``weights_only=True`` does not load: one of a module never
    loaded (``blocked``), one that needs a torch module imported first, or one not allowed
    (with how to allow it, in torch's words)."""
    path = f"{module}.{name}"
    if blocked:
        return UnsafeCheckpoint(
            f"{where}: Weights only load failed. Trying to load unsupported GLOBAL {path} "
            f"whose module {module} is blocked: weights_only=True never loads it, even when "
            "allowed"
        )
    if path in _NEEDS_IMPORT:
        return UnsafeCheckpoint(f"{where}: Weights only load failed. {_NEEDS_IMPORT[path]}")
    shown = name if module == "builtins" else path  # as torch shows it: GLOBAL print
    return UnsafeCheckpoint(
        f"{where}: Weights only load failed. Unsupported global: GLOBAL {shown} was not an "
        "allowed global by default (only tensors, containers and plain values are). Please "
        f"use `torch.serialization.add_safe_globals([{shown}])` or the "
        f"`torch.serialization.safe_globals([{shown}])` context manager (or "
        f"safe_globals=[{shown}]) to allowlist this global if you trust this class/function. "
        "If you trust where the checkpoint came from, weights_only=False loads it, but it "
        "can run arbitrary code"
    )


def check_view(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: torch.dtype, where: str
) -> None:
    """Refuse a tensor view (``offset``, ``size``, ``stride`` in elements of ``dtype``) that
    does not lie inside ``storage``, or whose numbers are not plain non-negative ints.

    Raises:
        UnsafeCheckpoint: naming the view and the storage's size.
    """
    if isinstance(storage, torch.storage.TypedStorage):
        nbytes = storage._untyped_storage.nbytes()
    elif isinstance(storage, torch.UntypedStorage):
        nbytes = storage.nbytes()
    else:
        raise refusal(where, f"a tensor is built over a {type(storage).__name__}, not a storage")
    if type(offset) is not int or not _dims(size) or not _dims(stride) or len(size) != len(stride):
        raise refusal(
            where,
            f"a tensor view has offset {short.repr(offset)}, size {short.repr(size)} and "
            f"stride {short.repr(stride)} (each must be plain ints, at most {MAX_DIMS} of them)",
        )
    if offset < 0 or min(size, default=0) < 0 or min(stride, default=0) < 0:
        raise refusal(where, f"a tensor view has a negative offset, size or stride ({size})")
    if 0 in size:
        return  # no elements: it reads no byte, wherever it starts
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    needed = (last + 1) * dtype.itemsize
    if needed > nbytes:
        raise refusal(
            where,
            f"a tensor of size {tuple(size)} reaches byte {needed:,} of a storage of "
            f"{nbytes:,} bytes",
        )


def _dims(value: Any) -> bool:
    # A size or stride: at most MAX_DIMS plain ints.
    return (
        type(value) in (tuple, list, torch.Size)
        and len(value) <= MAX_DIMS
        and all(type(n) is int for n in value)
    )


class Checks:
    """The checks one unpickling shares: where (for messages) and the work left."""

    def __init__(self, where: str, pickle_bytes: int) -> None:
        self.where = where
        self.work = _WORK_FREE + _WORK_PER_BYTE * pickle_bytes
        self.keys: dict[int, tuple[Any, ...]] = {}  # tuples already checked, kept alive

    def spend(self, items: int) -> None:
        """Charge ``items`` to the work left; refuse once it runs out."""
        self.work -= items
        if self.work < 0:
            raise refusal(
                self.where,
                "the pickle makes the unpickler copy or hash far more items than it holds",
            )

    def key(self, key: Any) -> None:
        """Refuse a dict key or set member whose hash would recurse too deep or cost too
        much (only tuples nest into a hash)."""
        if not isinstance(key, tuple):
            return
        self.spend(len(key))
        if id(key) in self.keys:
            return
        level = [key]
        for _ in range(MAX_KEY_DEPTH):
            level = [item for t in level for item in t if isinstance(item, tuple)]
            if not level:
                self.keys[id(key)] = key
                return
            self.spend(sum(len(t) for t in level))
        raise refusal(
            self.where, f"a dict key or set member nests tuples more than {MAX_KEY_DEPTH} deep"
        )

    def sized(self, value: Any, what: str) -> Any:
        """``value``, if it is a container whose items a constructor may copy (not a range,
        an int or an iterator asking for 2**40 of them); their count is charged."""
        if type(value) not in (list, tuple, set, frozenset, dict, collections.OrderedDict):
            raise refusal(self.where, f"{what} is built from a {type(value).__name__}")
        self.spend(len(value))
        return value


def check_attributes(state: Any, cls: type, refuse: Callable[[str], Exception]) -> None:
    """Refuse a plain tensor's or parameter's pickled Python attributes unless they are a
    dict (or a ``(dict, slots)`` pair, slots empty) of new names: none the class defines,
    none starting with ``_``."""
    if isinstance(state, tuple):
        if len(state) != 2 or state[1]:
            raise refuse("a tensor's pickled state sets slots")
        state = state[0]
    if state is None:
        return
    if type(state) is not dict:
        raise refuse(f"a tensor's pickled state is a {type(state).__name__}")
    for name in state:
        if not isinstance(name, str) or name.startswith("_") or hasattr(cls, name):
            raise refuse(f"a tensor's pickled state sets {short.repr(name)}")


# The rebuild functions a tensor pickled with Python attributes, or as an allowed subclass,
# may name inside torch._tensor._rebuild_from_type_v2.
REBUILDS = tuple(
    ("torch._utils", name)
    for name in (
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_sparse_tensor",
        "_rebuild_nested_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_cpu_tensor",
    )
)

_SPARSE = {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
_LAYOUTS = {str(layout): layout for layout in (*_SPARSE, torch.strided, torch.jagged)}


def allowed_globals(checks: Checks, trusted: set[type]) -> dict[tuple[str, str], Any]:
    """The globals ``weights_only=True`` loads, by ``(module, name)``, each callable that
    builds from its arguments checked first; ``trusted`` are the caller's allowed classes
    (the only tensor subclasses a wrapper may be built as)."""
    where = checks.where

    def refuse(what: str) -> UnsafeCheckpoint:
        return refusal(where, what)

    def no_hooks(hooks: Any, what: str) -> None:
        if hooks:
            raise refuse(f"{what} carries backward hooks")

    def tensor(value: Any, what: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise refuse(f"{what} is built from a {type(value).__name__}")
        return value

    def rebuild_v1(storage: Any, offset: Any, size: Any, stride: Any) -> Any:
        dtype = storage.dtype if isinstance(storage, torch.storage.TypedStorage) else torch.uint8
        check_view(storage, offset, size, stride, dtype, where)
        return torch._utils._rebuild_tensor(storage, offset, size, stride)  # type: ignore[no-untyped-call]

    def rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        dtype = storage.dtype if isinstance(storage, torch.storage.TypedStorage) else torch.uint8
        check_view(storage, offset, size, stride, dtype, where)
        no_hooks(rest[1] if len(rest) > 1 else None, "a tensor")
        return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, *rest)  # type: ignore[no-untyped-call]

    def rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        dtype = rest[2] if len(rest) > 2 else None
        if not isinstance(dtype, torch.dtype):
            raise refuse(f"a tensor is rebuilt with dtype {short.repr(dtype)}")
        check_view(storage, offset, size, stride, dtype, where)
        no_hooks(rest[1], "a tensor")
        return torch._utils._rebuild_tensor_v3(storage, offset, size, stride, *rest)  # type: ignore[no-untyped-call]

    def rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Any:
        no_hooks(hooks, "a parameter")
        return torch._utils._rebuild_parameter(tensor(data, "a parameter"), requires_grad, hooks)  # type: ignore[no-untyped-call]

    def rebuild_parameter_with_state(data: Any, requires_grad: Any, hooks: Any, state: Any) -> Any:
        # A parameter with Python attributes: new names only, as for a plain tensor.
        no_hooks(hooks, "a parameter")
        check_attributes(state, torch.nn.Parameter, refuse)
        data = tensor(data, "a parameter")
        return torch._utils._rebuild_parameter_with_state(data, requires_grad, hooks, state)  # type: ignore[no-untyped-call]

    def rebuild_sparse(layout: Any, data: Any) -> Any:
        # Built without torch's checks, then checked at once (torch checks only when
        # sparse invariant checks are switched on): indices outside the shape would make
        # later operations read and write outside the values' memory.
        if layout not in _SPARSE or type(data) is not tuple:
            raise refuse(f"a sparse tensor has layout {short.repr(layout)}")
        try:
            if layout is torch.sparse_coo and len(data) in (3, 4):
                indices, values, size = data[:3]
                coalesced = data[3] if len(data) == 4 else None
                _check_size(size, refuse)
                result = torch.sparse_coo_tensor(
                    tensor(indices, "a sparse tensor"),
                    tensor(values, "a sparse tensor"),
                    size,
                    check_invariants=False,
                    is_coalesced=coalesced,
                )
                torch._validate_sparse_coo_tensor_args(
                    result._indices(), result._values(), result.size(), result.is_coalesced()
                )
                return result
            if layout is not torch.sparse_coo and len(data) == 4:
                compressed, plain, values, size = data
                _check_size(size, refuse)
                result = torch.sparse_compressed_tensor(
                    tensor(compressed, "a sparse tensor"),
                    tensor(plain, "a sparse tensor"),
                    tensor(values, "a sparse tensor"),
                    size,
                    layout=layout,
                    check_invariants=False,
                )
                torch._validate_sparse_compressed_tensor_args(
                    compressed, plain, values, result.size(), layout
                )
                return result
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            raise refuse(f"a sparse tensor is not valid ({exc})") from exc
        raise refuse(f"a sparse tensor is built from {len(data)} items")

    def rebuild_nested(buffer: Any, sizes: Any, strides: Any, offsets: Any) -> Any:
        # torch checks each component against the buffer (setStorage) as it builds them.
        for part in (buffer, sizes, strides, offsets):
            tensor(part, "a nested tensor")
        try:
            return torch._utils._rebuild_nested_tensor(buffer, sizes, strides, offsets)  # type: ignore[no-untyped-call]
        except (RuntimeError, ValueError, IndexError) as exc:
            raise refuse(f"a nested tensor is not valid ({exc})") from exc

    def rebuild_meta(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> Any:
        # A tensor on the meta device: shape and dtype only, no memory.
        if not isinstance(dtype, torch.dtype) or not _dims(size) or not _dims(stride):
            raise refuse(f"a meta tensor has dtype {short.repr(dtype)}, size {short.repr(size)}")
        return torch._utils._rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad)  # type: ignore[no-untyped-call]

    def rebuild_wrapper(
        cls: Any,
        dtype: Any,
        size: Any,
        stride: Any,
        offset: Any,
        layout: Any,
        device: Any,
        requires_grad: Any,
    ) -> Any:
        # The outer tensor of a wrapper subclass (its data lies in the state set next):
        # only as a subclass the caller allowed.
        if cls not in trusted or not issubclass(cls, torch.Tensor):
            raise refuse(
                f"a tensor is rebuilt as {short.repr(cls)}, a type not allowed (allow a "
                "tensor subclass with safe_globals)"
            )
        if not isinstance(dtype, torch.dtype) or not _dims(size) or not _dims(stride):
            raise refuse(f"a {cls.__name__} has dtype {short.repr(dtype)}, size {short.repr(size)}")
        if type(offset) is not int or not isinstance(layout, torch.layout):
            raise refuse(f"a {cls.__name__} has offset {short.repr(offset)}")
        return torch._utils._rebuild_wrapper_subclass(  # type: ignore[no-untyped-call]
            cls, dtype, size, stride, offset, layout, device, requires_grad
        )

    def rebuild_from_cpu(data: Any, dtype: Any, device: Any, requires_grad: Any) -> Any:
        data = tensor(data, "a device tensor")
        rebuild = torch._utils._rebuild_device_tensor_from_cpu_tensor
        return rebuild(data, dtype, device, requires_grad)  # type: ignore[no-untyped-call]

    def get_layout(name: Any) -> torch.layout:
        if name not in _LAYOUTS:
            raise refuse(f"a tensor names layout {short.repr(name)}")
        return _LAYOUTS[name]

    def ordered_dict(*args: Any) -> Any:
        return _mapping(collections.OrderedDict, args, checks)

    def counter(*args: Any) -> Any:
        return _mapping(collections.Counter, args, checks)

    def make_set(kind: type) -> Callable[..., Any]:
        def build(*args: Any) -> Any:
            if args:
                for item in checks.sized(args[0], f"a {kind.__name__}"):
                    checks.key(item)
            return kind(*args)

        return build

    def make_bytearray(*args: Any) -> bytearray:
        # Pickled as bytearray(bytes) (protocol 3+) or bytearray(str, "latin-1") (2).
        if args and not isinstance(args[0], bytes | str):
            raise refuse(f"a bytearray is built from a {type(args[0]).__name__}")
        checks.spend(len(args[0]) if args else 0)
        return bytearray(*args)

    def encode(text: Any, encoding: Any = "utf-8") -> bytes:
        # Protocol 2 pickles bytes as _codecs.encode(str, "latin1").
        if type(text) is not str or encoding not in ("latin1", "latin-1"):
            raise refuse(f"the pickle encodes a {type(text).__name__} as {short.repr(encoding)}")
        return text.encode("latin-1")

    def size(*dims: Any) -> torch.Size:
        return torch.Size(checks.sized(dims[0], "a torch.Size") if dims else ())

    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): ordered_dict,
        ("collections", "Counter"): counter,
        ("builtins", "set"): make_set(builtins.set),
        ("builtins", "frozenset"): make_set(builtins.frozenset),
        ("builtins", "complex"): builtins.complex,
        ("builtins", "slice"): builtins.slice,
        ("builtins", "range"): builtins.range,
        ("builtins", "bytearray"): make_bytearray,
        ("_codecs", "encode"): encode,
        ("torch", "Size"): size,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.serialization", "_get_layout"): get_layout,
    }
    rebuilds = (
        rebuild_v1,
        rebuild_v2,
        rebuild_v3,
        rebuild_parameter,
        rebuild_parameter_with_state,
        rebuild_sparse,
        rebuild_nested,
        rebuild_meta,
        rebuild_wrapper,
        rebuild_from_cpu,
    )
    allowed.update(zip(REBUILDS, rebuilds, strict=True))
    allowed.update(_DTYPES)
    return allowed


def _mapping(kind: type, args: tuple[Any, ...], checks: Checks) -> Any:
    # OrderedDict / Counter from a list of pairs or a dict, its keys checked.
    if args:
        items = checks.sized(args[0], f"a {kind.__name__}")
        pairs = items.items() if isinstance(items, dict) else items
        for pair in pairs:
            if type(pair) is not tuple or len(pair) != 2:
                raise refusal(checks.where, f"a {kind.__name__} is built from items not pairs")
            checks.key(pair[0])
    return kind(*args)


def _check_size(size: Any, refuse: Callable[[str], Exception]) -> None:
    if not _dims(size):
        raise refuse(f"a sparse tensor has size {short.repr(size)}")


_DTYPES = {
    ("torch", name): value
    for name in dir(torch)
    if isinstance(value := getattr(torch, name, None), torch.dtype)
}

# Classes that cls.__new__ may build (pickle's NEWOBJ) without a call through the checks
# above: they build nothing large from their arguments.
NEW_OK = (complex, slice, range, torch.device, torch.nn.Parameter)
