"""The checkpoint format: version 1, one object written as a single stream; version 2,
the same object whose chunks may lie in *packs*, objects beside it.

Layout (see docs/format.md)::

    [header][structure][chunk][chunk]...[manifest][footer]

- ``header``: the 8 bytes ``ASYNCKPT``, so that a damaged footer is told from another format.
- ``structure``: the saved object, pickled with a persistent id for every tensor storage
  (stored raw or zstd-compressed, like a chunk).
- chunks: the bytes of each storage, split every ``chunk_bytes``; each chunk is raw, zstd,
  zstd after a byte shuffle by element width, or (version 3) split into byte planes of which
  only those that compress are zstd frames (see ._planes).
- ``manifest``: msgpack (msgspec) :class:`Manifest`: where every chunk lies, its codec, sizes and
  xxh3-64 digests, the user's metadata and a digest over all chunk digests.
- ``footer``: :data:`FOOTER_SIZE` bytes, fixed: magic, format version, where the manifest
  lies and its digest, and the footer's own digest.

Version 2 (differential saves) adds, in the manifest, the packs' keys (relative to the
checkpoint's directory) and, per storage, which pack holds each chunk. A pack is
``ASYNCPAK`` followed by chunks; it has no manifest of its own and is never rewritten, so
later checkpoints can point into it. Version 3 adds the byte-plane codecs
(:data:`._planes.PLANE_CODECS`); a reader of version 2 refuses such a file by its footer,
asking for an upgrade, rather than finding a codec it does not know. A writer uses the
oldest version that holds what it writes (:func:`version_for`): version 1 whenever no chunk
lies in a pack and none is plane-coded, so that such checkpoints stay readable by every
release.

Everything a load uses is covered by a checksum: the footer by its own, the manifest by the
footer's, each chunk (and the structure) by the manifest's, checked before decoding and again
after. A reader needs the footer, the manifest, then only the chunks it wants (ranged reads).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import xxhash
import zstandard

from ..errors import IntegrityError, UnsafeCheckpoint
from ._planes import PLANE_CODECS, decode_planes, plane_width, zstd_into

__all__ = [
    "FORMAT_VERSION",
    "PACK_MAGIC",
    "PACK_NAME",
    "INLINE",
    "FOOTER_SIZE",
    "Chunk",
    "Storage",
    "Manifest",
    "Footer",
    "encode_footer",
    "decode_footer",
    "read_manifest_of",
    "encode_manifest",
    "decode_manifest",
    "shuffle",
    "unshuffle",
    "CODECS",
    "PLANE_CODECS",
    "version_for",
]

MAGIC = b"ASYNCKPT"
PACK_MAGIC = b"ASYNCPAK"
FORMAT_VERSION = 3
INLINE = -1  # a chunk's pack index when it lies in the checkpoint object itself
# A pack's key, relative to the checkpoint's directory: a crafted manifest cannot point
# a load anywhere else.
PACK_NAME = re.compile(r"^packs/[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.pack$")
_FOOTER = struct.Struct("<8sIIQQQ")  # magic, version, flags, manifest offset, length, xxh3
FOOTER_SIZE = _FOOTER.size + 8  # + the footer's own xxh3-64

CODECS = ("raw", "zstd", "zstd+shuffle2", "zstd+shuffle4", "zstd+shuffle8", *PLANE_CODECS)

# The most a zstd frame can expand: a block decodes to at most 128 KiB and takes at least
# 4 bytes (an RLE block: a 3-byte header and the byte repeated). A chunk claiming more raw
# bytes than that cannot be genuine, whatever its checksums say.
ZSTD_MAX_RATIO = (128 * 1024) // 4


class Chunk(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One stored piece of a storage (or of the structure).

    Encoded as an array, the same in every format version (a chunk in a pack is marked in
    its :class:`Storage`).
    """

    offset: int  # where its stored bytes start in the checkpoint object (or its pack)
    stored: int  # stored (possibly compressed) size
    raw: int  # size after decoding
    codec: str  # one of CODECS
    stored_xxh3: int  # of the stored bytes, checked before decoding
    raw_xxh3: int  # of the decoded bytes, checked after


class Storage(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A tensor storage: its bytes, in chunks, and what is needed to rebuild it."""

    id: int  # the persistent id the structure refers to it by
    nbytes: int
    dtype: str  # element type of its first reference ("float32"), for the byte shuffle
    location: str  # device it was saved from ("cpu", "cuda:0"; "meta": no chunks)
    name: str  # the entry that first referenced it, for messages
    # Tuples, not lists: a load holds one Storage per tensor until it ends, and tuples of
    # untracked items leave the cyclic collector's lists (so do Storage and Chunk, gc=False:
    # they hold no references that could form a cycle), which a state of many small
    # tensors would otherwise fill, at a full collection per few thousand tensors.
    chunks: tuple[Chunk, ...]
    # Version 2: for each chunk, the index in Manifest.packs of the pack holding it, or
    # INLINE. Empty (and not written) when every chunk is inline.
    packs: tuple[int, ...] = ()

    def pack_of(self, index: int) -> int:
        """The pack index of chunk ``index`` (``INLINE``: in the checkpoint object)."""
        return self.packs[index] if self.packs else INLINE


class Manifest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Everything a load needs besides the chunks themselves."""

    format: int
    created: float
    metadata: dict[str, Any]
    structure: Chunk
    storages: list[Storage]
    # For a saved dict: each top-level key's storage ids, so a partial load reads only those.
    entries: dict[str, list[int]] | None
    raw_bytes: int
    stored_bytes: int
    digest: int  # xxh3-64 over every chunk's stored digest, structure first, in file order
    # Version 2: the keys of the packs chunks lie in, relative to the checkpoint's directory.
    packs: list[str] = msgspec.field(default_factory=list)
    # Version 2, since asyncstore 0.1.0: for each pack, its size and the xxh3-64 of its
    # chunk index (see ._packfile), checked before a later save points into it again.
    # Absent in earlier manifests: their packs are read, never built on.
    pack_ids: list[tuple[int, int]] = msgspec.field(default_factory=list)


class Footer(msgspec.Struct, frozen=True):
    """The fixed-size end of a checkpoint."""

    version: int
    flags: int
    manifest_offset: int
    manifest_length: int
    manifest_xxh3: int


def encode_footer(footer: Footer) -> bytes:
    """The footer's bytes (``FOOTER_SIZE`` of them), ending in their own xxh3 checksum."""
    body = _FOOTER.pack(
        MAGIC,
        footer.version,
        footer.flags,
        footer.manifest_offset,
        footer.manifest_length,
        footer.manifest_xxh3,
    )
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def decode_footer(data: bytes, where: str) -> Footer | None:
    """The footer, or None when ``data`` does not end like a checkpoint of this library.

    Raises:
        IntegrityError: it has the magic but is damaged, or is from a newer format version.
    """
    if len(data) != FOOTER_SIZE or data[:8] != MAGIC:
        return None
    body, digest = data[: _FOOTER.size], int.from_bytes(data[_FOOTER.size :], "little")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise IntegrityError(f"{where}: the checkpoint's footer does not match its checksum")
    _, version, flags, offset, length, manifest_digest = _FOOTER.unpack(body)
    if version > FORMAT_VERSION:
        raise IntegrityError(
            f"{where} is a version {version} checkpoint; this asyncstore reads up to version "
            f"{FORMAT_VERSION}: upgrade asyncstore to load it"
        )
    return Footer(version, flags, offset, length, manifest_digest)


_manifest_decoder = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as msgpack; the footer records its offset, length and checksum."""
    return msgspec.msgpack.encode(manifest)


async def read_manifest_of(
    read: Callable[[int, int], Awaitable[bytes]], size: int, where: str
) -> Manifest | None:
    """The verified manifest of the checkpoint object of ``size`` bytes that ``read(start,
    end)`` reads: its footer, then its manifest (two ranged reads); ``None`` for an object
    that is not an asyncstore checkpoint.

    Raises:
        IntegrityError: the footer points past the object's end, or the manifest is damaged.
    """
    if size < FOOTER_SIZE:
        return None
    footer = decode_footer(await read(size - FOOTER_SIZE, size), where)
    if footer is None:
        return None
    end = footer.manifest_offset + footer.manifest_length
    if end > size - FOOTER_SIZE:
        raise IntegrityError(f"{where}: the footer points past the end of the checkpoint")
    return decode_manifest(await read(footer.manifest_offset, end), footer, where)


def decode_manifest(data: bytes, footer: Footer, where: str) -> Manifest:
    """The manifest in ``data``, checked against the footer's checksum first.

    Raises:
        IntegrityError: the bytes do not match the checksum, or are not a valid manifest.
    """
    if xxhash.xxh3_64_intdigest(data) != footer.manifest_xxh3:
        raise IntegrityError(f"{where}: the checkpoint's manifest does not match its checksum")
    try:
        manifest = _manifest_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise IntegrityError(f"{where}: the checkpoint's manifest is malformed ({exc})") from None
    if manifest.format != footer.version:
        raise IntegrityError(
            f"{where}: the manifest says format {manifest.format}, the footer {footer.version}"
        )
    if manifest.format < 2 and (manifest.packs or any(s.packs for s in manifest.storages)):
        raise IntegrityError(f"{where}: a version 1 manifest names packs")
    if manifest.format < 3 and any(
        c.codec in PLANE_CODECS for s in manifest.storages for c in s.chunks
    ):
        raise IntegrityError(f"{where}: a version {manifest.format} manifest names plane codecs")
    if digest_of(manifest) != manifest.digest:
        raise IntegrityError(f"{where}: the checkpoint's chunk digest does not match")
    _check_layout(manifest, footer.manifest_offset, where)
    return manifest


def _check_layout(manifest: Manifest, end: int, where: str) -> None:
    # A manifest's checksum says it was not damaged, not that it was written by us: check
    # that everything it points to lies inside the object and adds up, before anything is
    # allocated or read from it.
    def chunk_ok(chunk: Chunk, what: str, pack: int = INLINE) -> None:
        if (
            chunk.codec not in CODECS
            or min(chunk.offset, chunk.stored, chunk.raw) < 0
            or chunk.offset < len(MAGIC)
            or (pack == INLINE and chunk.offset + chunk.stored > end)
            or not INLINE <= pack < len(manifest.packs)
            or (chunk.codec == "raw" and chunk.stored != chunk.raw)
        ):
            raise IntegrityError(f"{where}: the manifest describes {what} impossibly")
        if chunk.raw > chunk.stored * ZSTD_MAX_RATIO:
            # Checked before anything of that size is allocated (a bomb of a few bytes).
            raise UnsafeCheckpoint(
                f"{where}: the manifest says {what} decodes to {chunk.raw:,} bytes from "
                f"{chunk.stored:,} stored, more than zstd can expand ({ZSTD_MAX_RATIO:,}x): "
                "the file was crafted or damaged; load an earlier checkpoint"
            )

    for name in manifest.packs:
        if not isinstance(name, str) or not PACK_NAME.match(name):
            raise IntegrityError(f"{where}: the manifest names a pack {name!r} impossibly")
    if manifest.pack_ids and (
        len(manifest.pack_ids) != len(manifest.packs)
        or any(min(pack_id) < 0 for pack_id in manifest.pack_ids)
    ):
        raise IntegrityError(f"{where}: the manifest describes its packs' identities impossibly")
    chunk_ok(manifest.structure, "the pickled structure")
    ids = set()
    for storage in manifest.storages:
        what = f"tensor {storage.name!r}"
        if (
            storage.id < 0
            or storage.id in ids
            or storage.nbytes < 0
            or (storage.packs and len(storage.packs) != len(storage.chunks))
        ):
            raise IntegrityError(f"{where}: the manifest describes {what} impossibly")
        ids.add(storage.id)
        for index, chunk in enumerate(storage.chunks):
            chunk_ok(chunk, what, storage.pack_of(index))
        if storage.location == "meta":
            # A meta storage has a size and no bytes: it is recorded without chunks.
            if storage.chunks:
                raise IntegrityError(
                    f"{where}: the manifest gives chunks to {what}, saved on 'meta' (a device "
                    "without data): the checkpoint is damaged or crafted"
                )
        elif sum(chunk.raw for chunk in storage.chunks) != storage.nbytes:
            raise IntegrityError(f"{where}: the chunks of {what} do not add up to its size")
    for key, used in (manifest.entries or {}).items():
        if not set(used) <= ids:
            raise IntegrityError(f"{where}: entry {key!r} names storages the manifest lacks")


def version_for(packs: bool, codecs: set[str]) -> int:
    """The oldest format version that holds a checkpoint with chunks in packs (``packs``)
    and chunks of ``codecs``: every reader of that version or later reads it."""
    if codecs & set(PLANE_CODECS):
        return 3
    return 2 if packs else 1


def digest_of(manifest: Manifest) -> int:
    """The whole-checkpoint digest: xxh3-64 over every chunk's stored digest, in file order
    (the checkpoint object's chunks, then each pack's, by pack index)."""
    chunks = [(INLINE, manifest.structure.offset, manifest.structure.stored_xxh3)]
    for storage in manifest.storages:
        for index, chunk in enumerate(storage.chunks):
            chunks.append((storage.pack_of(index), chunk.offset, chunk.stored_xxh3))
    chunks.sort()
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for _, _, d in chunks))


# -- codecs ----------------------------------------------------------------------------------


def shuffle(data: memoryview | bytearray, width: int) -> bytearray:
    """Group the bytes of ``width``-byte elements by position: all first bytes, then all
    second bytes…; exponents and signs of floats then sit together and compress well.
    A tail shorter than an element is kept as it is."""
    import torch

    out = bytearray(len(data))
    whole = len(data) - len(data) % width
    if whole:
        target = torch.frombuffer(out, dtype=torch.uint8, count=whole)
        if width == 2:
            _split2(torch.frombuffer(data, dtype=torch.int16, count=whole // 2), target)
        elif width == 4:
            # Two 16-bit halves first, then the bytes of each: element-wise operations,
            # several times faster than a transposing copy with so narrow a row.
            words = torch.frombuffer(data, dtype=torch.int32, count=whole // 4)
            halves = torch.empty(whole // 2, dtype=torch.int16)
            count = whole // 4
            halves[:count].copy_(torch.bitwise_and(words, 0xFFFF))
            halves[count:].copy_(torch.bitwise_and(torch.bitwise_right_shift(words, 16), 0xFFFF))
            _split2(halves[:count], target[: whole // 2])
            _split2(halves[count:], target[whole // 2 :])
        else:
            elements = torch.frombuffer(data, dtype=torch.uint8, count=whole).view(-1, width)
            target.view(width, -1).copy_(elements.t())
    out[whole:] = data[whole:]
    return out


def _split2(words: Any, out: Any) -> None:
    # 16-bit words -> their low bytes, then their high bytes.
    import torch

    count = words.numel()
    out[:count].copy_(torch.bitwise_and(words, 0xFF))
    out[count:].copy_(torch.bitwise_and(torch.bitwise_right_shift(words, 8), 0xFF))


def _join2(planes: Any) -> Any:
    # Low bytes then high bytes -> 16-bit words (the inverse of _split2).
    import torch

    count = planes.numel() // 2
    low = planes[:count].to(torch.int16)
    high = planes[count:].to(torch.int16)
    return torch.bitwise_or(low, torch.bitwise_left_shift(high, 8))


def unshuffle(data: bytearray, width: int, out: memoryview) -> None:
    """Undo :func:`shuffle` into ``out`` (``len(data)`` bytes)."""
    import torch

    whole = len(data) - len(data) % width
    if whole:
        planes = torch.frombuffer(data, dtype=torch.uint8, count=whole)
        if width == 2:
            torch.frombuffer(out, dtype=torch.int16, count=whole // 2).copy_(_join2(planes))
        elif width == 4:
            low = torch.bitwise_and(_join2(planes[: whole // 2]).to(torch.int32), 0xFFFF)
            high = torch.bitwise_left_shift(_join2(planes[whole // 2 :]).to(torch.int32), 16)
            words = torch.frombuffer(out, dtype=torch.int32, count=whole // 4)
            words.copy_(torch.bitwise_or(low, high))
        else:
            elements = torch.frombuffer(out, dtype=torch.uint8, count=whole).view(-1, width)
            elements.copy_(planes.view(width, -1).t())
    out[whole : len(data)] = data[whole:]


def compress(data: memoryview, codec: str, level: int) -> bytes:
    """Encode ``data`` with ``codec`` ("zstd" or "zstd+shuffle<width>"; the plane codecs
    are encoded by :func:`._planes.compress_planes`)."""
    assert codec not in PLANE_CODECS, codec
    width = _width(codec)
    payload: bytearray | memoryview = shuffle(data, width) if width else data
    return zstandard.ZstdCompressor(level=level).compress(payload)


def decode_into(stored: bytes | memoryview, codec: str, out: memoryview) -> None:
    """Decode ``stored`` into ``out``, which must be exactly the raw size.

    Raises:
        IntegrityError: the bytes do not decode to exactly ``len(out)`` bytes (the caller
            adds where).
    """
    if codec == "raw":
        if len(stored) != len(out):
            raise IntegrityError(f"it holds {len(stored)} bytes, expected {len(out)}")
        out[:] = stored
        return
    if codec not in CODECS:
        raise IntegrityError(f"its codec {codec!r} is unknown")
    if codec in PLANE_CODECS:
        decode_planes(stored, plane_width(codec), out)
        return
    width = _width(codec)
    target = bytearray(len(out)) if width else out
    zstd_into(stored, memoryview(target), "it")
    if width:
        assert isinstance(target, bytearray)
        unshuffle(target, width, out)


def _width(codec: str) -> int:
    return int(codec.removeprefix("zstd+shuffle")) if codec.startswith("zstd+shuffle") else 0
