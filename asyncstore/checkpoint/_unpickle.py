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

import collections
import io
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import UnsafeCheckpoint
from ._bounded import BOUNDED, BoundedUnpickler, PlainUnpickler, allow_list, custom_unpickler
from ._rebuilds import (
    MAX_DIMS,
    MAX_KEY_DEPTH,
    NEW_OK,
    REBUILDS,
    Checks,
    allowed_globals,
    check_attributes,
    check_view,
    refusal,
    short,
    unsupported_global,
)

__all__ = [
    "MAX_DIMS",
    "MAX_KEY_DEPTH",
    "BoundedUnpickler",
    "PlainUnpickler",
    "RestrictedUnpickler",
    "allow_list",
    "check_view",
    "custom_unpickler",
]

# The restricted unpickler's opcode table: the bounded one's, with the opcodes that call,
# set state or insert replaced by the checked versions below. Every other opcode pushes a
# constant, builds a tuple or list from what is already on the stack, or uses the memo.
_dispatch: dict[int, Callable[..., None]] = dict(BOUNDED)


class _TypeRef:
    """``torch.Tensor`` as a pickle names it: only an argument of a checked rebuild, never
    called (``torch.Tensor(2**40)`` would allocate that much)."""

    def __call__(self, *args: Any) -> Any:
        raise refusal("a checkpoint", "the pickle calls torch.Tensor")


_TENSOR_TYPE = _TypeRef()


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
        self._checks = Checks(where, self._pickle_bytes)
        self._trusted: set[type] = set()
        self._allowed = allowed_globals(self._checks, self._trusted)
        self._by_path: dict[str, Any] = {}  # torch's (value, "module.name") entries
        for item in safe_globals:
            if isinstance(item, tuple):
                value, path = item
                self._by_path[path] = value
            else:
                value = item
                # A checked constructor stays checked when the caller allows its class.
                self._allowed.setdefault((value.__module__, value.__qualname__), value)
            if isinstance(value, type):
                self._trusted.add(value)
        self._persistent = persistent_load
        self._rebuilds = {self._allowed[key] for key in REBUILDS}
        # A tensor with Python attributes, or of a subclass the caller allowed.
        self._allowed["torch._tensor", "_rebuild_from_type_v2"] = self._rebuild_from_type
        self._allowed["torch._tensor", "Tensor"] = _TENSOR_TYPE
        self._allowed["torch", "Tensor"] = _TENSOR_TYPE
        values = [*self._allowed.values(), *self._by_path.values()]
        try:
            self._callables: set[Any] | list[Any] = set(values)
        except TypeError:  # a caller's unhashable value: compared one by one
            self._callables = values

    def persistent_load(self, pid: Any) -> Any:
        return self._persistent(pid)

    def _rebuild_from_type(self, func: Any, new_type: Any, args: Any, state: Any) -> Any:
        # torch._tensor._rebuild_from_type_v2, checked: the tensor comes from one of the
        # checked rebuilds; its type is Tensor, Parameter or a Tensor subclass the caller
        # allowed; and attributes set on a plain Tensor or Parameter are new names holding
        # plain values, never ones the class defines (data, grad, __class__ ...).
        if func not in self._rebuilds:
            raise self._refuse(f"a tensor is rebuilt by {short.repr(func)}")
        if new_type is _TENSOR_TYPE:
            new_type = torch.Tensor
        plain = new_type in (torch.Tensor, torch.nn.Parameter)
        if not plain and not (
            isinstance(new_type, type)
            and issubclass(new_type, torch.Tensor)
            and new_type in self._trusted
        ):
            raise self._refuse(
                f"a tensor is rebuilt as {short.repr(new_type)}, a type not allowed (allow "
                "a tensor subclass with safe_globals)"
            )
        if type(args) is not tuple:
            raise self._refuse(f"a tensor is rebuilt from a {type(args).__name__}")
        if plain:
            check_attributes(state, new_type, self._refuse)
        return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)  # type: ignore[no-untyped-call]

    def find_class(self, module: str, name: str) -> Any:
        if module.partition(".")[0] in BLOCKED_MODULES:
            # As torch: never, whatever the caller allowed.
            raise unsupported_global(self._where, module, name, blocked=True)
        value = self._allowed.get((module, name), self._by_path.get(f"{module}.{name}"))
        if value is None:
            raise unsupported_global(self._where, module, name, blocked=False)
        return value

    def _refuse(self, what: str) -> UnsafeCheckpoint:
        return refusal(self._where, what)

    # -- the opcodes that call something ---------------------------------------------------

    def load_reduce(self) -> None:
        args = self.stack.pop()
        if type(args) is not tuple:  # f(*range(2**40)) would build that tuple first
            raise self._refuse(f"a call takes its arguments from a {type(args).__name__}")
        func = self.stack[-1]
        if not self._may_call(func):
            # Only what a GLOBAL may name is called, not what a call returned (an allowed
            # getattr would otherwise reach any attribute of an allowed class).
            owner = getattr(func, "__self__", None)
            raise self._refuse(
                f"Trying to call reduce for unrecognized function {short.repr(func)}"
                + (f" which belongs to {short.repr(owner)}" if owner is not None else "")
            )
        self.stack[-1] = func(*args)

    def _may_call(self, func: Any) -> bool:
        try:
            return func in self._callables
        except TypeError:  # func is unhashable
            return any(func == value for value in self._callables)

    _dispatch[pickle.REDUCE[0]] = load_reduce

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        # The checked callables are functions, so they fail here: only classes that build
        # nothing large from their arguments, or that the caller trusts, are built.
        if not isinstance(cls, type) or (cls not in NEW_OK and cls not in self._trusted):
            raise self._refuse(f"{short.repr(cls)} is built without a call")
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
            super().load_build()  # pickle's own: __setstate__, or the __dict__ update
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
