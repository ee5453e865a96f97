"""The unpicklers every load starts from: :class:`BoundedUnpickler` (pickle's pure-Python one,
every length checked against the pickle's size), :class:`PlainUnpickler`
(``weights_only=False``) and a caller's ``pickle_module``; and the check of ``safe_globals``.

The restricted unpickler of ``weights_only=True`` builds on :class:`BoundedUnpickler`
(``_unpickle.py``)."""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import IntegrityError, InvalidArgument

__all__ = ["BoundedUnpickler", "PlainUnpickler", "allow_list", "custom_unpickler", "BOUNDED"]

_PyUnpickler: Any = pickle._Unpickler  # the pure-Python one: its opcodes can be replaced
BOUNDED: dict[int, Callable[..., None]] = dict(_PyUnpickler.dispatch)


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

    dispatch = BOUNDED

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

    BOUNDED[pickle.BYTEARRAY8[0]] = load_bytearray8


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
    items = []
    for item in [*safe_globals, *torch.serialization.get_safe_globals()]:
        path = _path_of(item)
        if path is None:
            raise InvalidArgument(
                f"safe_globals item {item!r}: pass classes or functions, or (value, "
                "'module.name') pairs as torch.serialization.add_safe_globals takes them"
            )
        items.append(item if path == "" else (item, path))
    return items


def _path_of(item: Any) -> str | None:
    # "" for a class or function named by its own __module__ and __qualname__; the dotted
    # path of a method bound to a class (``zoneinfo.ZoneInfo._unpickle``, whose C type
    # gives it no __module__), as pickle names it; None for anything else.
    if isinstance(item, tuple):
        return "" if len(item) == 2 and isinstance(item[1], str) else None
    qualname = getattr(item, "__qualname__", None)
    if not isinstance(qualname, str):
        return None
    if isinstance(getattr(item, "__module__", None), str):
        return ""
    owner = getattr(item, "__self__", None)
    if isinstance(owner, type):
        return f"{owner.__module__}.{qualname}"
    return None


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
