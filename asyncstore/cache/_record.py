"""The disk tier's record: how one entry is laid out in a segment, and how it is checked.

A record holds a header (magic, format version, an xxh3-64 checksum, the lengths) followed
by the source (the store's :attr:`~asyncstore.Store.identity`), the key, the source's ETag
and the payload; the checksum covers everything after itself. Readers check all of it, so a
torn, truncated, foreign, older-format or bit-flipped record is never served: :func:`decode`
raises :class:`~asyncstore.errors.IntegrityError`, the tier drops the entry and the caller
refetches.
"""

from __future__ import annotations

import struct

import xxhash

from ..errors import IntegrityError

MAGIC = b"ASCE"
# 2: the source's identity in the name and the header, and the checksum over the whole
# header. Records of another version fail the version check: dropped as damaged, refetched.
VERSION = 2
# magic, version, xxh3-64 of everything after it; then payload, source, key and ETag lengths
HEADER = struct.Struct("<4sHQQIII")
CHECKED_FROM = struct.calcsize("<4sHQ")  # where the checksummed part begins


def encode_head(identity: bytes, key: str, payload: bytes, etag: str | None) -> bytes:
    """What precedes ``payload`` in its record: header, source, key, ETag.

    Kept apart from the payload so that a batch is appended without copying payloads into
    one buffer.
    """
    key_bytes = key.encode()
    etag_bytes = (etag or "").encode()
    lengths = HEADER.pack(
        MAGIC, VERSION, 0, len(payload), len(identity), len(key_bytes), len(etag_bytes)
    )[CHECKED_FROM:]
    checksum = xxhash.xxh3_64()
    for part in (lengths, identity, key_bytes, etag_bytes, payload):
        checksum.update(part)
    start = HEADER.pack(MAGIC, VERSION, checksum.intdigest(), 0, 0, 0, 0)[:CHECKED_FROM]
    return start + lengths + identity + key_bytes + etag_bytes


def decode(
    raw: bytes | bytearray | memoryview, identity: bytes, key: str
) -> tuple[bytes, str | None]:
    """The payload and ETag of the record ``raw``, read for ``key`` of the source ``identity``.

    Raises:
        IntegrityError: the record is damaged, of another format, or of another source or key.
    """
    # Anything unexpected in a file is damage: whatever fails while reading it (a length that
    # runs past the end, bytes that do not decode) must be dropped and refetched, not raised.
    try:
        view = memoryview(raw)
        digest, length, id_len, key_len, start = _header(view, key)
        if len(view) != start + length:
            raise IntegrityError(
                f"cache entry for {key!r} holds {len(view) - start} payload bytes, expected "
                f"{length}"
            )
        if xxhash.xxh3_64_intdigest(view[CHECKED_FROM:]) != digest:
            raise IntegrityError(f"cache entry for {key!r} does not match its checksum")
        etag = _etag(view, id_len, key_len, start, identity, key)
        return bytes(view[start:]), etag
    except IntegrityError:
        raise
    except Exception as exc:
        raise IntegrityError(f"cache entry for {key!r} cannot be decoded ({exc})") from exc


def decode_parts(
    head: bytes | bytearray | memoryview, payload: bytes, identity: bytes, key: str
) -> tuple[bytes, str | None] | None:
    """:func:`decode` for a record read in two parts: ``head``, as many bytes as its reader
    expected to precede the payload, and ``payload``, the rest, given back as it is (no
    copy). None if the record's header says that the payload starts elsewhere (the reader
    expected an ETag of another length): read it whole then.

    Raises:
        IntegrityError: as :func:`decode`.
    """
    try:
        view = memoryview(head)
        digest, length, id_len, key_len, start = _header(view, key)
        if start != len(view):
            return None
        if len(payload) != length:
            raise IntegrityError(
                f"cache entry for {key!r} holds {len(payload)} payload bytes, expected {length}"
            )
        checksum = xxhash.xxh3_64(view[CHECKED_FROM:])
        checksum.update(payload)
        if checksum.intdigest() != digest:
            raise IntegrityError(f"cache entry for {key!r} does not match its checksum")
        return payload, _etag(view, id_len, key_len, start, identity, key)
    except IntegrityError:
        raise
    except Exception as exc:
        raise IntegrityError(f"cache entry for {key!r} cannot be decoded ({exc})") from exc


def payload_start(head: bytes | bytearray | memoryview) -> int | None:
    """Where the payload of the record that begins with ``head`` starts, as its header says;
    None if ``head`` is too short to tell, or holds no header of this format (its reader
    then reads the record whole, and :func:`decode` says what is wrong)."""
    try:
        return _header(memoryview(head), "")[4]
    except IntegrityError:
        return None


def _header(view: memoryview, key: str) -> tuple[int, int, int, int, int]:
    # The header's checksum, payload length, source and key lengths, and where the payload
    # starts.
    if len(view) < HEADER.size:
        raise IntegrityError(f"cache entry for {key!r} is truncated ({len(view)} bytes)")
    magic, version, digest, length, id_len, key_len, etag_len = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise IntegrityError(f"cache entry for {key!r} has an unknown format")
    return digest, length, id_len, key_len, HEADER.size + id_len + key_len + etag_len


def _etag(
    view: memoryview, id_len: int, key_len: int, start: int, identity: bytes, key: str
) -> str | None:
    # The ETag, once the record's source and key are checked (after its checksum matched).
    at = HEADER.size
    if view[at : at + id_len] != identity:
        raise IntegrityError(f"cache entry for {key!r} belongs to another store")
    at += id_len
    if view[at : at + key_len] != key.encode():
        raise IntegrityError(f"cache entry for {key!r} belongs to another key")
    return bytes(view[at + key_len : start]).decode() or None
