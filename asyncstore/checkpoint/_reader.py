"""Reading a checkpoint's bytes: the manifest, then only the chunks needed, each verified.

:class:`ChunkReader` reads chunks into the memory they decode to (a tensor's storage),
consecutive chunks in one read, and checks every one against its checksums before use.
Where a chunk lies is checked against the object it lies in before anything is allocated
for it: the manifest's own chunks against the checkpoint object when the manifest is read,
a pack's against the pack's real size (:meth:`ChunkReader.check_extents`).
:func:`~asyncstore.checkpoint.load` decides which chunks to read and what to build from
them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable

import torch
import xxhash

from .._concurrency import bounded_map, to_thread
from .._iov import IOV_MAX, advance
from ..errors import IntegrityError, InvalidArgument, NotFound, UnsafeCheckpoint
from . import _format as fmt
from ._staging import byte_view
from ._target import Source, StoreSource

__all__ = [
    "ChunkRead",
    "ChunkReader",
    "available_memory",
    "check_memory",
    "fixed_storage",
    "manifest_of",
]

# Chunks read at once: enough to keep S3 busy, few enough to bound memory.
_READS = 8


async def manifest_of(source: Source) -> fmt.Manifest | None:
    """The checkpoint's manifest, verified; None for an object that is not one of ours."""
    return await fmt.read_manifest_of(source.read, await source.size(), source.url)


# Consecutive chunks are read together up to this many bytes: one read and one thread hop
# per span rather than per chunk (a model has hundreds of small tensors).
_SPAN = 32 * 1024 * 1024


class ChunkRead:
    """A chunk to read, the pack it lies in, where its decoded bytes go, and what it is
    (for messages)."""

    __slots__ = ("chunk", "out", "pack", "what")

    def __init__(
        self, chunk: fmt.Chunk, out: memoryview, what: str, pack: int = fmt.INLINE
    ) -> None:
        self.chunk, self.out, self.what, self.pack = chunk, out, what, pack


class ChunkReader:
    """Reads and verifies chunks of the checkpoint whose manifest is ``manifest``, from the
    checkpoint object and the packs beside it (:meth:`aclose` closes those)."""

    def __init__(self, source: Source, manifest: fmt.Manifest) -> None:
        self.source = source
        self.manifest = manifest
        self.reads = asyncio.Semaphore(_READS)
        self.decoders = asyncio.Semaphore(max(1, min(4, os.cpu_count() or 1)))
        self._packs: dict[int, Source] = {}
        self._sizes: dict[int, int] = {}  # pack index -> the pack's real size, once known

    def _source(self, pack: int) -> Source:
        if pack == fmt.INLINE:
            return self.source
        source = self._packs.get(pack)
        if source is None:
            source = self._packs[pack] = self.source.sibling(self.manifest.packs[pack])
        return source

    async def open_packs(self) -> None:
        """Open every local pack the manifest names, now: a load then reads the packs as
        they were, even if retention deletes them meanwhile (as it reads the checkpoint
        from the file it opened first). Object stores have nothing to open.

        Raises:
            IntegrityError: a pack is missing.
        """
        for index, name in enumerate(self.manifest.packs):
            source = self._source(index)
            if isinstance(source, StoreSource) and source.local_path is not None:
                try:
                    await to_thread(source.fd)
                except NotFound:
                    raise IntegrityError(
                        f"{self.source.url}: its chunks lie in {name}, which is missing: the "
                        "checkpoint is damaged (a pack deleted outside asyncstore?); load an "
                        "earlier one"
                    ) from None

    async def _pack_size(self, pack: int) -> int:
        # The size of the file or object itself (fstat of the file opened, or a stat that
        # also pins every later read of an S3 object to the version it saw), never a figure
        # written in a manifest.
        size = self._sizes.get(pack)
        if size is None:
            source = self._source(pack)
            try:
                size = await source.size()
            except NotFound:
                raise IntegrityError(
                    f"{self.source.url}: its chunks lie in {self.manifest.packs[pack]}, which "
                    "is missing: the checkpoint is damaged (a pack deleted outside "
                    "asyncstore?); load an earlier one"
                ) from None
            self._sizes[pack] = size
        return size

    async def check_extents(self, entries: Iterable[fmt.Storage]) -> None:
        """Check that every chunk of ``entries`` that lies in a pack ends within that
        pack's real size, before anything is allocated or read for them. (The chunks in the
        checkpoint object were checked against it with the manifest.)

        Raises:
            IntegrityError: a chunk claims bytes past the end of its pack (naming the pack,
                the bytes claimed and the pack's size), or a pack is missing.
        """
        await self._check_extents(
            (entry.pack_of(index), chunk, entry, index)
            for entry in entries
            if entry.packs
            for index, chunk in enumerate(entry.chunks)
        )

    async def _check_extents(
        self, chunks: Iterable[tuple[int, fmt.Chunk, fmt.Storage | str, int]]
    ) -> None:
        # A manifest's figures are checked against the sizes of the packs themselves: a
        # few hundred bytes of crafted manifest would otherwise have the reader allocate
        # (and read into) whatever a chunk claims, gigabytes of it.
        in_packs = [item for item in chunks if item[0] != fmt.INLINE]
        for pack in sorted({item[0] for item in in_packs}):
            await self._pack_size(pack)
        for pack, chunk, owner, index in in_packs:
            size = self._sizes[pack]
            end = chunk.offset + chunk.stored
            if end > size:
                what = (
                    owner if isinstance(owner, str) else f"chunk {index} of tensor {owner.name!r}"
                )
                raise IntegrityError(
                    f"{self.source.url}: {what} claims bytes {chunk.offset:,}-{end:,} "
                    f"({chunk.stored:,} stored) of {self._source(pack).url}, which holds "
                    f"{size:,} bytes: the checkpoint is damaged or crafted; load an earlier "
                    "one"
                )

    async def aclose(self) -> None:
        """Close the packs' sources (the checkpoint's own is the caller's)."""
        packs, self._packs = list(self._packs.values()), {}
        for source in packs:
            await source.aclose()

    def _where(self, target: ChunkRead) -> str:
        chunk = target.chunk
        where = f"bytes {chunk.offset}-{chunk.offset + chunk.stored}"
        if target.pack != fmt.INLINE:
            where += f" of {self.manifest.packs[target.pack]}"
        return where

    def _check(self, stored: memoryview | bytes, target: ChunkRead) -> None:
        chunk = target.chunk
        if len(stored) != chunk.stored or xxhash.xxh3_64_intdigest(stored) != chunk.stored_xxh3:
            raise IntegrityError(
                f"{self.source.url}: {target.what} ({self._where(target)}) does not match its "
                "checksum: the checkpoint is damaged; load an earlier one"
            )

    def _check_all(self, span: list[ChunkRead]) -> None:
        for target in span:
            self._check(target.out, target)

    def _decode(self, stored: memoryview | bytes, target: ChunkRead) -> None:
        self._check(stored, target)
        chunk = target.chunk
        try:
            fmt.decode_into(stored, chunk.codec, target.out)
        except IntegrityError as exc:
            raise IntegrityError(
                f"{self.source.url}: {target.what} cannot be decoded: {exc}"
            ) from None
        if chunk.codec != "raw" and xxhash.xxh3_64_intdigest(target.out) != chunk.raw_xxh3:
            raise IntegrityError(
                f"{self.source.url}: {target.what} decodes to bytes that do not match their "
                "checksum"
            )

    def _decode_span(
        self, data: memoryview | bytes | bytearray, start: int, span: list[ChunkRead]
    ) -> None:
        view = memoryview(data)
        for target in span:
            offset = target.chunk.offset - start
            self._decode(view[offset : offset + target.chunk.stored], target)

    def _read_local(self, source: Source, start: int, end: int, span: list[ChunkRead]) -> None:
        # Straight from the file: raw chunks land in their tensors with one copy (preadv
        # scatters the span into them), then are verified where they lie.
        assert isinstance(source, StoreSource)
        fd = source.fd()  # the file the manifest came from, or a pack beside it
        if all(t.chunk.codec == "raw" for t in span):
            buffers = [t.out for t in span]
            position = start
            while buffers:
                got = os.preadv(fd, buffers[:IOV_MAX], position)
                if got == 0:
                    raise IntegrityError(
                        f"{source.url} ends at byte {position}, before its chunks do"
                    )
                position += got
                advance(buffers, got)
            self._check_all(span)
            return
        data = bytearray(end - start)
        got = os.preadv(fd, [data], start)
        while got < len(data):
            more = os.preadv(fd, [memoryview(data)[got:]], start + got)
            if more == 0:
                raise IntegrityError(f"{source.url} ends at byte {start + got}")
            got += more
        self._decode_span(data, start, span)

    async def _span(self, span: list[ChunkRead]) -> None:
        start = span[0].chunk.offset
        end = span[-1].chunk.offset + span[-1].chunk.stored
        source = self._source(span[0].pack)
        try:
            if source.local_path is not None:
                await to_thread(self._read_local, source, start, end, span, limiter=self.decoders)
                return
            if all(t.chunk.codec == "raw" for t in span):
                # Into the tensors as the bytes arrive, then verified where they lie.
                async with self.reads:
                    await source.read_into(start, [t.out for t in span])
                await to_thread(self._check_all, span, limiter=self.decoders)
                return
            async with self.reads:
                data = await source.read(start, end)
        except NotFound:
            if source is self.source:
                raise
            raise IntegrityError(
                f"{self.source.url}: {span[0].what} lies in {source.url}, which is missing: "
                "the checkpoint is damaged (a pack deleted outside asyncstore?); load an "
                "earlier one"
            ) from None
        await to_thread(self._decode_span, data, start, span, limiter=self.decoders)

    async def read(self, targets: list[ChunkRead]) -> None:
        """Read and verify every target, consecutive chunks of one object together.

        Raises:
            IntegrityError: a chunk lies past the end of its pack (checked before any
                read), or does not match its checksums.
        """
        await self._check_extents((t.pack, t.chunk, t.what, 0) for t in targets)
        await self._read(targets)

    async def _read(self, targets: list[ChunkRead]) -> None:
        # The targets' extents are checked (see _check_extents).
        targets = sorted(targets, key=lambda t: (t.pack, t.chunk.offset))
        spans: list[list[ChunkRead]] = []
        for target in targets:
            last = spans[-1] if spans else None
            if (
                last is not None
                and last[-1].pack == target.pack
                and last[-1].chunk.offset + last[-1].chunk.stored == target.chunk.offset
                and target.chunk.offset + target.chunk.stored - last[0].chunk.offset <= _SPAN
            ):
                last.append(target)
            else:
                spans.append([target])
        # All or nothing: the first error cancels the rest and is raised as it is. Each
        # read ends only once its thread is done with the tensors it fills. Every span
        # starts at once: the reader's semaphores bound the reads and the memory.
        await bounded_map(self._span, spans, limit=len(spans), name="read chunks")

    async def structure(self) -> bytes:
        chunk = self.manifest.structure
        check_memory(chunk.raw, self.source.url, "its pickled structure")
        out = bytearray(chunk.raw)
        # One read from the start: the header, then the structure right after it.
        data = await self.source.read(0, chunk.offset + chunk.stored)
        if data[: len(fmt.MAGIC)] != fmt.MAGIC:
            raise IntegrityError(f"{self.source.url}: the checkpoint's header is damaged")
        target = ChunkRead(chunk, memoryview(out), "the pickled structure")
        self._decode(memoryview(data)[chunk.offset :], target)
        return bytes(out)

    async def storages(self, entries: list[fmt.Storage]) -> dict[int, torch.UntypedStorage]:
        """Each entry's storage, read and verified (on the CPU).

        Raises:
            IntegrityError: a chunk lies past the end of its pack (checked before any
                storage is allocated), or does not match its checksums.
            UnsafeCheckpoint: the storages need more memory than the machine has free.
        """
        out: dict[int, torch.UntypedStorage] = {}
        targets: list[ChunkRead] = []
        await self.check_extents(entries)
        check_memory(sum(e.nbytes for e in entries if e.location != "meta"), self.source.url)
        for entry in entries:
            if entry.location == "meta":
                # A size and no bytes (the manifest allows no chunks for it): nothing to read.
                out[entry.id] = torch.UntypedStorage(entry.nbytes, device="meta")  # type: ignore[no-untyped-call]
                continue
            storage, memory = fixed_storage(entry.nbytes)
            targets += self._reads_into(entry, memory)
            out[entry.id] = storage
        await self._read(targets)
        return out

    async def mapped_storages(
        self, entries: list[fmt.Storage], *, shared: bool = False
    ) -> dict[int, torch.UntypedStorage]:
        """:meth:`storages` for ``load(mmap=True)``: each entry stored raw and in one piece
        (contiguous chunks in the checkpoint object itself) is built over a memory map of
        the file, private and copy-on-write, and verified through the map (the checksums
        read its pages once; no memory of the process holds a copy); the others are read
        as :meth:`storages` reads them.

        ``shared`` (``MAP_SHARED``): the map is the tensors' writable home, whose changes
        reach the file, so its bytes are the caller's to change: mapped storages are not
        verified then (a later ordinary load of a file changed so fails its checksums).

        Raises:
            InvalidArgument: the checkpoint is not in a local file, which a map needs.
            IntegrityError: a chunk does not match its checksum.
        """
        where = self.source.mappable()
        if where is None:
            raise InvalidArgument(
                f"mmap=True: {self.source.url} is not a local file, which a memory map "
                "needs; load it without mmap, or copy it to a local disk first"
            )
        path, base = where
        mapped: list[tuple[fmt.Storage, int]] = []
        rest: list[fmt.Storage] = []
        for entry in entries:
            start = _raw_extent(entry)
            if start is None:
                rest.append(entry)
            else:
                mapped.append((entry, base + start))
        out: dict[int, torch.UntypedStorage] = {}
        if mapped:
            await self.check_extents(entry for entry, _ in mapped)
            out = await to_thread(self._map, path, mapped, shared, limiter=self.decoders)
        if rest:
            out.update(await self.storages(rest))
        return out

    def _map(
        self, path: str, mapped: list[tuple[fmt.Storage, int]], shared: bool
    ) -> dict[int, torch.UntypedStorage]:
        size = max(start + entry.nbytes for entry, start in mapped)
        whole: torch.UntypedStorage = torch.UntypedStorage.from_file(path, shared, size)  # type: ignore[assignment]
        flat = torch.empty(0, dtype=torch.uint8).set_(whole)
        out: dict[int, torch.UntypedStorage] = {}
        for entry, start in mapped:
            position = start
            for index, chunk in enumerate(entry.chunks):
                view = byte_view(flat, position, chunk.stored)
                if not shared:
                    what = f"chunk {index} of tensor {entry.name!r}"
                    self._check(view, ChunkRead(chunk, view, what))
                position += chunk.stored
            out[entry.id] = whole[start : start + entry.nbytes]
        return out

    async def read_into(self, places: list[tuple[fmt.Storage, memoryview]]) -> None:
        """Read and verify each entry's bytes straight into its ``memory`` (exactly its
        size): a tensor's own memory, with no buffer between (raw chunks land there with
        one ``preadv`` from a local file, as they arrive from S3). All in one read, so
        consecutive storages go in one span and spans in parallel. On an error, the
        memory may hold some of the bytes."""
        for entry, memory in places:
            if len(memory) != entry.nbytes:
                raise ValueError(
                    f"read_into: {len(memory)} bytes for a {entry.nbytes}-byte storage"
                )
        await self.check_extents([entry for entry, _ in places])
        await self._read([t for entry, memory in places for t in self._reads_into(entry, memory)])

    def _reads_into(self, entry: fmt.Storage, memory: memoryview) -> list[ChunkRead]:
        targets = []
        position = 0
        for index, chunk in enumerate(entry.chunks):
            if position + chunk.raw > entry.nbytes:
                raise IntegrityError(
                    f"{self.source.url}: tensor {entry.name!r} overflows its storage"
                )
            what = f"chunk {index} of tensor {entry.name!r}"
            # A whole storage in one chunk (most small tensors) takes the view as it is:
            # every view kept alive until the read ends adds to the collector's work.
            whole = position == 0 and chunk.raw == len(memory)
            into = memory if whole else memory[position : position + chunk.raw]
            targets.append(ChunkRead(chunk, into, what, entry.pack_of(index)))
            position += chunk.raw
        if position != entry.nbytes:
            raise IntegrityError(
                f"{self.source.url}: tensor {entry.name!r} has {position} of {entry.nbytes} bytes"
            )
        return targets


def _raw_extent(entry: fmt.Storage) -> int | None:
    """Where ``entry``'s bytes start in the checkpoint object when they lie there as they
    are, in one piece (every chunk raw, inline, each right after the one before), else
    ``None`` (a compressed chunk, a chunk in a pack, an empty storage)."""
    if not entry.chunks or entry.nbytes == 0:
        return None
    start = position = entry.chunks[0].offset
    total = 0
    for index, chunk in enumerate(entry.chunks):
        if (
            chunk.codec != "raw"
            or entry.pack_of(index) != fmt.INLINE
            or chunk.offset != position
            or chunk.stored != chunk.raw
        ):
            return None
        position += chunk.stored
        total += chunk.raw
    return start if total == entry.nbytes else None


_SMALL = 64 * 1024  # storages below this come from a bytearray (see fixed_storage)


def fixed_storage(nbytes: int) -> tuple[torch.UntypedStorage, memoryview]:
    """A CPU storage of exactly ``nbytes`` that cannot grow, and a writable view of it.

    torch's own storages are resizable: ``set_`` with a view larger than the storage grows
    it, and the new bytes are whatever the allocator had. A storage made over a Python
    buffer cannot be resized (``torch.load``'s cannot either), so a view past the end fails
    instead of exposing memory. The buffer is a ctypes array over memory from torch's
    allocator, which it keeps alive: freed and reused like any tensor's, so loading again
    costs no fresh page faults. Below ``_SMALL`` bytes the buffer is a plain bytearray
    (16-byte aligned, as CPython allocates it, enough for every dtype): three objects
    fewer for the cyclic garbage collector per storage, which in a state of thousands of
    small tensors set the load's pace. (An empty storage is resizable: views are checked
    against it before they are built.)
    """
    if nbytes == 0:
        return torch.UntypedStorage(0), memoryview(bytearray())  # type: ignore[no-untyped-call]
    if nbytes < _SMALL:
        memory = memoryview(bytearray(nbytes))
        return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage(), memory
    owner = torch.empty(nbytes, dtype=torch.uint8)
    memory = byte_view(owner)
    # The ctypes array under the view keeps the tensor that owns the memory alive, and the
    # storage keeps the array alive: the memory goes back to torch with the storage.
    memory.obj._owner = owner  # type: ignore[attr-defined]
    return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage(), memory


# Allocations from this size on are checked against the memory the machine has free.
_CHECKED_FROM = 64 * 1024 * 1024


def available_memory() -> int | None:
    """Bytes this machine can still give a process (available RAM plus free swap), or
    ``None`` where that cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return sum(int(fields[name].split()[0]) * 1024 for name in (b"MemAvailable", b"SwapFree"))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def check_memory(needed: int, url: str, what: str = "its tensors") -> None:
    """Raise :class:`UnsafeCheckpoint` if ``needed`` bytes are more than this machine has
    available (sizes under 64 MiB are not checked)."""
    # Before allocating: a manifest (damaged, crafted, or simply too large for this machine)
    # must not get the process killed by the OOM killer halfway through a load. into= asks
    # once per storage: small ones are not worth reading /proc/meminfo for.
    if needed < _CHECKED_FROM:
        return
    available = available_memory()
    if available is not None and needed > available:
        raise UnsafeCheckpoint(
            f"loading {url} needs {needed / 2**30:,.1f} GiB for {what} but this machine "
            f"has {available / 2**30:,.1f} GiB available: load some entries with keys=, fill "
            "existing tensors in place with into=, or load on a larger machine"
        )
