"""A pack's own end: the index of the chunks it holds and a fixed-size trailer, so that a
pack can be recognised, and told whole, from a few bytes at its end.

Layout (see docs/format.md, "Version 2: packs")::

    ASYNCPAK [chunk][chunk]... [index][trailer]

- ``index``: msgpack, an array of ``[offset, stored, stored_xxh3]``, one per chunk in file
  order.
- ``trailer``: :data:`TRAILER_SIZE` bytes: ``ASYNCPAK``, the trailer version, flags, the
  index's offset, length and xxh3-64, then the xxh3-64 of those 40 bytes.

A pack's *identity* is its size and its index's xxh3-64 (:class:`PackId`): the manifest of
each version that points into a pack records it, and a save that would point into the pack
again, or a copy that would skip it, first checks the pack it finds against it. Packs of
earlier releases have no trailer and no recorded identity: they are read as before, never
built on again.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgspec
import xxhash

from ..errors import IntegrityError, NotFound
from ..stores import Store
from . import _format as fmt

__all__ = ["TRAILER_SIZE", "PackId", "encode_end", "read_id", "whole"]

_TRAILER = struct.Struct("<8sIIQQQ")  # magic, version, flags, index offset, length, xxh3
TRAILER_SIZE = _TRAILER.size + 8  # + the trailer's own xxh3-64
_VERSION = 1


class PackId(NamedTuple):
    """What a pack must be for a version to point into it: its size in bytes and the
    xxh3-64 of its chunk index (a manifest's ``pack_ids`` holds one per pack)."""

    size: int
    index_xxh3: int


def encode_end(chunks: list[fmt.Chunk], position: int) -> tuple[bytes, PackId]:
    """The index and trailer that end a pack whose chunks are ``chunks`` and which holds
    ``position`` bytes before them; and the pack's identity once they are written."""
    index = msgspec.msgpack.encode([(c.offset, c.stored, c.stored_xxh3) for c in chunks])
    digest = xxhash.xxh3_64_intdigest(index)
    body = _TRAILER.pack(fmt.PACK_MAGIC, _VERSION, 0, position, len(index), digest)
    end = index + body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    return end, PackId(position + len(end), digest)


def _decode_trailer(data: bytes, size: int, where: str) -> tuple[PackId, int]:
    # The identity the trailer states, and where the index starts.
    if len(data) != TRAILER_SIZE or data[:8] != fmt.PACK_MAGIC:
        raise IntegrityError(f"{where} does not end like a pack: it is truncated or damaged")
    body, digest = data[: _TRAILER.size], int.from_bytes(data[_TRAILER.size :], "little")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise IntegrityError(f"{where}: the pack's trailer does not match its checksum")
    _, version, _, offset, length, index_xxh3 = _TRAILER.unpack(body)
    if (
        version != _VERSION
        or offset < len(fmt.PACK_MAGIC)
        or offset + length != size - TRAILER_SIZE
    ):
        raise IntegrityError(f"{where}: the pack's trailer describes its index impossibly")
    return PackId(size, index_xxh3), offset


async def read_id(store: Store, key: str) -> PackId:
    """The identity of the pack ``key`` as it is in ``store`` now, from its trailer.

    Raises:
        NotFound: there is no such pack.
        IntegrityError: it has no whole trailer and index (truncated, damaged, or written
            by an earlier release).
    """
    size = (await store.stat(key)).size
    where = f"{store.url}/{key}"
    if size < len(fmt.PACK_MAGIC) + TRAILER_SIZE:
        raise IntegrityError(f"{where} is {size} bytes: too short to be a whole pack")
    trailer = await store.get(key, size - TRAILER_SIZE, size)
    found, offset = _decode_trailer(trailer, size, where)
    # The index itself (a few dozen bytes per chunk), against the checksum the trailer holds:
    # a pack damaged at its end does not pass on the strength of an intact trailer alone.
    index = await store.get(key, offset, size - TRAILER_SIZE)
    if len(index) != size - TRAILER_SIZE - offset or (
        xxhash.xxh3_64_intdigest(index) != found.index_xxh3
    ):
        raise IntegrityError(f"{where}: the pack's index does not match its checksum")
    return found


async def whole(store: Store, key: str, expected: PackId | None) -> str | None:
    """``None`` when the pack ``key`` in ``store`` is the one ``expected`` describes;
    otherwise why not (missing, truncated, replaced, or no identity to check against)."""
    if expected is None:
        return "no identity recorded (written by an earlier release)"
    try:
        found = await read_id(store, key)
    except NotFound:
        return "missing"
    except IntegrityError as exc:
        return str(exc)
    if found != expected:
        return (
            f"{store.url}/{key} is {found.size} bytes with index {found.index_xxh3:016x}, "
            f"not the {expected.size} bytes with index {expected.index_xxh3:016x} recorded"
        )
    return None
