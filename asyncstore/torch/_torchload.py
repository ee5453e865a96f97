"""``load``: the ``torch.load`` replacement over the checkpoint engine, for sync code."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any, TypedDict, Unpack

import torch
import torch.utils.serialization

from .._loop import run_sync
from ..checkpoint import load as _load
from ..checkpoint.engine import LoadOptions, capture, carrying
from ..errors import InvalidArgument

__all__ = ["load", "TorchLoadOptions"]

_TRUE = ("1", "y", "yes", "true")


class TorchLoadOptions(TypedDict, total=False):
    """The keyword options of :func:`load` beyond ``torch.load``'s named ones: asyncstore's
    (:func:`asyncstore.load`'s) and the unpickler's (``encoding``, ``errors``,
    ``fix_imports``), for static checks of a caller's keywords."""

    keys: Iterable[str] | None
    into: dict[str, Any] | None
    safe_globals: Iterable[Any]
    store_options: dict[str, Any] | None
    encoding: str
    errors: str
    fix_imports: bool


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
                "forcing weights_only=False (as torch.load does); pass weights_only=True to "
                "keep the safe load",
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
    **options: Unpack[TorchLoadOptions],
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

    The calling thread's ``torch.serialization.skip_data()`` and ``FakeTensorMode`` are
    honoured as ``torch.load`` honours them: no tensor byte is read (storages of zeros, or
    fake tensors that allocate nothing). Mapped with ``MAP_SHARED``
    (``torch.serialization.set_default_mmap_options``), storages are not verified: the
    file is theirs to change.
    """
    given: dict[str, Any] = dict(options)
    ours = {k: v for k, v in given.items() if k in LoadOptions.__optional_keys__}
    unpickler_args = {k: v for k, v in given.items() if k not in ours}
    if mmap is None:
        mmap = bool(torch.utils.serialization.config.load.mmap)
    chosen = _weights_only(weights_only, pickle_module)
    # torch's contexts (skip_data(), FakeTensorMode) are per thread: read here, honoured
    # on the threads that load.
    contexts = capture()
    return run_sync(
        carrying(
            contexts,
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
            ),
        )
    )
