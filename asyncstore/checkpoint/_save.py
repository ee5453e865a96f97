"""The save pipeline: snapshot into staging, then compress, checksum and write, overlapped.

The caller waits for the snapshot only: tensor bytes copied into slabs of a reusable staging
pool (pinned host memory when CUDA is present, device-to-host copies on a side stream).
Each full slab (a *segment*: one or more chunks) then goes to a worker thread that encodes
and checksums its chunks, while a writer task streams finished segments, in order, into the
target — a store's atomic writer (local temp file + fsync + rename, or an S3 multipart
upload) or a file object. The manifest and footer are written last; closing the writer is
the commit point. A state larger than the pool streams through it: the snapshot then waits
for slabs to come back (back-pressure), so the caller waits longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import msgspec
import torch
import xxhash

from ..errors import AsyncStoreError, InvalidArgument
from ..stores import LocalStore, S3Store
from ..stores._direct import ALIGN
from . import _format as fmt
from ._pickle import SavedStorage, dtype_name, pickle_structure
from ._target import FileSink, Sink, StoreSink, resolve
from ._threads import run_thread, shielded

__all__ = ["save", "SaveHandle", "SaveResult", "StagingPool", "staging_pool"]

MiB = 1 << 20
GiB = 1 << 30

DEFAULT_CHUNK_BYTES = 32 * MiB
DEFAULT_STAGING_BYTES = 2 * GiB

# Chunks smaller than this are stored raw: compressing them saves nothing worth a codec.
_SMALL = 64 * 1024
# A storage that does not fit in what is left of a slab is cut there (its chunk ends early)
# when at least this much (or a quarter of a slab) is left; otherwise it starts a new slab.
_MIN_SPLIT = 1 * MiB
# Compressed chunks smaller than this are gathered into one write.
_SMALL_WRITE = 1 * MiB
# "auto" probes this much of a storage's first chunk.
_PROBE = 128 * 1024
# "auto" compresses a storage only if the probe shrank it to this fraction or less.
_WORTH = 0.92
# Threads encoding segments at once: also bounds compressed output held in memory.
_ENCODERS = max(1, min(4, os.cpu_count() or 1))


class SaveOptions(TypedDict, total=False):
    """The keyword options of :func:`save` (for the sync adapters that forward them)."""

    compression: Literal["auto", "zstd"] | None
    level: int
    chunk_bytes: int
    staging_bytes: int
    exclude: Iterable[str]
    metadata: dict[str, Any] | None
    store_options: dict[str, Any] | None
    priority: Literal["low", "normal"]


class SaveResult(msgspec.Struct, frozen=True):
    """What a finished save did.

    Attributes:
        url: where the checkpoint was written.
        raw_bytes: tensor bytes plus the pickled structure, before compression.
        stored_bytes: bytes written, manifest and footer included.
        storages: tensor storages saved.
        chunks: chunks written.
        compressed_storages: storages stored compressed.
        snapshot_seconds: how long the caller waited (the snapshot).
        total_seconds: from the call to the commit.
        direct_bytes: bytes a local file took straight from the staging memory, around the
            page cache (``O_DIRECT``); 0 for other targets, or a file system without it.
        digest: the whole-checkpoint digest (hex xxh3-64 over every chunk's digest).
    """

    url: str
    raw_bytes: int
    stored_bytes: int
    storages: int
    chunks: int
    compressed_storages: int
    snapshot_seconds: float
    total_seconds: float
    digest: str
    direct_bytes: int = 0


class SaveHandle:
    """A save in progress: returned once the snapshot is taken.

    ``await handle`` (or :meth:`wait`) gives the :class:`SaveResult` or raises the save's
    error; :meth:`done` tells whether it finished; :meth:`result` gives the outcome of a
    finished save.
    """

    def __init__(self, task: asyncio.Task[SaveResult], url: str) -> None:
        self._task = task
        self.url = url

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "writing"
        return f"<SaveHandle {self.url} {state}>"

    def __await__(self) -> Any:
        return self.wait().__await__()

    async def wait(self) -> SaveResult:
        """Wait for the save to commit; the result, or the save's error."""
        return await asyncio.shield(self._task)

    def done(self) -> bool:
        """Whether the save finished (committed or failed)."""
        return self._task.done()

    def result(self) -> SaveResult:
        """The result of a finished save, or its error.

        Raises:
            AsyncStoreError: the save is still writing (await the handle instead).
        """
        if not self._task.done():
            raise AsyncStoreError(f"the save to {self.url} is still writing; await the handle")
        return self._task.result()

    def cancel(self) -> None:
        """Abandon the save: nothing is committed, the previous checkpoint stays."""
        self._task.cancel()


# -- staging ---------------------------------------------------------------------------------


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
                try:
                    return self._allocate()
                except BaseException:
                    with self._lock:
                        self.allocated -= 1
                    raise
            try:
                await returned
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove((loop, returned))

    def _allocate(self) -> torch.Tensor:
        size = self.slab_bytes + ALIGN
        if self.pinned:
            # Exactly slab_bytes: CUDA's host allocator rounds requests up to a power of two,
            # so 4 KiB to spare would pin twice the memory. Chunks then fit in what is left
            # after their offset (see _SaveJob._place).
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
            try:
                slab = self._allocate()
            except BaseException:
                with self._lock:
                    self.allocated -= 1
                raise
            self.release(slab)

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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def staging_pool(chunk_bytes: int = DEFAULT_CHUNK_BYTES, pinned: bool | None = None) -> StagingPool:
    """The process's staging pool for ``chunk_bytes`` slabs (created on first use)."""
    if pinned is None:
        pinned = torch.cuda.is_available()
    with _POOLS_LOCK:
        pool = _POOLS.get((chunk_bytes, pinned))
        if pool is None:
            pool = _POOLS[(chunk_bytes, pinned)] = StagingPool(chunk_bytes, pinned)
        return pool


def _view(tensor: torch.Tensor, start: int = 0, size: int | None = None) -> memoryview:
    # A writable byte view of a CPU uint8 tensor's memory, without a copy (no numpy needed).
    size = tensor.numel() - start if size is None else size
    if size == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * size).from_address(tensor.data_ptr() + start)
    return memoryview(array).cast("B")


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    # A flat uint8 tensor over a storage's bytes, on its device.
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


# -- one save --------------------------------------------------------------------------------


@dataclass
class _Piece:
    storage: SavedStorage
    index: int  # chunk number within the storage
    start: int  # offset in the slab
    size: int
    source: torch.Tensor  # the storage's bytes to copy


@dataclass
class _Segment:
    slab: torch.Tensor
    base: int  # where the first piece starts in the slab (its file offset modulo ALIGN)
    pieces: list[_Piece] = field(default_factory=list)
    used: int = 0  # end of the last piece in the slab
    copied: asyncio.Future[None] | None = None  # done once its CPU copies are
    ready: list[Any] = field(default_factory=list)  # CUDA events of side-stream copies


@dataclass
class _Encoded:
    piece: _Piece
    codec: str
    stored: memoryview | bytes
    stored_xxh3: int
    raw_xxh3: int


_BANDWIDTH: dict[str, float] = {}  # bytes/s seen per sink root, for "auto"


class _Decisions:
    """Per storage, whether "auto" compresses it: decided by a probe of its first chunk."""

    def __init__(self, compression: str | None, level: int, exclude: tuple[str, ...]) -> None:
        self.compression, self.level, self.exclude = compression, level, exclude
        self._codecs: dict[int, str] = {}
        self._warm: set[str] = set()  # codecs probed once already in this save
        self.bandwidth: float | None = None

    def codec_for(self, piece: _Piece, data: memoryview) -> str:
        storage = piece.storage
        if self.compression is None or piece.size < _SMALL:
            return "raw"
        if any(fnmatch.fnmatchcase(storage.name, pattern) for pattern in self.exclude):
            return "raw"
        width = storage.dtype.itemsize
        codec = f"zstd+shuffle{width}" if width in (2, 4) else "zstd"
        if self.compression == "zstd":
            return codec
        known = self._codecs.get(storage.id)
        if known is not None:
            return known
        # "auto": probe the first chunk we meet of this storage.
        sample = data[: min(len(data), _PROBE)]
        # CPU time of this thread, not wall time: the question is how fast a core encodes,
        # and a busy machine (a training step, another save) would otherwise make zstd look
        # slow and flip the decision from run to run.
        # The first probe of a codec in a save runs twice, timing the faster run: a cold
        # thread's first compression (context set-up, first-touch page faults) can take
        # 2-3x as long as the next and would keep everything raw.
        speed = 0.0
        for _ in range(1 if codec in self._warm else 2):
            started = time.thread_time()
            ratio = len(fmt.compress(sample, codec, self.level)) / len(sample)
            speed = max(speed, len(sample) / max(time.thread_time() - started, 1e-6))
        self._warm.add(codec)
        keeps_up = self.bandwidth is None or speed * _ENCODERS >= 1.1 * self.bandwidth
        decision = codec if ratio <= _WORTH and keeps_up else "raw"
        self._codecs[storage.id] = decision
        return decision


class _SaveJob:
    def __init__(
        self,
        sink: Sink,
        structure: bytes,
        storages: list[SavedStorage],
        entries: dict[str, list[int]] | None,
        metadata: dict[str, Any],
        pool: StagingPool,
        decisions: _Decisions,
        bandwidth_key: str,
        background: bool = True,
    ) -> None:
        self.sink = sink
        self.structure = structure
        self.storages = storages
        self.entries = entries
        self.metadata = metadata
        self.pool = pool
        self.decisions = decisions
        self.bandwidth_key = bandwidth_key
        self.background = background  # encode on low-priority threads
        self.queue: asyncio.Queue[asyncio.Future[tuple[_Segment, list[_Encoded]]] | None] = (
            asyncio.Queue()
        )
        self.encoders = asyncio.Semaphore(_ENCODERS)
        # Copies of CPU tensors into slabs are gathered while slabs come without waiting,
        # then run on two worker threads (one copy thread reaches about 2/3 of the memory
        # bandwidth): a later save of a whole model costs two thread hops, not one per slab.
        self.batch: list[_Segment] = []
        self.copies: list[asyncio.Future[None]] = []
        # The pickled structure, stored as it will be (compressed if that pays), so that the
        # snapshot knows where in the file each chunk lands while every chunk stays raw.
        digest = xxhash.xxh3_64_intdigest(structure)
        codec, stored = "raw", memoryview(structure)
        if decisions.compression is not None and len(structure) >= _SMALL:
            compressed = fmt.compress(stored, "zstd", decisions.level)
            if len(compressed) < len(structure):
                codec, stored = "zstd", memoryview(compressed)
        stored_digest = digest if codec == "raw" else xxhash.xxh3_64_intdigest(stored)
        self.structure_stored = stored
        self.structure_chunk = fmt.Chunk(
            len(fmt.MAGIC), len(stored), len(structure), codec, stored_digest, digest
        )
        # Where the next chunk will start in the file if every chunk before it stays raw.
        self.predicted = len(fmt.MAGIC) + len(stored)
        self.started = False  # the writer task began (its cleanup will run)
        self.failed = False  # the save failed (set before its cleanup first waits)
        self.snapshot_done = False
        self.chunks: dict[int, list[fmt.Chunk]] = {s.id: [] for s in storages}
        self.held: dict[int, torch.Tensor] = {}  # slabs out of the pool, by id
        self.tasks: list[asyncio.Future[tuple[_Segment, list[_Encoded]]]] = []
        self.writer: asyncio.Future[SaveResult] | None = None
        self.gate = asyncio.Event()  # set: encoders may run
        self.streams: dict[int, Any] = {}  # CUDA device index -> its side stream
        self.write_seconds = 0.0
        self.written = 0  # bytes handed to the sink
        self.position = 0  # bytes laid out in the checkpoint (ahead of written while gathering)
        self.snapshot_seconds = 0.0

    # -- snapshot (the caller waits for this) -------------------------------------------------

    async def snapshot(self) -> None:
        started = time.perf_counter()
        chunk = self.pool.slab_bytes
        for device in {s.storage.device for s in self.storages if s.storage.device.type == "cuda"}:
            # One side stream per GPU, ordered after the work already queued there (the
            # step that produced these tensors).
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            self.streams[device.index or 0] = stream
        segment: _Segment | None = None
        try:
            for saved in self.storages:
                source = _bytes_of(saved.storage)
                index = start = 0
                while start < saved.nbytes:
                    size = min(chunk, saved.nbytes - start)
                    room = 0 if segment is None else self._room(segment)
                    if size > room:
                        if room >= min(_MIN_SPLIT, chunk // 4):
                            size = room  # fill the slab: this chunk ends where it does
                        else:
                            if segment is not None:
                                await self._submit(segment)
                            segment = await self._segment()
                            # A pinned slab has nothing to spare beyond chunk_bytes: after
                            # its base, a full chunk may have to end early.
                            size = min(size, self._room(segment))
                    assert segment is not None
                    at = segment.used
                    segment.pieces.append(
                        _Piece(saved, index, at, size, source[start : start + size])
                    )
                    segment.used += size
                    self.predicted += size
                    start += size
                    index += 1
            if segment is not None:
                await self._submit(segment)
            self._dispatch()
        finally:
            for waiting in self.batch:  # never dispatched: the snapshot failed first
                assert waiting.copied is not None
                waiting.copied.cancel()
            self.batch.clear()
            # No slab may go back while a thread still copies into it.
            await shielded(asyncio.gather(*self.copies, return_exceptions=True))
        for copy in self.copies:
            copy.result()  # a failed copy fails the snapshot
        for index, stream in self.streams.items():
            # The caller's later kernels wait for our copies; its thread does not.
            torch.cuda.current_stream(index).wait_stream(stream)
        self.snapshot_seconds = time.perf_counter() - started
        self.snapshot_done = True
        if self.failed:
            # The writer failed while the snapshot was finishing: its cleanup left the slabs
            # (and the segments submitted since) to the snapshot; nobody will write them.
            await shielded(self._abandon())
        self.gate.set()
        await self.queue.put(None)

    def _room(self, segment: _Segment) -> int:
        # Bytes the segment can still take: chunk_bytes from its base, within its slab.
        chunk = self.pool.slab_bytes
        return min(chunk - (segment.used - segment.base), len(segment.slab) - segment.used)

    async def _segment(self) -> _Segment:
        if self.writer is None or not self.writer.done():
            slab = self.pool.try_acquire()
            if slab is not None:  # the usual case on later saves: no waiting, no task
                return self._new_segment(slab)
        self._dispatch()  # about to wait: copy what is planned meanwhile
        if not self.pool.can_acquire():
            self.gate.set()  # slabs come back only once written: start the pipeline now
        # Wait for a slab, unless the writer fails meanwhile (then no slab comes back).
        acquire = asyncio.ensure_future(self.pool.acquire())
        waiting: set[asyncio.Future[Any]] = {acquire}
        if self.writer is not None:
            waiting.add(self.writer)
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled while waiting: a slab that arrived meanwhile must go back.
            if not acquire.done():
                acquire.cancel()
                await asyncio.gather(acquire, return_exceptions=True)
            if not acquire.cancelled() and acquire.exception() is None:
                self.pool.release(acquire.result())
            raise
        if not acquire.done():
            acquire.cancel()
            await asyncio.gather(acquire, return_exceptions=True)
        if not acquire.cancelled() and acquire.exception() is None:
            slab = acquire.result()
            if self.writer is None or not self.writer.done():
                return self._new_segment(slab)
            self.pool.release(slab)  # the writer failed: nobody will write this one
        assert self.writer is not None
        assert self.writer.done()
        self.writer.result()  # raises the writer's error
        raise AsyncStoreError(f"the save to {self.sink.url} stopped writing")

    def _new_segment(self, slab: torch.Tensor) -> _Segment:
        self.held[id(slab)] = slab
        base = self.predicted % ALIGN
        return _Segment(slab, base, used=base)

    def release(self, slab: torch.Tensor) -> None:
        if self.held.pop(id(slab), None) is not None:
            self.pool.release(slab)

    async def _abandon(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.release_all()

    def release_all(self) -> None:
        for slab in list(self.held.values()):
            self.release(slab)

    async def _submit(self, segment: _Segment) -> None:
        if any(piece.source.is_cuda for piece in segment.pieces):
            self._copy_cuda(segment)
        else:
            segment.copied = asyncio.get_running_loop().create_future()
            self.batch.append(segment)  # copied at the next _dispatch()
        task = asyncio.ensure_future(self._encode(segment, segment.copied))
        self.tasks.append(task)
        await self.queue.put(task)

    def _dispatch(self) -> None:
        # The planned CPU copies, in two groups of about equal bytes, one thread each.
        if not self.batch:
            return
        batch, self.batch = self.batch, []
        total = sum(seg.used - seg.base for seg in batch)
        groups: list[list[_Segment]] = [[]]
        done = 0
        for seg in batch:
            if groups[-1] and len(groups) < 2 and done >= total / 2:
                groups.append([])
            groups[-1].append(seg)
            done += seg.used - seg.base
        for group in groups:
            self.copies.append(asyncio.ensure_future(self._copy_group(group)))

    async def _copy_group(self, group: list[_Segment]) -> None:
        try:
            await run_thread(self._copy_all, group)
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
    def _copy_all(cls, group: list[_Segment]) -> None:
        for segment in group:
            cls._copy(segment)

    def _copy_cuda(self, segment: _Segment) -> None:
        # Device-to-host copies into pinned slabs, queued on each GPU's side stream: this
        # thread does not wait for them; the encoder waits for their events.
        used: set[int] = set()
        for piece in segment.pieces:
            target = segment.slab[piece.start : piece.start + piece.size]
            if piece.source.is_cuda:
                index = piece.source.device.index or 0
                with torch.cuda.stream(self.streams[index]):
                    target.copy_(piece.source, non_blocking=True)
                used.add(index)
            else:
                target.copy_(piece.source)
            piece.source = target
        for index in used:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.streams[index])
            segment.ready.append(event)

    @staticmethod
    def _copy(segment: _Segment) -> None:
        base = segment.slab.data_ptr()
        for piece in segment.pieces:
            target = segment.slab[piece.start : piece.start + piece.size]
            if piece.source.device.type == "cpu":
                # A plain memmove (the GIL released): torch's copy would start a parallel
                # region of its own on each of the copy threads.
                ctypes.memmove(base + piece.start, piece.source.data_ptr(), piece.size)
            else:
                target.copy_(piece.source)
            piece.source = target  # the live tensor is no longer needed

    # -- encode (worker threads) ---------------------------------------------------------------

    async def _encode(
        self, segment: _Segment, copied: asyncio.Future[None] | None
    ) -> tuple[_Segment, list[_Encoded]]:
        # The caller is waiting for the snapshot: encoding and writing start when it is
        # taken (so that the copies have the CPU and memory bandwidth to themselves), or
        # as soon as the pool runs dry and slabs must be written to come back.
        await self.gate.wait()
        if copied is not None:
            await asyncio.shield(copied)
        # While the snapshot is still waiting for slabs (a state larger than the pool),
        # the caller waits for this encoding too: it runs at normal priority then.
        background = self.background and self.snapshot_done
        encoded = await run_thread(
            self._encode_sync, segment, limiter=self.encoders, background=background
        )
        return segment, encoded

    def _encode_sync(self, segment: _Segment) -> list[_Encoded]:
        for event in segment.ready:
            event.synchronize()
        out = []
        for piece in segment.pieces:
            raw = _view(segment.slab, piece.start, piece.size)
            codec = self.decisions.codec_for(piece, raw)
            raw_xxh3 = xxhash.xxh3_64_intdigest(raw)
            if codec == "raw":
                out.append(_Encoded(piece, codec, raw, raw_xxh3, raw_xxh3))
                continue
            stored = fmt.compress(raw, codec, self.decisions.level)
            if len(stored) >= piece.size:
                out.append(_Encoded(piece, "raw", raw, raw_xxh3, raw_xxh3))
            else:
                out.append(
                    _Encoded(piece, codec, stored, xxhash.xxh3_64_intdigest(stored), raw_xxh3)
                )
        return out

    # -- write (in order) ----------------------------------------------------------------------

    async def _put(self, data: memoryview | bytes | bytearray) -> None:
        started = time.perf_counter()
        await self.sink.write(data)
        self.write_seconds += time.perf_counter() - started
        self.written += len(data)

    async def _write(self, data: memoryview | bytes) -> int:
        # Header, structure, manifest, footer: written as they come; returns the offset.
        offset = self.position
        self.position += len(data)
        await self._put(data)
        return offset

    async def _write_segment(self, segment: _Segment, encoded: list[_Encoded]) -> None:
        # Few large writes, not one per chunk (a model has hundreds of small tensors, and a
        # write can cost a thread hop): raw chunks lie one after another in the slab, so a
        # run of them goes out as one view of it; small compressed ones are gathered.
        run: tuple[int, int] | None = None  # [start, end) in the slab
        small = bytearray()
        for item in encoded:
            self.chunks[item.piece.storage.id].append(
                fmt.Chunk(
                    self.position,
                    len(item.stored),
                    item.piece.size,
                    item.codec,
                    item.stored_xxh3,
                    item.raw_xxh3,
                )
            )
            self.position += len(item.stored)
            if item.codec == "raw":
                if small:
                    await self._put(small)
                    small = bytearray()
                start, end = item.piece.start, item.piece.start + item.piece.size
                if run is not None and run[1] == start:
                    run = (run[0], end)
                    continue
                if run is not None:
                    await self._put(_view(segment.slab, run[0], run[1] - run[0]))
                run = (start, end)
                continue
            if run is not None:
                await self._put(_view(segment.slab, run[0], run[1] - run[0]))
                run = None
            if len(item.stored) >= _SMALL_WRITE:
                if small:
                    await self._put(small)
                    small = bytearray()
                await self._put(item.stored)
            else:
                small += item.stored
        if run is not None:
            await self._put(_view(segment.slab, run[0], run[1] - run[0]))
        if small:
            await self._put(small)

    async def write_all(self, started: float) -> SaveResult:
        await self._write(fmt.MAGIC)  # the header: what the object is, from its first bytes
        offset = await self._write(self.structure_stored)
        assert offset == self.structure_chunk.offset
        while True:
            task = await self.queue.get()
            if task is None:
                break
            segment, encoded = await task
            await self._write_segment(segment, encoded)
            del encoded  # views of the slab: gone before it is reused
            self.release(segment.slab)
        raw_bytes = len(self.structure) + sum(s.nbytes for s in self.storages)
        manifest = fmt.Manifest(
            format=fmt.FORMAT_VERSION,
            created=time.time(),
            metadata=self.metadata,
            structure=self.structure_chunk,
            storages=[
                fmt.Storage(
                    id=s.id,
                    nbytes=s.nbytes,
                    dtype=dtype_name(s.dtype),
                    location=s.location,
                    name=s.name,
                    chunks=self.chunks[s.id],
                )
                for s in self.storages
            ],
            entries=self.entries,
            raw_bytes=raw_bytes,
            stored_bytes=self.position,
            digest=0,
        )
        manifest = msgspec.structs.replace(manifest, digest=fmt.digest_of(manifest))
        encoded_manifest = fmt.encode_manifest(manifest)
        manifest_offset = await self._write(encoded_manifest)
        footer = fmt.Footer(
            version=fmt.FORMAT_VERSION,
            flags=0,
            manifest_offset=manifest_offset,
            manifest_length=len(encoded_manifest),
            manifest_xxh3=xxhash.xxh3_64_intdigest(encoded_manifest),
        )
        await self._write(fmt.encode_footer(footer))
        committing = time.perf_counter()
        await self.sink.commit()  # fsync and rename, or the multipart completion
        self.write_seconds += time.perf_counter() - committing
        if self.write_seconds > 0 and self.written >= 64 * MiB:
            _BANDWIDTH[self.bandwidth_key] = self.written / self.write_seconds
        return SaveResult(
            url=self.sink.url,
            raw_bytes=raw_bytes,
            stored_bytes=self.written,
            storages=len(self.storages),
            chunks=1 + sum(len(c) for c in self.chunks.values()),
            compressed_storages=sum(
                any(c.codec != "raw" for c in chunks) for chunks in self.chunks.values()
            ),
            snapshot_seconds=self.snapshot_seconds,
            total_seconds=time.perf_counter() - started,
            digest=f"{manifest.digest:016x}",
            direct_bytes=self.sink.direct_bytes,
        )


# -- the entry point -------------------------------------------------------------------------

_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]]
_LOCKS = weakref.WeakKeyDictionary()


def _check(
    compression: object,
    level: object,
    chunk_bytes: object,
    staging_bytes: object,
    exclude: object,
    metadata: object,
    priority: object = "low",
) -> tuple[str | None, tuple[str, ...], dict[str, Any]]:
    if compression not in (None, "zstd", "auto"):
        raise InvalidArgument(f"compression={compression!r}: use None, 'zstd' or 'auto'")
    if priority not in ("low", "normal"):
        raise InvalidArgument(f"priority={priority!r}: use 'low' (the default) or 'normal'")
    if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
        raise InvalidArgument(f"level={level!r}: zstd levels are ints from -7 to 22")
    for name, value in (("chunk_bytes", chunk_bytes), ("staging_bytes", staging_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 4096:
            raise InvalidArgument(f"{name}={value!r}: pass a number of bytes >= 4096")
    assert isinstance(chunk_bytes, int)
    assert isinstance(staging_bytes, int)
    if staging_bytes < chunk_bytes:
        raise InvalidArgument(
            f"staging_bytes={staging_bytes} is smaller than chunk_bytes={chunk_bytes}: the "
            "pool must hold at least one chunk (two or more let copying and writing overlap)"
        )
    if isinstance(exclude, str):
        exclude = (exclude,)
    if not isinstance(exclude, Iterable) or not all(isinstance(p, str) for p in exclude):
        raise InvalidArgument(f"exclude={exclude!r}: pass name patterns such as ['*.embed*']")
    meta = {} if metadata is None else metadata
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise InvalidArgument(f"metadata={metadata!r}: pass a dict with str keys")
    try:
        msgspec.msgpack.encode(meta)
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidArgument(
            f"metadata cannot be stored ({exc}): use str keys and plain values "
            "(numbers, strings, lists, dicts)"
        ) from None
    return compression, tuple(exclude), meta


async def save(
    obj: Any,
    target: Any,
    *,
    compression: Literal["auto", "zstd"] | None = "auto",
    level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    exclude: Iterable[str] = (),
    metadata: dict[str, Any] | None = None,
    store_options: dict[str, Any] | None = None,
    priority: Literal["low", "normal"] = "low",
) -> SaveHandle:
    """Save ``obj`` (a state dict, or any picklable object holding tensors) as a checkpoint.

    Returns once the tensors' bytes are snapshotted: the caller may then change them.
    Compression, checksums and writing go on in the background; ``await`` the returned
    :class:`SaveHandle` for the :class:`SaveResult`. Until it commits, the target holds its
    previous content (or nothing); a failure or cancellation leaves it so.

    Args:
        obj: what to save; tensors anywhere inside it are saved as ``torch.save`` would.
        target: a URL (``"s3://bucket/run/step-100.ckpt"``, ``"file:///…"``), a local path,
            a ``(store, key)`` pair, or a writable binary file object (not atomic).
        compression: ``"auto"`` probes each storage's first chunk and compresses only where
            it shrinks and keeps up with the target's measured write speed; ``"zstd"``
            always; ``None`` never. Elements of 2 and 4 bytes are byte-shuffled first.
        level: zstd level (1 is fast; higher is smaller and slower).
        chunk_bytes: chunk size: the unit of compression, checksums and ranged reads.
        staging_bytes: the staging pool's budget. A state larger than it streams through
            with back-pressure: the call then returns only when the rest fits.
        exclude: name patterns (``fnmatch``) of entries stored raw whatever ``compression``.
        metadata: a dict kept in the manifest (step, time, anything msgpack can hold).
        store_options: options for ``open_store`` when ``target`` is a URL or path.
        priority: ``"low"`` (the default) checksums and compresses on threads of the lowest
            priority (nice 19), so a training step's threads get the cores whenever they
            want them and the save goes on in what they leave; ``"normal"`` when the save
            should finish as soon as possible. The snapshot (what the caller waits for)
            always runs at normal priority.

    Only one save per target runs at a time in an event loop; a second waits for the first
    to commit before its snapshot.

    Raises:
        InvalidArgument: a bad argument (named in the message).
        UnsafeCheckpoint: ``obj`` cannot be pickled.
    """
    started = time.perf_counter()
    compression_, patterns, meta = _check(
        compression, level, chunk_bytes, staging_bytes, exclude, metadata, priority
    )
    resolved = resolve(target, store_options, writing=True)
    loop = asyncio.get_running_loop()
    locks = _LOCKS.setdefault(loop, {})
    lock = locks.setdefault(resolved.url, asyncio.Lock())
    await lock.acquire()
    sink: Sink | None = None
    writer: asyncio.Task[SaveResult] | None = None
    try:
        structure, storages, entries = pickle_structure(obj)
        pool = staging_pool(chunk_bytes)
        pool.set_budget(staging_bytes)
        if resolved.file is not None:
            sink = FileSink(resolved.file)
        else:
            assert resolved.store is not None
            assert resolved.key is not None
            if resolved.local_path is not None:
                os.makedirs(os.path.dirname(resolved.local_path), exist_ok=True)
            if isinstance(resolved.store, S3Store | LocalStore):
                # What a save killed mid-write left: unfinished uploads, temp files.
                await resolved.store.clean_up_writes(resolved.key)
            sink = StoreSink(resolved.store, resolved.key)
            await sink.open()
        decisions = _Decisions(compression_, level, patterns)
        key = resolved.url.rpartition("/")[0]
        # Until a save to this place has been measured: local disks and memory are fast,
        # object stores slow; compression pays where it produces bytes faster than these.
        assumed = 150e6 if isinstance(resolved.store, S3Store) else 1.5e9
        decisions.bandwidth = _BANDWIDTH.get(key, assumed)
        job = _SaveJob(
            sink, structure, storages, entries, meta, pool, decisions, key, priority == "low"
        )
    except BaseException as exc:
        await shielded(_fail(None, sink, exc))
        await shielded(_release(resolved, lock))
        raise

    async def run() -> SaveResult:
        # Owns the save from here: whatever ends it (error, cancellation of the handle),
        # nothing is committed unless every byte was written, and the target is released.
        job.started = True
        try:
            return await job.write_all(started)
        except BaseException as exc:
            await shielded(_fail(job, sink, exc))
            raise
        finally:
            await shielded(_release(resolved, lock))

    writer = job.writer = asyncio.ensure_future(run())
    try:
        await asyncio.sleep(0)  # let it start, so that cancelling it runs its cleanup
        await job.snapshot()
    except BaseException as exc:
        job.snapshot_done = True  # the snapshot stopped: its slabs may go back
        writer.cancel()
        await shielded(asyncio.gather(writer, return_exceptions=True))
        if not job.started:  # cancelled before its first step: its cleanup never ran
            await shielded(_fail(job, sink, exc))
            await shielded(_release(resolved, lock))
        else:
            await shielded(_fail(job, None, exc))  # tasks queued after the writer failed
        raise
    return SaveHandle(writer, resolved.url)


async def _release(resolved: Any, lock: asyncio.Lock) -> None:
    try:
        await resolved.aclose()
    finally:
        lock.release()


async def _fail(job: _SaveJob | None, sink: Sink | None, exc: BaseException) -> None:
    # Stop everything, then make sure nothing was committed.
    if job is not None:
        job.failed = True  # a snapshot finishing from now on gives its slabs back itself
        for task in job.tasks:
            task.cancel()
        # Each task ends only once its thread is done with its slab (run_thread).
        await asyncio.gather(*job.tasks, return_exceptions=True)
        if job.snapshot_done:
            job.release_all()  # otherwise the snapshot, still copying, releases them
    if sink is not None:
        with contextlib.suppress(Exception):  # the original error is the one to report
            await sink.abort(exc)
