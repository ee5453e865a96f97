"""Unpickling a checkpoint's structure, with ``weights_only=True`` safe against crafted files.

An allow-list of globals (what :class:`RestrictedUnpickler` lets a pickle name) is not enough
on its own: allowed callables can still be abused. A crafted structure could otherwise

- rebuild a tensor over more bytes than its storage holds (``set_`` grows a resizable
  storage, and the tensor then shows whatever the allocator had there);
- attach state through pickle's BUILD opcode (``Tensor.__setstate__`` sets backward hooks,
  which run later inside ``backward()``), or call ``set_`` through it;
- amplify a few bytes into gigabytes (``bytearray(2**40)``, ``torch.Size(range(2**40))``,
  ``f(*range(2**40))``);
- nest tuples a million deep and use one as a dict key: hashing it recurses in C and kills
  the interpreter.

So the restricted unpickler is pickle's pure-Python one with the opcodes that call, build or
insert replaced by checked versions, and every allowed callable that builds something from
its arguments wrapped to check them first. Everything it refuses raises
:class:`~asyncstore.UnsafeCheckpoint`, naming what was refused.
"""

from __future__ import annotations

import builtins
import collections
import io
import pickle
import reprlib
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import IntegrityError, InvalidArgument, UnsafeCheckpoint

__all__ = [
    "MAX_DIMS",
    "MAX_KEY_DEPTH",
    "BoundedUnpickler",
    "PlainUnpickler",
    "RestrictedUnpickler",
    "allow_list",
    "check_view",
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

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def _refuse(where: str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{where}: {what}, which weights_only=True does not load; the file was crafted, or "
        "damaged before its checksums were computed. Pass weights_only=False only if you "
        "trust its source"
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
        raise _refuse(where, f"a tensor is built over a {type(storage).__name__}, not a storage")
    if (
        type(offset) is not int
        or type(size) not in (tuple, list, torch.Size)
        or type(stride) not in (tuple, list)
        or len(size) != len(stride)
        or len(size) > MAX_DIMS
        or not all(type(n) is int for n in size)
        or not all(type(n) is int for n in stride)
    ):
        raise _refuse(
            where,
            f"a tensor view has offset {_short.repr(offset)}, size {_short.repr(size)} and "
            f"stride {_short.repr(stride)} (each must be plain ints, at most {MAX_DIMS} of them)",
        )
    if offset < 0 or min(size, default=0) < 0 or min(stride, default=0) < 0:
        raise _refuse(where, f"a tensor view has a negative offset, size or stride ({size})")
    if 0 in size:
        return  # no elements: it reads no byte, wherever it starts
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    needed = (last + 1) * dtype.itemsize
    if needed > nbytes:
        raise _refuse(
            where,
            f"a tensor of size {tuple(size)} reaches byte {needed:,} of a storage of "
            f"{nbytes:,} bytes",
        )


class _Checks:
    """The checks one unpickling shares: where (for messages) and the work left."""

    def __init__(self, where: str, pickle_bytes: int) -> None:
        self.where = where
        self.work = _WORK_FREE + _WORK_PER_BYTE * pickle_bytes
        self.keys: dict[int, tuple[Any, ...]] = {}  # tuples already checked, kept alive

    def spend(self, items: int) -> None:
        self.work -= items
        if self.work < 0:
            raise _refuse(
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
        raise _refuse(
            self.where, f"a dict key or set member nests tuples more than {MAX_KEY_DEPTH} deep"
        )

    def sized(self, value: Any, what: str) -> Any:
        """``value``, if it is a container whose items a constructor may copy (not a range,
        an int or an iterator asking for 2**40 of them); their count is charged."""
        if type(value) not in (list, tuple, set, frozenset, dict, collections.OrderedDict):
            raise _refuse(self.where, f"{what} is built from a {type(value).__name__}")
        self.spend(len(value))
        return value


def _allowed(checks: _Checks) -> dict[tuple[str, str], Any]:
    where = checks.where

    def hooks_refused(hooks: Any, what: str) -> None:
        if hooks:
            raise _refuse(where, f"{what} carries backward hooks")

    def rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        dtype = storage.dtype if isinstance(storage, torch.storage.TypedStorage) else torch.uint8
        check_view(storage, offset, size, stride, dtype, where)
        hooks_refused(rest[1] if len(rest) > 1 else None, "a tensor")
        return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, *rest)  # type: ignore[no-untyped-call]

    def rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        dtype = rest[2] if len(rest) > 2 else None
        if not isinstance(dtype, torch.dtype):
            raise _refuse(where, f"a tensor is rebuilt with dtype {_short.repr(dtype)}")
        check_view(storage, offset, size, stride, dtype, where)
        hooks_refused(rest[1], "a tensor")
        return torch._utils._rebuild_tensor_v3(storage, offset, size, stride, *rest)  # type: ignore[no-untyped-call]

    def rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Any:
        if not isinstance(data, torch.Tensor):
            raise _refuse(where, f"a parameter is built from a {type(data).__name__}")
        hooks_refused(hooks, "a parameter")
        return torch._utils._rebuild_parameter(data, requires_grad, hooks)  # type: ignore[no-untyped-call]

    def ordered_dict(*args: Any) -> Any:
        if args:
            for pair in checks.sized(args[0], "an OrderedDict"):
                if type(pair) is not tuple or len(pair) != 2:
                    raise _refuse(where, "an OrderedDict is built from items that are not pairs")
                checks.key(pair[0])
        return collections.OrderedDict(*args)

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
            raise _refuse(where, f"a bytearray is built from a {type(args[0]).__name__}")
        checks.spend(len(args[0]) if args else 0)
        return bytearray(*args)

    def size(*dims: Any) -> torch.Size:
        return torch.Size(checks.sized(dims[0], "a torch.Size") if dims else ())

    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): ordered_dict,
        ("builtins", "set"): make_set(builtins.set),
        ("builtins", "frozenset"): make_set(builtins.frozenset),
        ("builtins", "complex"): builtins.complex,
        ("builtins", "slice"): builtins.slice,
        ("builtins", "range"): builtins.range,
        ("builtins", "bytearray"): make_bytearray,
        ("torch._utils", "_rebuild_tensor_v2"): rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
        ("torch", "Size"): size,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    }
    allowed.update(_DTYPES)
    return allowed


_DTYPES = {
    ("torch", name): value
    for name in dir(torch)
    if isinstance(value := getattr(torch, name, None), torch.dtype)
}

# Classes that cls.__new__ may build (pickle's NEWOBJ) without a call through the checks
# above: they build nothing large from their arguments.
_NEW_OK = (complex, slice, range, torch.device, torch.nn.Parameter)

_PyUnpickler: Any = pickle._Unpickler  # the pure-Python one: its opcodes can be replaced
_bounded: dict[int, Callable[..., None]] = dict(_PyUnpickler.dispatch)


class BoundedUnpickler(_PyUnpickler):  # type: ignore[misc]
    """pickle's pure-Python unpickler, reading a pickle held in memory, with every length
    the pickle gives checked against the pickle's own size before anything of that length
    is allocated.

    pickle's ``BYTEARRAY8`` allocates the length it reads, then reads into it (the C
    unpickler does so for ``BINBYTES`` and ``BINBYTES8`` too): eleven crafted bytes would
    otherwise take gigabytes. Every other length the pure-Python unpickler reads is a read
    of the bytes that are there. Subclasses add their own checks; ``where`` names the file
    in messages.

    Raises (from :meth:`load`):
        IntegrityError: a length past the end of the pickle.
    """

    dispatch = _bounded

    def __init__(self, file: io.BytesIO, where: str, **unpickler_args: Any) -> None:
        super().__init__(file, **unpickler_args)
        self._pickle_bytes = file.getbuffer().nbytes
        self._where = where

    def load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._pickle_bytes:
            raise IntegrityError(
                f"{self._where}: the pickle claims a bytearray of {size:,} bytes but holds "
                f"{self._pickle_bytes:,} bytes in all: it is damaged or crafted"
            )
        value = bytearray(size)
        self.readinto(value)
        if len(value) != size:  # outside a frame, pickle's readinto takes what is there
            raise IntegrityError(f"{self._where}: the pickle ends inside a bytearray")
        self.append(value)

    _bounded[pickle.BYTEARRAY8[0]] = load_bytearray8


# The restricted unpickler's opcode table: the bounded one's, with the opcodes that call,
# set state or insert replaced by the checked versions below. Every other opcode pushes a
# constant, builds a tuple or list from what is already on the stack, or uses the memo.
_dispatch: dict[int, Callable[..., None]] = dict(_bounded)


_REBUILDS = (
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
)


class _TypeRef:
    """``torch.Tensor`` as a pickle names it: only an argument of a checked rebuild, never
    called (``torch.Tensor(2**40)`` would allocate that much)."""

    def __call__(self, *args: Any) -> Any:
        raise UnsafeCheckpoint("the pickle calls torch.Tensor, which weights_only=True refuses")


_TENSOR_TYPE = _TypeRef()


def _check_attributes(state: Any, cls: type, refuse: Callable[[str], Exception]) -> None:
    """Refuse a plain tensor's pickled Python attributes unless they are a dict (or a
    ``(dict, slots)`` pair, slots empty) of new names: none the class defines, none
    starting with ``_``."""
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
            raise refuse(f"a tensor's pickled state sets {_short.repr(name)}")


# Modules whose names weights_only=True never loads, even when a caller allows them (the
# same as torch's): their functions run commands or replace the process.
BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})


class RestrictedUnpickler(BoundedUnpickler):
    """Unpickles only tensors, containers and plain values (``weights_only=True``).

    Any other global — a class, a function, ``os.system`` — raises
    :class:`~asyncstore.UnsafeCheckpoint` before it is imported, unless the caller allowed it
    with ``safe_globals``; so do tensor views past their storage, backward hooks, state set on
    objects other than the caller's own classes, and arguments that would turn a few bytes
    of pickle into a large allocation or a long computation. A length past the end of the
    pickle raises :class:`~asyncstore.IntegrityError` (see :class:`BoundedUnpickler`).
    """

    dispatch = _dispatch

    def __init__(
        self,
        file: io.BytesIO,
        persistent_load: Callable[[Any], Any],
        where: str,
        safe_globals: Iterable[Any] = (),
        **unpickler_args: Any,
    ) -> None:
        super().__init__(file, where, **unpickler_args)
        self._checks = _Checks(where, self._pickle_bytes)
        self._allowed = _allowed(self._checks)
        self._trusted: set[type] = set()
        self._by_path: dict[str, Any] = {}  # torch's (value, "module.name") entries
        for item in safe_globals:
            if isinstance(item, tuple):
                value, path = item
                self._by_path[path] = value
            else:
                value = item
                self._allowed[value.__module__, value.__qualname__] = value
            if isinstance(value, type):
                self._trusted.add(value)
        self._persistent = persistent_load
        self._rebuilds = {self._allowed[key] for key in _REBUILDS}
        # A tensor with Python attributes, or of a subclass the caller allowed.
        self._allowed["torch._tensor", "_rebuild_from_type_v2"] = self._rebuild_from_type
        self._allowed["torch._tensor", "Tensor"] = _TENSOR_TYPE
        self._allowed["torch", "Tensor"] = _TENSOR_TYPE

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid)

    def _rebuild_from_type(self, func: Any, new_type: Any, args: Any, state: Any) -> Any:
        # torch._tensor._rebuild_from_type_v2, checked: the tensor comes from one of the
        # checked rebuilds; its type is Tensor, Parameter or a Tensor subclass the caller
        # allowed; and attributes set on a plain Tensor or Parameter are new names holding
        # plain values, never ones the class defines (data, grad, __class__ ...).
        if func not in self._rebuilds:
            raise self._refuse(f"a tensor is rebuilt by {_short.repr(func)}")
        if new_type is _TENSOR_TYPE:
            new_type = torch.Tensor
        plain = new_type in (torch.Tensor, torch.nn.Parameter)
        if not plain and not (
            isinstance(new_type, type)
            and issubclass(new_type, torch.Tensor)
            and new_type in self._trusted
        ):
            raise self._refuse(
                f"a tensor is rebuilt as {_short.repr(new_type)}, a type not allowed (allow "
                "a tensor subclass with safe_globals)"
            )
        if type(args) is not tuple:
            raise self._refuse(f"a tensor is rebuilt from a {type(args).__name__}")
        if plain:
            _check_attributes(state, new_type, self._refuse)
        return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)  # type: ignore[no-untyped-call]

    def find_class(self, module: str, name: str) -> Any:
        if module.partition(".")[0] in BLOCKED_MODULES:
            # As torch: never, whatever the caller allowed.
            raise UnsafeCheckpoint(
                f"{self._where} holds {module}.{name}, whose module {module} is blocked: "
                "weights_only=True never loads it, even when allowed"
            )
        value = self._allowed.get((module, name), self._by_path.get(f"{module}.{name}"))
        if value is None:
            raise UnsafeCheckpoint(
                f"{self._where} holds {module}.{name}, which weights_only=True does not load "
                f"(GLOBAL {module}.{name} was not an allowed global by default: only tensors, "
                "containers and plain values are). If you trust where this checkpoint came "
                "from, pass weights_only=False, or allow that one name with "
                f"safe_globals=[{module}.{name}] or "
                f"torch.serialization.add_safe_globals([{module}.{name}])"
            )
        return value

    def _refuse(self, what: str) -> UnsafeCheckpoint:
        return _refuse(self._where, what)

    # -- the opcodes that call something ---------------------------------------------------

    def load_reduce(self) -> None:
        args = self.stack.pop()
        if type(args) is not tuple:  # f(*range(2**40)) would build that tuple first
            raise self._refuse(f"a call takes its arguments from a {type(args).__name__}")
        self.stack[-1] = self.stack[-1](*args)

    _dispatch[pickle.REDUCE[0]] = load_reduce

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        # The checked callables are functions, so they fail here: only classes that build
        # nothing large from their arguments, or that the caller trusts, are built.
        if not isinstance(cls, type) or (cls not in _NEW_OK and cls not in self._trusted):
            raise self._refuse(f"{_short.repr(cls)} is built without a call")
        if type(args) is not tuple or type(kwargs) is not dict:
            raise self._refuse(f"{cls.__name__} is built from a {type(args).__name__}")
        self.append(cls.__new__(cls, *args, **kwargs))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, {})

    _dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    _dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def _old_opcode(self) -> None:
        # INST and OBJ (protocols 0-1) call a class with any arguments; EXT codes name
        # globals through copyreg's registry. Neither is written by asyncstore.
        raise self._refuse("the pickle uses an opcode of protocols 0-1 or a copyreg extension")

    _dispatch[pickle.INST[0]] = _old_opcode
    _dispatch[pickle.OBJ[0]] = _old_opcode
    _dispatch[pickle.EXT1[0]] = _old_opcode
    _dispatch[pickle.EXT2[0]] = _old_opcode
    _dispatch[pickle.EXT4[0]] = _old_opcode

    # -- the opcodes that set state or insert --------------------------------------------

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) in self._trusted:
            self.append(state)
            _PyUnpickler.load_build(self)
        elif (
            type(inst) is collections.OrderedDict
            and type(state) is dict
            and all(type(k) is str and not k.startswith("__") for k in state)
        ):
            # A module's state_dict() carries its version numbers in ``_metadata``.
            inst.__dict__.update(state)
        else:
            # Tensor.__setstate__ would set backward hooks or call set_ on any storage.
            raise self._refuse(f"the pickle sets the state of a {type(inst).__name__}")

    _dispatch[pickle.BUILD[0]] = load_build

    def _into(self, kinds: tuple[type, ...]) -> Any:
        # Only containers take items: a tensor or storage would take them as writes.
        target = self.stack[-1]
        if type(target) not in kinds and type(target) not in self._trusted:
            raise self._refuse(f"the pickle inserts items into a {type(target).__name__}")
        return target

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._checks.key(key)
        self._into((dict, collections.OrderedDict))[key] = value

    _dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._into((dict, collections.OrderedDict))
        if len(items) % 2:
            raise self._refuse("the pickle sets a key without a value")
        for i in range(0, len(items), 2):
            self._checks.key(items[i])
            target[items[i]] = items[i + 1]

    _dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise self._refuse("the pickle sets a key without a value")
        for key in items[::2]:
            self._checks.key(key)
        self.append(dict(zip(items[::2], items[1::2], strict=True)))

    _dispatch[pickle.DICT[0]] = load_dict

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._into((set,))
        for item in items:
            self._checks.key(item)
            target.add(item)

    _dispatch[pickle.ADDITEMS[0]] = load_additems

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        for item in items:
            self._checks.key(item)
        self.append(frozenset(items))

    _dispatch[pickle.FROZENSET[0]] = load_frozenset

    def load_append(self) -> None:
        value = self.stack.pop()
        self._into((list,)).append(value)

    _dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self) -> None:
        items = self.pop_mark()
        target = self._into((list,))
        if type(target) is list:
            target.extend(items)
        else:
            for item in items:
                target.append(item)

    _dispatch[pickle.APPENDS[0]] = load_appends


class PlainUnpickler(pickle.Unpickler):
    """Unpickles anything (``weights_only=False``): only for checkpoints you trust."""

    def __init__(
        self, file: io.BytesIO, persistent_load: Callable[[Any], Any], **unpickler_args: Any
    ) -> None:
        super().__init__(file, **unpickler_args)
        self._persistent = persistent_load

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid)


def allow_list(safe_globals: Any) -> list[Any]:
    """``safe_globals`` checked, with torch's own allow-list (``add_safe_globals``, the
    ``safe_globals()`` context) added: classes and functions, or torch's
    ``(value, "module.name")`` pairs.

    Raises:
        InvalidArgument: naming an item that is neither.
    """
    if isinstance(safe_globals, str) or not isinstance(safe_globals, Iterable):
        raise InvalidArgument(
            f"safe_globals={safe_globals!r}: pass a list of classes or functions, such as "
            "[collections.OrderedDict]"
        )
    items = [*safe_globals, *torch.serialization.get_safe_globals()]
    for item in items:
        if isinstance(item, tuple):
            ok = len(item) == 2 and isinstance(item[1], str)
        else:
            ok = isinstance(getattr(item, "__module__", None), str) and isinstance(
                getattr(item, "__qualname__", None), str
            )
        if not ok:
            raise InvalidArgument(
                f"safe_globals item {item!r}: pass classes or functions, or (value, "
                "'module.name') pairs as torch.serialization.add_safe_globals takes them"
            )
    return items


def custom_unpickler(
    module: Any,
    file: io.BytesIO,
    persistent_load: Callable[[Any], Any],
    unpickler_args: Mapping[str, Any],
) -> Any:
    """An unpickler of ``module`` (the caller's ``pickle_module``, ``weights_only=False``)
    reading ``file``, handing each persistent id to ``persistent_load``, as ``torch.load``
    builds one."""
    unpickler = module.Unpickler(file, **unpickler_args)
    unpickler.persistent_load = persistent_load
    return unpickler
