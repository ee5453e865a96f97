"""Loading a plain ``torch.save`` file through :func:`asyncstore.load`: torch reads it,
with the caller's ``torch.load`` options passed on as they are, and its errors come back as
torch raised them (users switch to asyncstore without converting their files)."""

from __future__ import annotations

import io
import mmap as _mmap
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._concurrency import to_thread
from .._text import plain
from ..errors import InvalidArgument, UnsafeCheckpoint
from ._contexts import NONE, TorchContexts, entered
from ._target import FileSource, Source

__all__ = ["TorchOptions", "load_torch_file"]


class TorchOptions:
    """The ``torch.load`` keywords that mean nothing to asyncstore's own checks but are
    honoured where they apply: ``pickle_module``, ``mmap`` and the unpickler's keywords
    (``encoding``, ``errors``, ``fix_imports``); and torch's contexts of the caller
    (``skip_data()``, ``FakeTensorMode``), read on its thread."""

    __slots__ = ("contexts", "mmap", "mmap_shared", "pickle_load_args", "pickle_module")

    def __init__(
        self,
        pickle_module: Any = None,
        mmap: bool = False,
        pickle_load_args: Mapping[str, Any] | None = None,
        mmap_flags: int | None = None,
        contexts: TorchContexts = NONE,
    ) -> None:
        self.contexts = contexts
        if not isinstance(mmap, bool):
            raise InvalidArgument(f"mmap={mmap!r}: pass True or False")
        if mmap_flags is None:
            # torch keeps this option per thread: read it on the caller's.
            mmap_flags = torch.serialization.get_default_mmap_options()
        if mmap_flags not in (_mmap.MAP_PRIVATE, _mmap.MAP_SHARED) or isinstance(mmap_flags, bool):
            raise InvalidArgument(
                f"mmap_flags={mmap_flags!r}: pass mmap.MAP_PRIVATE or mmap.MAP_SHARED"
            )
        self.mmap_shared = mmap_flags == _mmap.MAP_SHARED
        args = dict(pickle_load_args or {})
        unknown = sorted(set(args) - {"encoding", "errors", "fix_imports"})
        if unknown:
            raise InvalidArgument(
                f"load() got unknown option(s) {', '.join(f'{n}=' for n in unknown)}; an "
                "unpickler takes encoding=, errors= and fix_imports="
            )
        if pickle_module is not None and not isinstance(
            getattr(pickle_module, "Unpickler", None), type
        ):
            raise InvalidArgument(
                f"pickle_module={pickle_module!r} has no Unpickler class: pass a module such "
                "as pickle or dill"
            )
        self.pickle_module = pickle_module
        self.mmap = mmap
        self.pickle_load_args = args


async def load_torch_file(
    src: Source,
    map_location: Any,
    weights_only: bool,
    safe_globals: Iterable[Any],
    options: TorchOptions,
) -> Any:
    """Load the ``torch.save`` file at ``src`` with ``torch.load``.

    Raises:
        UnsafeCheckpoint: ``weights_only=True`` refuses it (also the
            ``pickle.UnpicklingError`` torch raises).
        InvalidArgument: ``mmap=True`` for a file that is not local.
        Exception: whatever ``torch.load`` raises for it, as it raised it.
    """
    allowed = list(safe_globals)
    kwargs: dict[str, Any] = dict(options.pickle_load_args)
    if options.pickle_module is not None:
        kwargs["pickle_module"] = options.pickle_module
    if options.mmap:
        kwargs["mmap"] = True
    flags = _mmap.MAP_SHARED if options.mmap_shared else _mmap.MAP_PRIVATE

    def run(file: Any) -> Any:
        # The caller's map option and contexts, on the thread torch.load runs on.
        with (
            torch.serialization.safe_globals(allowed),
            torch.serialization.set_default_mmap_options(flags),
            entered(options.contexts),
        ):
            return torch.load(file, map_location=map_location, weights_only=weights_only, **kwargs)

    try:
        if src.local_path is not None:
            return await to_thread(run, src.local_path)
        if isinstance(src, FileSource):
            src.rewind()
            return await to_thread(run, src.file)
        if options.mmap:
            raise InvalidArgument(
                f"mmap=True: {src.url} is not a local file, which a memory map needs; load "
                "it without mmap, or copy it to a local disk first"
            )
        data = await src.read(0, await src.size())
        return await to_thread(run, io.BytesIO(data))
    except pickle.UnpicklingError as exc:
        if weights_only and ("weights_only" in str(exc) or "Weights only" in str(exc)):
            raise UnsafeCheckpoint(
                f"{src.url} is a torch.save file that weights_only=True refuses: {plain(exc)}"
            ) from exc
        raise
