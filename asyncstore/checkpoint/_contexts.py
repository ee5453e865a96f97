"""torch's serialization contexts, carried from the caller's thread to the threads that
save and load.

``torch.serialization.skip_data()`` and ``FakeTensorMode`` are per thread: torch keeps the
first in ``torch.serialization._serialization_tls`` and the second on the thread's dispatch
mode stack. asyncstore saves and loads on its own threads (the background event loop of the
sync functions, and worker threads for pickling and unpickling), which would never see
them. So the caller's contexts are read once, on the caller's thread, as a
:class:`TorchContexts`:

- the sync drop-ins (``asyncstore.torch.save``/``load``) read them before handing over to
  the background loop, and carry them there (:func:`carrying`);
- the async functions read them when called, on the caller's event-loop thread
  (:func:`current`: what was carried, else that thread's own).

The work then decides from them (a storage saved as zeros, a storage not read), or
re-enters them around torch's own code on the thread that runs it (:func:`entered`), so
that ``Tensor.__reduce_ex__`` and ``torch.load`` behave as on the caller's thread.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch._guards
import torch.serialization

__all__ = ["NONE", "TorchContexts", "capture", "carrying", "current", "entered"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TorchContexts:
    """What the caller's thread had in effect when it called save or load.

    ``skip_data``: inside ``torch.serialization.skip_data()`` (a save writes every
    storage's place but not its bytes, a load allocates storages without reading them);
    ``materialize_fake``: its ``materialize_fake_tensors=True`` (FakeTensors are saved as
    real tensors of zeros); ``fake_mode``: the ``FakeTensorMode`` in effect, if any (a load
    builds fake tensors and reads no tensor bytes).
    """

    skip_data: bool = False
    materialize_fake: bool = False
    fake_mode: Any = None

    @property
    def reads_data(self) -> bool:
        """Whether a load under these contexts reads tensor bytes at all."""
        return not self.skip_data and self.fake_mode is None

    def describe(self) -> str:
        """The context that stops a load from reading tensor bytes, for messages."""
        if self.fake_mode is not None:
            return "FakeTensorMode"
        return "torch.serialization.skip_data()"


NONE = TorchContexts()

# Set by the sync drop-ins on the background loop, for the task that runs the call.
_CARRIED: contextvars.ContextVar[TorchContexts | None] = contextvars.ContextVar(
    "asyncstore_torch_contexts", default=None
)


def capture() -> TorchContexts:
    """The contexts in effect on the calling thread."""
    tls = torch.serialization._serialization_tls
    skip = bool(tls.skip_data)
    materialize = skip and bool(tls.materialize_fake_tensors)
    fake = torch._guards.detect_fake_mode(None)
    if not skip and fake is None:
        return NONE
    return TorchContexts(skip, materialize, fake)


def current() -> TorchContexts:
    """The contexts of this call: those a sync drop-in carried here from its caller's
    thread, else those of the calling thread."""
    carried = _CARRIED.get()
    return capture() if carried is None else carried


async def carrying(contexts: TorchContexts, work: Awaitable[T]) -> T:
    """Await ``work`` with ``contexts`` as its :func:`current` ones (and those of the
    tasks it starts)."""
    token = _CARRIED.set(contexts)
    try:
        return await work
    finally:
        _CARRIED.reset(token)


_KEEP: Any = object()


@contextlib.contextmanager
def entered(contexts: TorchContexts, map_location: Any = _KEEP) -> Iterator[None]:
    """Put ``contexts`` in effect on this thread for the block (and ``map_location`` as
    torch's rebuild functions read it, as ``torch.load`` sets it while unpickling); the
    thread's own state comes back after it. Only for synchronous code: a coroutine that
    awaits inside would lend them to whatever else the event loop runs meanwhile."""
    tls = torch.serialization._serialization_tls
    saved = (tls.skip_data, tls.materialize_fake_tensors, tls.map_location)
    tls.skip_data = contexts.skip_data
    tls.materialize_fake_tensors = contexts.materialize_fake
    if map_location is not _KEEP:
        tls.map_location = map_location
    try:
        mode = contexts.fake_mode
        if mode is not None and torch._guards.detect_fake_mode(None) is not mode:
            with mode:
                yield
        else:
            yield
    finally:
        tls.skip_data, tls.materialize_fake_tensors, tls.map_location = saved
