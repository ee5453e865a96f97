"""The save pipeline: one save, from the snapshot into staging to the commit.

The caller waits for the snapshot only: tensor bytes copied into slabs of a reusable staging
pool (pinned host memory when CUDA is present, device-to-host copies on a side stream).
Each full slab (a *segment*: one or more chunks) then goes to a worker thread that encodes
and checksums its chunks, while a writer task streams finished segments, in order, into the
target's sink. The manifest and footer are written last; closing the sink is the commit
point. A state larger than the pool streams through it: the snapshot then waits for slabs
to come back (back-pressure), so the caller waits longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import torch
import xxhash
import zstandard

from .._concurrency import TaskSet, abandon, forget_errors, shield, to_thread, wait_shared
from .._iov import ALIGN
from ..errors import AsyncStoreError
from ..stores import Loan
from . import _format as fmt
from ._codec import ENCODERS, Codecs, Encoded, Known
from ._handle import SaveResult
from ._packfile import PackId, encode_end
from ._pickle import SavedStorage, dtype_name
from ._staging import Copier, Piece, Segment, StagingPool, byte_view, storage_bytes
from ._target import Sink

__all__ = ["PackTarget", "SaveJob"]

MiB = 1 << 20

# A storage that does not fit in what is left of a slab is cut there (its chunk ends early)
# when at least this much (or a quarter of a slab) is left; otherwise it starts a new slab.
_MIN_SPLIT = 1 * MiB
# Compressed chunks smaller than this are gathered into one write.
_SMALL_WRITE = 1 * MiB

# The writer task of every save still writing in this process. A writer outlives the call
# that started it, and it runs its job's close, so it cannot be in the job's own set.
_WRITERS = TaskSet("asyncstore checkpoint saves")

_SNAPSHOT, _WRITER = "snapshot", "writer"


# Zero chunks (skip_data()) from this size are stored as a zstd frame; smaller ones raw.
_FRAMED_FROM = 4096
_ZEROS = bytes(MiB)


@functools.lru_cache(maxsize=16)
def _zero_chunk(size: int, level: int) -> Encoded:
    """A chunk of ``size`` zero bytes as a zstd frame, made from a small buffer of zeros
    (once per size and level: a save under skip_data() has few sizes)."""
    compressor = zstandard.ZstdCompressor(level=level).compressobj(size=size)
    digest = xxhash.xxh3_64()
    parts = []
    left = size
    while left:
        block = memoryview(_ZEROS)[: min(left, len(_ZEROS))]
        parts.append(compressor.compress(block))
        digest.update(block)
        left -= len(block)
    parts.append(compressor.flush())
    stored = b"".join(parts)
    return Encoded("zstd", stored, xxhash.xxh3_64_intdigest(stored), digest.intdigest())


class PackTarget:
    """Where a differential save puts its chunks: a new pack beside the checkpoint, and the
    chunks earlier versions' packs hold already (written as references instead).

    Chunks are then cut at fixed offsets of each storage (every ``chunk_bytes``), whatever
    else the state holds, so that an unchanged tensor gives the same chunks save after save.
    """

    def __init__(self, sink: Sink, name: str, known: Known, ids: dict[str, PackId]) -> None:
        self.sink = sink
        self.name = name  # the pack's key, relative to the checkpoint's directory
        self.known = known
        self.ids = dict(ids)  # the identity of every pack ``known`` points into
        self.committed = False


class SaveJob:
    """One save, from the snapshot to the commit.

    The order of calls:

    1. ``SaveJob(...)``, by :func:`~asyncstore.save` once the target's sink is open. The
       pickled structure is encoded at once, so that the file offset of every chunk after
       it is known while the chunks stay raw (slabs place each at its offset modulo 4096).
    2. :meth:`start` starts the writer, the task the :class:`SaveHandle` wraps: it writes
       the header and the structure, then waits for segments.
    3. :meth:`snapshot`, which the caller awaits: every storage is cut into pieces placed
       in slabs; each full slab (a *segment*) gets its copy (:class:`Copier`) and an
       encoder task, queued for the writer in file order. It returns once every byte is
       copied: the caller may then change its tensors.
    4. Encoders wait for the gate (opened once the snapshot is taken, or as soon as the
       pool runs dry and slabs must be written to come back), then checksum and compress
       their segment on a worker thread.
    5. The writer writes the segments in queue order, then the manifest and the footer,
       and commits.
    6. Whichever of the snapshot and the writer ends last runs :meth:`_close`, the one
       place that lets go of what the save holds, on every path: the copy and encoder
       tasks (each ends once its thread does), the slabs, the sink (aborted unless the
       save committed) and the target.

    Who owns a staging slab, and when it goes back to the pool:

    1. The snapshot takes it from the pool and enters it in ``_held``: from then the job
       owns it, and only the job gives it back.
    2. A copy thread or a GPU's side stream fills it; the snapshot waits for every copy
       thread before it returns. One encoder thread then reads it (after the side
       stream's copies, by their events).
    3. The writer lends views of it to the sink: a local file takes them straight from the
       slab (``O_DIRECT``), an S3 writer keeps them in the parts it sends (a
       :class:`~asyncstore.stores.Loan`, no copy). The slab goes back to the pool once the
       segment is written and every part holding a view of it is sent, so that a snapshot
       larger than the pool can go on. While the snapshot waits for a slab, the sink is
       asked to copy what it holds for a part not yet full (:meth:`Sink.unlend`): that
       part waits for the next segment, which waits for the slab.
    4. A save that fails or is cancelled gives every slab still held back in
       :meth:`_close`: after the snapshot has ended (it may still be copying into slabs),
       after every copy and encoder thread has ended, and after every device-to-host copy
       queued on a GPU's side stream has landed (:meth:`Copier.drain`).
    """

    def __init__(
        self,
        sink: Sink,
        structure: bytes,
        storages: list[SavedStorage],
        entries: dict[str, list[int]] | None,
        metadata: dict[str, Any],
        pool: StagingPool,
        codecs: Codecs,
        *,
        background: bool,
        release_target: Callable[[], Awaitable[None]],
        pack: PackTarget | None = None,
    ) -> None:
        self._sink = sink
        self._pack = pack
        self._storages = storages
        self._entries = entries
        self._metadata = metadata
        self._pool = pool
        self._codecs = codecs
        self._background = background  # encode on low-priority threads
        self._release_target = release_target
        self._structure, self._structure_chunk = codecs.encode_structure(structure, len(fmt.MAGIC))
        self._tasks = TaskSet(f"the save to {sink.url}")  # copies, encoders, slab waits
        self._queue: asyncio.Queue[asyncio.Task[tuple[Segment, list[Encoded]]] | None]
        self._queue = asyncio.Queue()
        self._encoders = asyncio.Semaphore(ENCODERS)
        self._gate = asyncio.Event()  # set: encoders may run
        self._held: dict[int, torch.Tensor] = {}  # slabs out of the pool, by id
        self._copier: Copier | None = None
        self._writer: asyncio.Task[SaveResult] | None = None
        self._snapshot_seconds: float | None = None  # set once the snapshot is taken
        self._starved = False  # the snapshot is waiting for a slab
        self._running = {_SNAPSHOT, _WRITER}  # the parts not ended yet; the last one closes
        self._error: BaseException | None = None  # what ended the save, if anything did

    def start(self, started: float) -> asyncio.Task[SaveResult]:
        """Start the writer; its task gives the result (``started``: the call's clock)."""
        self._writer = _WRITERS.spawn(self._write(started), name=f"save to {self._sink.url}")
        return self._writer

    async def _end(self, part: str, error: BaseException | None) -> None:
        # The snapshot and the writer each end here, once; the last one closes the save.
        if error is not None and self._error is None:
            self._error = error
        if part not in self._running:
            return
        self._running.discard(part)
        if not self._running:
            await shield(self._close())

    async def _close(self) -> None:
        try:
            # Each copy and encoder ends only once its thread is done with its slab, and a
            # GPU's queued copies into slabs end before the slabs go back.
            await self._tasks.aclose()
            forget_errors(self._unwritten())  # the save's error is the one reported
            if self._held and self._copier is not None:
                await self._copier.drain()
            for slab in self._held.values():
                self._pool.release(slab)
            self._held.clear()
            if self._error is not None:
                with contextlib.suppress(Exception):  # the save's own error is the one to report
                    await self._sink.abort(self._error)
                if self._pack is not None and not self._pack.committed:
                    with contextlib.suppress(Exception):
                        await self._pack.sink.abort(self._error)
        finally:
            await self._release_target()

    def _unwritten(self) -> list[asyncio.Task[tuple[Segment, list[Encoded]]]]:
        # Encoders the writer never took from the queue.
        tasks = []
        while not self._queue.empty():
            task = self._queue.get_nowait()
            if task is not None:
                tasks.append(task)
        return tasks

    # -- snapshot (the caller waits for this) -------------------------------------------------

    async def snapshot(self) -> None:
        """Copy every storage into staging; return once the caller may change its tensors.

        Raises:
            Exception: a copy's error, or the writer's if it failed meanwhile. The save is
                then over: nothing committed, everything released.
        """
        assert self._writer is not None
        started = time.perf_counter()
        devices = {
            s.storage.device
            for s in self._storages
            if s.storage.device.type == "cuda" and not s.zeros
        }
        error: BaseException | None = None
        try:
            copier = self._copier = Copier(devices, self._tasks)
            try:
                await self._plan(copier)
            finally:
                await copier.settle()
            copier.finish()
            self._snapshot_seconds = time.perf_counter() - started
            self._gate.set()
            await self._queue.put(None)
        except BaseException as exc:
            error = exc
            # The writer would wait for segments that will not come.
            await abandon(self._writer)  # this error is the one reported
            self._running.discard(_WRITER)  # one cancelled before its first step never ended
            raise
        finally:
            await shield(self._end(_SNAPSHOT, error))

    async def _plan(self, copier: Copier) -> None:
        chunk = self._pool.slab_bytes
        # Where the next chunk lands in the file if every chunk before it stays raw.
        offset = self._structure_chunk.offset + self._structure_chunk.stored
        segment: Segment | None = None
        # A differential save cuts every storage at fixed offsets: a chunk never ends early
        # to fill a slab, so that unchanged bytes give the same chunks as last time.
        fixed = self._pack is not None
        for saved in self._storages:
            if saved.meta:
                continue  # no bytes: recorded without chunks, no staging, no I/O
            # Under skip_data() the chunks are zeros: the tensor's own bytes are never read
            # (a FakeTensor has none). Compressed, each is a zstd frame made once per size,
            # without the slab; stored raw, the slab is zeroed.
            source = None if saved.zeros else storage_bytes(saved.storage)
            framed = saved.zeros and self._frames_zeros(saved)
            index = start = 0
            while start < saved.nbytes:
                size = min(chunk, saved.nbytes - start)
                room = 0 if segment is None else self._room(segment)
                if fixed and size > room:
                    if segment is not None:
                        await self._submit(segment, copier)
                    segment = await self._segment(copier, 0)
                    size = min(size, self._room(segment))  # a pinned slab cut short
                elif size > room:
                    if room >= min(_MIN_SPLIT, chunk // 4):
                        size = room  # fill the slab: this chunk ends where it does
                    else:
                        if segment is not None:
                            await self._submit(segment, copier)
                        segment = await self._segment(copier, offset)
                        # A pinned slab has nothing to spare beyond chunk_bytes: after its
                        # base, a full chunk may have to end early.
                        size = min(size, self._room(segment))
                assert segment is not None
                part = None if source is None else source[start : start + size]
                piece = Piece(saved, index, segment.used, size, part)
                piece.framed = framed and size >= _FRAMED_FROM
                segment.pieces.append(piece)
                segment.used += size
                offset += size
                start += size
                index += 1
        if segment is not None:
            await self._submit(segment, copier)
        copier.dispatch()

    def _frames_zeros(self, saved: SavedStorage) -> bool:
        # Whether the zero chunks of ``saved`` are stored as zstd frames: wherever it may be
        # compressed at all. (A differential save looks its chunks up among earlier ones.)
        codecs = self._codecs
        return (
            self._pack is None
            and codecs.compression is not None
            and not any(fnmatch.fnmatchcase(saved.name, p) for p in codecs.exclude)
        )

    def _room(self, segment: Segment) -> int:
        # Bytes the segment can still take: chunk_bytes from its base, within its slab.
        chunk = self._pool.slab_bytes
        return min(chunk - (segment.used - segment.base), len(segment.slab) - segment.used)

    async def _segment(self, copier: Copier, offset: int) -> Segment:
        # A new segment whose first piece lands at ``offset`` in the file.
        assert self._writer is not None
        slab = None if self._writer.done() else self._pool.try_acquire()
        if slab is None:  # later saves rarely get here: no waiting, no task
            slab = await self._wait_for_slab(copier)
        self._held[id(slab)] = slab
        base = offset % ALIGN
        return Segment(slab, base, used=base)

    async def _wait_for_slab(self, copier: Copier) -> torch.Tensor:
        assert self._writer is not None
        copier.dispatch()  # about to wait: copy what is planned meanwhile
        if not self._pool.can_acquire():
            self._gate.set()  # slabs come back only once written: start the pipeline now
            # A part not yet full waits for the next segment, which waits for a slab: the
            # sink copies it and lets go of its slabs (again before each wait of the writer).
            self._starved = True
            self._sink.unlend()
        # Wait for a slab, unless the writer fails meanwhile (then no slab comes back).
        acquire = self._tasks.spawn(self._pool.acquire(), name="wait for a staging slab")
        try:
            await asyncio.wait((acquire, self._writer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._starved = False
            if not acquire.done():
                acquire.cancel()
                await asyncio.wait([acquire])
            if not acquire.cancelled() and acquire.exception() is None:
                # Held at once, whatever ends this wait: the job's close gives it back.
                slab = acquire.result()
                self._held[id(slab)] = slab
        if self._writer.done():
            self._writer.result()  # raises the writer's error
            raise AsyncStoreError(f"the save to {self._sink.url} stopped writing")
        return acquire.result()  # or the allocation's error

    async def _submit(self, segment: Segment, copier: Copier) -> None:
        copier.add(segment)
        name = f"encode {len(segment.pieces)} chunk(s)"
        await self._queue.put(self._tasks.spawn(self._encode(segment), name=name))

    # -- encode (worker threads) ---------------------------------------------------------------

    async def _encode(self, segment: Segment) -> tuple[Segment, list[Encoded]]:
        # The caller is waiting for the snapshot: encoding and writing start when it is
        # taken (so that the copies have the CPU and memory bandwidth to themselves), or
        # as soon as the pool runs dry and slabs must be written to come back.
        await self._gate.wait()
        if segment.copied is not None:
            await wait_shared(segment.copied)
        # While the snapshot is still waiting for slabs (a state larger than the pool),
        # the caller waits for this encoding too: it runs at normal priority then.
        background = self._background and self._snapshot_seconds is not None
        encoded = await to_thread(
            self._encode_sync, segment, limiter=self._encoders, background=background
        )
        return segment, encoded

    def _encode_sync(self, segment: Segment) -> list[Encoded]:
        for event in segment.ready:
            event.synchronize()
        known = None if self._pack is None else self._pack.known
        return [
            _zero_chunk(piece.size, self._codecs.level)
            if piece.framed
            else self._codecs.encode(
                piece.storage, byte_view(segment.slab, piece.start, piece.size), known
            )
            for piece in segment.pieces
        ]

    # -- write (in order) ----------------------------------------------------------------------

    async def _write(self, started: float) -> SaveResult:
        error: BaseException | None = None
        try:
            return await self._write_all(started)
        except BaseException as exc:
            error = exc
            raise
        finally:
            await shield(self._end(_WRITER, error))

    async def _write_all(self, started: float) -> SaveResult:
        pack = self._pack
        data = _Layout(self._sink if pack is None else pack.sink, self._storages, pack)
        meta = data if pack is None else _Layout(self._sink, [], None)
        await meta.append(fmt.MAGIC)  # the header: what the object is, from its first bytes
        offset = await meta.append(self._structure)
        assert offset == self._structure_chunk.offset
        if pack is not None:
            await data.append(fmt.PACK_MAGIC)
        while True:
            if self._starved and self._queue.empty():
                data.sink.unlend()  # see _wait_for_slab
            task = await self._queue.get()
            if task is None:
                break
            segment, encoded = await task
            slab = self._held.pop(id(segment.slab))
            # From here the loan gives the slab back, once the sink is done with its views.
            loan = Loan(functools.partial(self._pool.release, slab))
            try:
                await data.append_segment(segment, encoded, loan)
            finally:
                del encoded  # views of the slab: gone before it is reused
                loan.release()
        if pack is not None:
            # The pack commits before the checkpoint that points into it; one that nothing
            # points to (a crash in between) is removed by the next cleanup.
            if pack.name in data.packs:
                # The pack's own end: what later saves and copies check it against.
                end, pack.ids[pack.name] = encode_end(data.own, data.position)
                await data.append(end)
                await data.commit()
                pack.committed = True
            else:  # every chunk was known already: no pack at all
                await pack.sink.abort(AsyncStoreError("nothing new to write"))
                pack.committed = True
        raw_bytes = self._structure_chunk.raw + sum(s.nbytes for s in self._storages if not s.meta)
        packs = list(data.packs)
        # The new pack's bytes, if it was kept (one with nothing new took only its magic).
        pack_bytes = data.written if pack is not None and pack.name in data.packs else 0
        # The oldest format that holds it: every reader of that version reads it.
        codecs = {chunk.codec for chunks in data.chunks.values() for chunk in chunks}
        version = fmt.version_for(bool(packs), codecs)
        manifest = fmt.Manifest(
            format=version,
            created=time.time(),
            metadata=self._metadata,
            structure=self._structure_chunk,
            storages=[
                fmt.Storage(
                    id=s.id,
                    nbytes=s.nbytes,
                    dtype=dtype_name(s.dtype),
                    location=s.location,
                    name=s.name,
                    chunks=tuple(data.chunks[s.id]),
                    packs=tuple(data.chunk_packs[s.id]) if packs else (),
                )
                for s in self._storages
            ],
            entries=self._entries,
            raw_bytes=raw_bytes,
            stored_bytes=meta.position + pack_bytes,
            digest=0,
            packs=packs,
            pack_ids=[] if pack is None else [(*pack.ids[name],) for name in packs],
        )
        manifest = msgspec.structs.replace(manifest, digest=fmt.digest_of(manifest))
        encoded_manifest = fmt.encode_manifest(manifest)
        manifest_offset = await meta.append(encoded_manifest)
        footer = fmt.Footer(
            version=version,
            flags=0,
            manifest_offset=manifest_offset,
            manifest_length=len(encoded_manifest),
            manifest_xxh3=xxhash.xxh3_64_intdigest(encoded_manifest),
        )
        await meta.append(fmt.encode_footer(footer))
        await meta.commit()
        written = pack_bytes + meta.written if pack is not None else data.written
        self._codecs.record_speed(data.written, data.write_seconds)
        assert self._snapshot_seconds is not None  # the queue ends once the snapshot is taken
        return SaveResult(
            url=self._sink.url,
            raw_bytes=raw_bytes,
            stored_bytes=written,
            storages=len(self._storages),
            chunks=1 + sum(len(c) for c in data.chunks.values()),
            compressed_storages=sum(
                any(c.codec != "raw" for c in chunks) for chunks in data.chunks.values()
            ),
            snapshot_seconds=self._snapshot_seconds,
            total_seconds=time.perf_counter() - started,
            digest=f"{manifest.digest:016x}",
            direct_bytes=self._sink.direct_bytes + (0 if pack is None else pack.sink.direct_bytes),
            skipped_bytes=data.skipped,
        )


class _Layout:
    """A checkpoint's bytes going into its sink in order: where each chunk lands, and how
    fast the sink takes them."""

    def __init__(self, sink: Sink, storages: list[SavedStorage], pack: PackTarget | None) -> None:
        self.sink = sink
        self.chunks: dict[int, list[fmt.Chunk]] = {s.id: [] for s in storages}
        self.chunk_packs: dict[int, list[int]] = {s.id: [] for s in storages}
        # Writing a pack: the packs chunks lie in, by index (this one once it has a chunk).
        self.pack = pack
        self.packs: dict[str, int] = {}
        self.own: list[fmt.Chunk] = []  # the chunks written into that pack, in file order
        self.skipped = 0  # raw bytes an earlier pack holds, not written again
        self.position = 0  # bytes laid out (ahead of written while small ones are gathered)
        self.written = 0  # bytes handed to the sink
        self.write_seconds = 0.0

    def _record(self, storage: int, chunk: fmt.Chunk, pack: str | None) -> None:
        self.chunks[storage].append(chunk)
        index = fmt.INLINE if pack is None else self.packs.setdefault(pack, len(self.packs))
        self.chunk_packs[storage].append(index)

    async def _put(self, data: memoryview | bytes | bytearray, loan: Loan | None = None) -> None:
        started = time.perf_counter()
        await self.sink.write(data, loan)
        self.write_seconds += time.perf_counter() - started
        self.written += len(data)

    async def append(self, data: memoryview | bytes) -> int:
        """Write ``data`` (header, structure, manifest, footer) now; its offset."""
        offset = self.position
        self.position += len(data)
        await self._put(data)
        return offset

    async def append_segment(self, segment: Segment, encoded: list[Encoded], loan: Loan) -> None:
        """Write a segment's chunks, and record where each landed; views of its slab are
        lent to the sink under ``loan``."""
        # Few large writes, not one per chunk (a model has hundreds of small tensors, and a
        # write can cost a thread hop): raw chunks lie one after another in the slab, so a
        # run of them goes out as one view of it; small compressed ones are gathered.
        run: tuple[int, int] | None = None  # [start, end) in the slab
        small = bytearray()
        own = None if self.pack is None else self.pack.name
        for piece, item in zip(segment.pieces, encoded, strict=True):
            if item.ref is not None:
                # An earlier pack holds these bytes: point there, write nothing.
                self._record(piece.storage.id, item.ref.chunk, item.ref.pack)
                self.skipped += piece.size
                continue
            starts_run = item.codec == "raw" and not (run is not None and run[1] == piece.start)
            if self.pack is not None and starts_run:
                # A pack's chunks are not where the slab's layout planned them (chunks
                # before them were skipped): pad, so that the run lies in the file as in
                # the slab modulo ALIGN and a local file takes it around the page cache.
                pad = (piece.start - self.position) % ALIGN
                if pad:
                    if small:
                        await self._put(small)
                        small = bytearray()
                    if run is not None:
                        await self._put(byte_view(segment.slab, run[0], run[1] - run[0]), loan)
                        run = None
                    await self._put(bytes(pad))
                    self.position += pad
            chunk = fmt.Chunk(
                self.position,
                len(item.stored),
                piece.size,
                item.codec,
                item.stored_xxh3,
                item.raw_xxh3,
            )
            self._record(piece.storage.id, chunk, own)
            if own is not None:
                self.own.append(chunk)
            self.position += len(item.stored)
            if item.codec == "raw":
                if small:
                    await self._put(small)
                    small = bytearray()
                start, end = piece.start, piece.start + piece.size
                if run is not None and run[1] == start:
                    run = (run[0], end)
                    continue
                if run is not None:
                    await self._put(byte_view(segment.slab, run[0], run[1] - run[0]), loan)
                run = (start, end)
                continue
            if run is not None:
                await self._put(byte_view(segment.slab, run[0], run[1] - run[0]), loan)
                run = None
            if len(item.stored) >= _SMALL_WRITE:
                if small:
                    await self._put(small)
                    small = bytearray()
                await self._put(item.stored)
            else:
                small += item.stored
        if run is not None:
            await self._put(byte_view(segment.slab, run[0], run[1] - run[0]), loan)
        if small:
            await self._put(small)

    async def commit(self) -> None:
        """Make the checkpoint appear: fsync and rename, or the multipart completion."""
        started = time.perf_counter()
        await self.sink.commit()
        self.write_seconds += time.perf_counter() - started
