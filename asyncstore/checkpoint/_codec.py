"""Which codec each chunk gets, and encoding it: compressed only where that pays.

``compression="auto"`` probes each storage's first chunk: a storage is compressed if the
probe shrinks it enough *and* the encoders produce bytes faster than the target takes them
(its write speed, measured by earlier saves to the same place), counting only the cores
this process can have: the ranks of a multi-process job on one node (``LOCAL_WORLD_SIZE``)
save at once and share them. Elements of 2 and 4 bytes are byte-shuffled before zstd; with
"auto", floating-point ones (bf16, fp16, fp32) get the byte-plane codec instead (see
._planes): zstd over the sign and exponent planes only, the mantissa planes stored raw,
which leaves about the same bytes for a fraction of the work.
"""

from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import dataclass

import xxhash

from . import _format as fmt
from ._pickle import SavedStorage
from ._planes import compress_planes, plane_mask, plane_ratios, plane_width

__all__ = ["ENCODERS", "Codecs", "Encoded", "Known", "Ref"]

MiB = 1 << 20

# Chunks smaller than this are stored raw: compressing them saves nothing worth a codec.
_SMALL = 64 * 1024
# "auto" probes this much of a storage's first chunk.
_PROBE = 128 * 1024
# "auto" compresses a storage only if the probe shrank it to this fraction or less.
_WORTH = 0.92
# ... and only if the encoders, on the cores this process may count on, encode at least this
# many times as fast as the target takes bytes. They share those cores with the writer (the
# kernel's copies into the page cache; the upload's checksums and HTTP), the snapshot and
# training, and the probe times 128 KiB: with less headroom than 2x a save could wait on
# zstd, and a codec barely fast enough would flip with the machine's load from save to save.
_HEADROOM = 2.0
# Threads encoding segments at once: also bounds compressed output held in memory.
ENCODERS = max(1, min(4, os.cpu_count() or 1))


def _encoding_cores() -> int:
    """The cores the encoders can count on: all but one of this process's share (the
    writer's: the kernel's part of the writes, the upload's checksums and HTTP, the event
    loop), at most ENCODERS. On a 2-core machine a local save's encoders counted on both
    cores, picked the plane codec for a 7% gain, and took 1.25x the raw save's time."""
    cores = _cores()
    return max(1, min(ENCODERS, cores - 1 if cores > 1 else 1))


def _cores() -> int:
    """The cores this process's encoders can count on: those it may run on, shared with
    the other processes of a multi-process job on this node (``LOCAL_WORLD_SIZE``, set by
    ``torchrun``), whose saves run at the same moment."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        sharing = 1
    return max(1, cores // sharing)


# Write speeds from saves this small are mostly latency: not recorded.
_MEASURED_FROM = 64 * MiB

_BANDWIDTH: dict[str, float] = {}  # bytes/s seen per target directory, for "auto"


@dataclass
class Encoded:
    """A chunk as stored: its codec, bytes (a view of the slab when raw) and checksums; or,
    with ``ref``, a chunk an earlier version's pack holds already (nothing to write)."""

    codec: str
    stored: memoryview | bytes
    stored_xxh3: int
    raw_xxh3: int
    ref: Ref | None = None


@dataclass(frozen=True)
class Ref:
    """Where an earlier version stored a chunk: its pack's key (relative to the
    checkpoint's directory) and the chunk as recorded there."""

    pack: str
    chunk: fmt.Chunk


# A chunk is known by its raw size and the xxh3-64 of its raw bytes.
Known = dict[tuple[int, int], Ref]


class Codecs:
    """The codec of every chunk of one save (``compression`` as :func:`save` takes it).

    With ``"auto"``, the probe of a storage's first chunk decides for all its chunks.
    Encoder threads call it at once: a storage whose first chunks are encoded together
    may be probed more than once, which costs time only (each chunk records its codec).
    """

    def __init__(
        self,
        compression: str | None,
        level: int,
        exclude: tuple[str, ...],
        where: str,
        object_store: bool,
    ) -> None:
        self.compression, self.level, self.exclude = compression, level, exclude
        self.where = where  # the target's directory: saves there share a measured speed
        # Until a save to this place has been measured: local disks and memory are fast,
        # object stores slow; compression pays where it produces bytes faster than these.
        self.bandwidth = _BANDWIDTH.get(where, 150e6 if object_store else 1.5e9)  # bytes/s
        # Per storage id: the codec "auto" chose, and for a plane codec the planes to compress.
        self._codecs: dict[int, tuple[str, int]] = {}
        self._warm: set[str] = set()  # codecs probed once already in this save
        # Codecs too slow for the target in this save: their storages stay raw unprobed
        # (a state has hundreds of storages, and probing each cost a local save 8% of its
        # time for nothing).
        self._slow: set[str] = set()

    def record_speed(self, written: int, seconds: float) -> None:
        """Remember how fast the target took this save's bytes, for the next save there."""
        if seconds > 0 and written >= _MEASURED_FROM:
            _BANDWIDTH[self.where] = written / seconds

    def codec_for(self, storage: SavedStorage, data: memoryview) -> str:
        """The codec for ``data``, a chunk of ``storage``."""
        return self._choose(storage, data)[0]

    def _choose(self, storage: SavedStorage, data: memoryview) -> tuple[str, int]:
        # The codec for ``data``, a chunk of ``storage``, and for a plane codec the planes
        # to compress.
        if self.compression is None or len(data) < _SMALL:
            return "raw", 0
        if any(fnmatch.fnmatchcase(storage.name, pattern) for pattern in self.exclude):
            return "raw", 0
        width = storage.dtype.itemsize
        codec = f"zstd+shuffle{width}" if width in (2, 4) else "zstd"
        if self.compression == "zstd":
            return codec, 0
        known = self._codecs.get(storage.id)
        if known is not None:
            return known
        # "auto": probe the first chunk we meet of this storage.
        sample = data[: min(len(data), _PROBE)]
        mask = 0
        if storage.dtype.is_floating_point and width in (2, 4):
            codec = f"zstd+planes{width}"
        if codec in self._slow:
            self._codecs[storage.id] = ("raw", 0)
            return "raw", 0
        if codec.startswith("zstd+planes"):
            mask = plane_mask(plane_ratios(sample, width, self.level))
            if not mask:  # no plane shrinks: nothing to gain
                self._codecs[storage.id] = ("raw", 0)
                return "raw", 0
        # CPU time of this thread, not wall time: the question is how fast a core encodes,
        # and a busy machine (a training step, another save) would otherwise make zstd look
        # slow and flip the decision from run to run.
        # The first probe of a codec in a save runs twice, timing the faster run: a cold
        # thread's first compression (context set-up, first-touch page faults) can take
        # 2-3x as long as the next and would keep everything raw.
        first = codec not in self._warm
        speed = 0.0
        for _ in range(2 if first else 1):
            started = time.thread_time()
            ratio = len(self._compress(sample, codec, mask)) / len(sample)
            speed = max(speed, len(sample) / max(time.thread_time() - started, 1e-6))
        self._warm.add(codec)
        keeps_up = speed * _encoding_cores() >= _HEADROOM * self.bandwidth
        if first and not keeps_up:
            # The careful probe (the faster of two runs) says the codec cannot keep up: not
            # one storage more is probed for it in this save.
            self._slow.add(codec)
        decision = (codec, mask) if ratio <= _WORTH and keeps_up else ("raw", 0)
        self._codecs[storage.id] = decision
        return decision

    def _compress(self, data: memoryview, codec: str, mask: int) -> bytes | bytearray:
        width = plane_width(codec)
        if width:
            return compress_planes(data, width, mask, self.level)
        return fmt.compress(data, codec, self.level)

    def encode(self, storage: SavedStorage, raw: memoryview, known: Known | None = None) -> Encoded:
        """``raw``, a chunk of ``storage``, as it will be stored (in a worker thread); a
        reference instead when ``known`` (chunks of earlier versions) has the same bytes."""
        raw_xxh3 = xxhash.xxh3_64_intdigest(raw)
        if known:
            ref = known.get((len(raw), raw_xxh3))
            if ref is not None:
                chunk = ref.chunk
                return Encoded(chunk.codec, b"", chunk.stored_xxh3, raw_xxh3, ref)
        codec, mask = self._choose(storage, raw)
        if codec != "raw":
            stored = self._compress(raw, codec, mask)
            if len(stored) < len(raw):
                view = memoryview(stored)
                return Encoded(codec, view, xxhash.xxh3_64_intdigest(view), raw_xxh3)
        return Encoded("raw", raw, raw_xxh3, raw_xxh3)

    def encode_structure(self, structure: bytes, offset: int) -> tuple[memoryview, fmt.Chunk]:
        """The pickled structure as it will be stored at ``offset`` (compressed if that
        pays), and its chunk."""
        digest = xxhash.xxh3_64_intdigest(structure)
        codec, stored = "raw", memoryview(structure)
        if self.compression is not None and len(structure) >= _SMALL:
            compressed = fmt.compress(stored, "zstd", self.level)
            if len(compressed) < len(structure):
                codec, stored = "zstd", memoryview(compressed)
        stored_digest = digest if codec == "raw" else xxhash.xxh3_64_intdigest(stored)
        return stored, fmt.Chunk(offset, len(stored), len(structure), codec, stored_digest, digest)
