"""Staging: host memory a save copies tensors into, so that the caller may change them.

A :class:`StagingPool` keeps slabs of host memory from save to save under a byte budget. A
save fills a slab with *pieces* (chunks of storages, each placed at its file offset modulo
4096) and calls the filled slab a :class:`Segment`; a :class:`Copier` copies the tensors'
bytes into it. :func:`byte_view` and :func:`storage_bytes` are views of tensor memory without
a copy, which the loader uses too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._concurrency import TaskSet, after_fork_in_child, shield, to_thread
from .._config import DEFAULT_SAVE_CHUNK_BYTES, DEFAULT_STAGING_BYTES
from .._iov import ALIGN
from ..errors import InvalidArgument
from ._pickle import SavedStorage

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STAGING_BYTES",
    "Copier",
    "Piece",
    "Segment",
    "StagingPool",
    "byte_view",
    "staging_pool",
    "storage_bytes",
]

MiB = 1 << 20

DEFAULT_CHUNK_BYTES = DEFAULT_SAVE_CHUNK_BYTES  # the reasons: SaveConfig


class StagingPool:
    """Slabs of host memory reused from save to save, under a byte budget.

    Slabs are allocated on demand, up to ``budget`` bytes, and kept for the life of the
    process: a second save of the same state allocates nothing, whichever event loop runs
    it. Pinned (page-locked) when CUDA is available, so that device-to-host copies run
    asynchronously at full speed. Each slab starts on a 4096-byte boundary and has 4096
    bytes to spare, so that a save can place its bytes at the same offset modulo 4096 as
    they will have in the file: a local file then takes them straight from the slab
    (``O_DIRECT``), without a copy.
    """

    def __init__(self, slab_bytes: int, pinned: bool) -> None:
        self.slab_bytes = slab_bytes
        self.pinned = pinned
        self.budget = DEFAULT_STAGING_BYTES
        self.allocated = 0  # slabs in existence (free or in use)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def allocated_bytes(self) -> int:
        """Bytes of slabs in existence (free or in use)."""
        return self.allocated * self.slab_bytes

    def set_budget(self, budget: int) -> None:
        """Change the byte budget (saves running at once share the latest one)."""
        with self._lock:
            self.budget = budget

    def can_acquire(self) -> bool:
        """Whether :meth:`acquire` would return without waiting."""
        with self._lock:
            return bool(self._free) or (self.allocated + 1) * self.slab_bytes <= self.budget

    def try_acquire(self) -> torch.Tensor | None:
        """A slab already allocated and free, or ``None`` (then :meth:`acquire` one)."""
        with self._lock:
            return self._free.pop() if self._free else None

    async def acquire(self) -> torch.Tensor:
        """A free slab; waits while the budget is spent and every slab is in use."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._free:
                    return self._free.pop()
                grow = (self.allocated + 1) * self.slab_bytes <= self.budget
                if grow:
                    self.allocated += 1
                else:
                    returned: asyncio.Future[None] = loop.create_future()
                    self._waiters.append((loop, returned))
            if grow:
                return self._allocate_counted()
            try:
                await returned
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove((loop, returned))

    def _allocate_counted(self) -> torch.Tensor:
        # The slab was counted in self.allocated before the allocation: uncount it if that
        # fails, or the budget would shrink for good.
        try:
            return self._allocate()
        except BaseException:
            with self._lock:
                self.allocated -= 1
            raise

    def _allocate(self) -> torch.Tensor:
        size = self.slab_bytes + ALIGN
        if self.pinned:
            # Exactly slab_bytes: CUDA's host allocator rounds requests up to a power of two,
            # so 4 KiB to spare would pin twice the memory. Chunks then fit in what is left
            # after their offset (see SaveJob's planning of pieces).
            memory = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=True)
            skip = -memory.data_ptr() % ALIGN
            return memory[skip:]  # the view keeps the whole allocation alive
        # Page-aligned, and every page faulted in now, in one system call: touching fresh
        # pages one fault at a time costs about 0.9 s per GiB here. Saves place chunks at
        # different offsets of a slab from one save to the next, so a slab only partly
        # touched would keep faulting in later saves.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return torch.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=torch.uint8)

    def reserve(self, nbytes: int) -> None:
        """Allocate slabs for ``nbytes`` (up to the budget) now, at start-up, so that the
        first save's snapshot runs as fast as later ones instead of paying for fresh memory.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"nbytes={nbytes!r}: pass a number of bytes >= 0")
        while True:
            with self._lock:
                have = self.allocated * self.slab_bytes
                if have >= nbytes or (self.allocated + 1) * self.slab_bytes > self.budget:
                    return
                self.allocated += 1
            self.release(self._allocate_counted())

    def release(self, slab: torch.Tensor) -> None:
        """Give a slab back for the next segment or save."""
        with self._lock:
            if self.allocated_bytes > self.budget:
                self.allocated -= 1  # the budget was lowered: let this one go
            else:
                self._free.append(slab)
            waiters, self._waiters = self._waiters, []
        for loop, returned in waiters:
            # A loop closed without cancelling its tasks cannot be woken; skip it rather
            # than fail the save that is giving its slab back.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, returned)

    def trim(self) -> None:
        """Free every slab not in use (the next save allocates again)."""
        with self._lock:
            self.allocated -= len(self._free)
            self._free.clear()


def _wake(returned: asyncio.Future[None]) -> None:
    if not returned.done():
        returned.set_result(None)


_POOLS: dict[tuple[int, bool], StagingPool] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools() -> None:
    # In a forked child: a lock held by another thread of the parent would never be freed.
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


after_fork_in_child(_forget_pools)


def staging_pool(chunk_bytes: int = DEFAULT_CHUNK_BYTES, pinned: bool | None = None) -> StagingPool:
    """The process's staging pool for ``chunk_bytes`` slabs (created on first use)."""
    if pinned is None:
        pinned = torch.cuda.is_available()
    with _POOLS_LOCK:
        pool = _POOLS.get((chunk_bytes, pinned))
        if pool is None:
            pool = _POOLS[(chunk_bytes, pinned)] = StagingPool(chunk_bytes, pinned)
        return pool


def byte_view(tensor: torch.Tensor, start: int = 0, size: int | None = None) -> memoryview:
    """A writable byte view of a CPU uint8 tensor's memory, without a copy (no numpy
    needed). The caller keeps ``tensor`` alive while the view is in use."""
    size = tensor.numel() - start if size is None else size
    if size == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * size).from_address(tensor.data_ptr() + start)
    return memoryview(array).cast("B")


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a storage's bytes, on its device."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


# -- what a slab holds -------------------------------------------------------------------------


@dataclass
class Piece:
    """A chunk of a storage, placed in a slab."""

    storage: SavedStorage
    index: int  # chunk number within the storage
    start: int  # offset in the slab
    size: int
    # The bytes to copy (None: zeros, for a storage saved under skip_data()); the slab's
    # own bytes once copied.
    source: torch.Tensor | None
    # Zeros stored as a zstd frame made without the slab (see SaveJob): nothing to copy.
    framed: bool = False


@dataclass
class Segment:
    """A slab and the pieces placed in it: the unit of copying, encoding and writing."""

    slab: torch.Tensor
    base: int  # where the first piece starts in the slab (its file offset modulo ALIGN)
    pieces: list[Piece] = field(default_factory=list)
    used: int = 0  # end of the last piece in the slab
    copied: asyncio.Future[None] | None = None  # done once its CPU copies are
    ready: list[Any] = field(default_factory=list)  # CUDA events of side-stream copies


# -- copying into slabs ------------------------------------------------------------------------


class Copier:
    """Copies one snapshot's tensors into its segments' slabs.

    CPU tensors: segments are gathered by :meth:`add` while slabs come without waiting,
    then copied on two worker threads at :meth:`dispatch` (one copy thread reaches about
    2/3 of the memory bandwidth): a later save of a whole model costs two thread hops, not
    one per slab. A segment's ``copied`` future is done once its bytes are in its slab.

    CUDA tensors: device-to-host copies queued at once on one side stream per GPU, ordered
    after the work already queued there (the step that produced the tensors); the
    segment's ``ready`` events tell when they are done.

    :meth:`settle` must run however the snapshot ends: no slab may go back to the pool
    while a thread still copies into it.
    """

    def __init__(self, devices: Iterable[torch.device], tasks: TaskSet) -> None:
        self._tasks = tasks
        self._streams: dict[int, Any] = {}  # CUDA device index -> its side stream
        for device in devices:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            self._streams[device.index or 0] = stream
        self._batch: list[Segment] = []  # CPU copies not dispatched yet
        self._running: list[asyncio.Task[None]] = []

    def add(self, segment: Segment) -> None:
        """Copy ``segment``'s pieces into its slab: queued now (CUDA) or at the next
        :meth:`dispatch` (CPU)."""
        if any(piece.source is not None and piece.source.is_cuda for piece in segment.pieces):
            self._copy_cuda(segment)
        else:
            segment.copied = asyncio.get_running_loop().create_future()
            self._batch.append(segment)

    def dispatch(self) -> None:
        """Start the CPU copies gathered so far, in two groups of about equal bytes, one
        thread each."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        total = sum(seg.used - seg.base for seg in batch)
        groups: list[list[Segment]] = [[]]
        done = 0
        for seg in batch:
            if groups[-1] and len(groups) < 2 and done >= total / 2:
                groups.append([])
            groups[-1].append(seg)
            done += seg.used - seg.base
        for group in groups:
            name = f"copy {len(group)} segment(s) into staging"
            self._running.append(self._tasks.spawn(self._copy_group(group), name=name))

    async def settle(self) -> None:
        """Wait until no thread copies into a slab any more; copies never dispatched are
        cancelled."""
        for waiting in self._batch:
            assert waiting.copied is not None
            waiting.copied.cancel()
        self._batch.clear()
        # Errors are retrieved here; finish() raises the first one.
        await shield(asyncio.gather(*self._running, return_exceptions=True))

    async def drain(self) -> None:
        """Wait until every device-to-host copy queued on the side streams is done.

        For a save that ends early: its slabs go back to the pool, and another save may
        fill them; a copy still queued on a GPU would write into them afterwards.
        """
        for stream in self._streams.values():
            await to_thread(stream.synchronize)

    def finish(self) -> None:
        """After :meth:`settle`, once the snapshot is taken: raise the first copy's error,
        and order the caller's later GPU work after the side streams' copies."""
        for copy in self._running:
            copy.result()
        for index, stream in self._streams.items():
            # The caller's later kernels wait for our copies; its thread does not.
            torch.cuda.current_stream(index).wait_stream(stream)

    async def _copy_group(self, group: list[Segment]) -> None:
        try:
            await to_thread(self._copy_all, group)
        except BaseException as exc:
            for seg in group:
                assert seg.copied is not None
                if seg.copied.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    seg.copied.cancel()
                else:
                    seg.copied.set_exception(exc)
                    seg.copied.exception()  # retrieved here; the snapshot reports it
            raise
        for seg in group:
            assert seg.copied is not None
            if not seg.copied.done():
                seg.copied.set_result(None)

    @classmethod
    def _copy_all(cls, group: list[Segment]) -> None:
        for segment in group:
            cls._copy(segment)

    def _copy_cuda(self, segment: Segment) -> None:
        # Device-to-host copies into pinned slabs, queued on each GPU's side stream: this
        # thread does not wait for them; the encoder waits for their events.
        used: set[int] = set()
        for piece in segment.pieces:
            target = segment.slab[piece.start : piece.start + piece.size]
            if piece.source is None:
                if not piece.framed:
                    target.zero_()
            elif piece.source.is_cuda:
                index = piece.source.device.index or 0
                with torch.cuda.stream(self._streams[index]):
                    target.copy_(piece.source, non_blocking=True)
                used.add(index)
            else:
                target.copy_(piece.source)
            piece.source = target
        for index in used:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._streams[index])
            segment.ready.append(event)

    @staticmethod
    def _copy(segment: Segment) -> None:
        base = segment.slab.data_ptr()
        for piece in segment.pieces:
            target = segment.slab[piece.start : piece.start + piece.size]
            if piece.source is None:
                if not piece.framed:
                    ctypes.memset(base + piece.start, 0, piece.size)
            elif piece.source.device.type == "cpu":
                # A plain memmove (the GIL released): torch's copy would start a parallel
                # region of its own on each of the copy threads.
                ctypes.memmove(base + piece.start, piece.source.data_ptr(), piece.size)
            else:
                target.copy_(piece.source)
            piece.source = target  # the live tensor is no longer needed
