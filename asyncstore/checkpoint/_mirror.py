"""Copying a checkpoint version to a mirror store: streamed in bounded memory, and checked
before it counts as mirrored: against the MD5 the server reports (S3 ETags), or else read
back and compared. A
differential version's packs go first (those the mirror lacks), the version last: the
mirror never holds a version whose packs are not all there."""

from __future__ import annotations

import xxhash

from ..errors import IntegrityError, NotFound
from ..stores import CheckedUploads, Store

__all__ = ["COPY_CHUNK_BYTES", "copy_version", "copy_object"]

COPY_CHUNK_BYTES = 8 << 20
"""Bytes read and written at a time: large enough for few requests per version, small
enough that an upload beside training holds little memory (plus the S3 writer's parts)."""


async def copy_version(source: Store, target: Store, key: str, packs: list[str]) -> int:
    """Copy the version ``key`` and the ``packs`` it points into from ``source`` to
    ``target``, each checked; return the bytes copied.

    A pack the target holds already at the same size is not copied again: packs are never
    rewritten, and each was checked when it was copied.

    Raises:
        NotFound: ``key`` or a pack is no longer in ``source`` (deleted meanwhile).
        IntegrityError: a copy read back differs; it was deleted from ``target``.
        StoreUnavailable, StoreError: a store failed.
    """
    copied = 0
    for pack in packs:
        size = (await source.stat(pack)).size
        try:
            if (await target.stat(pack)).size == size:
                continue
        except NotFound:
            pass
        copied += await copy_object(source, target, pack)
    return copied + await copy_object(source, target, key)


async def copy_object(source: Store, target: Store, key: str) -> int:
    """Copy the object ``key`` from ``source`` to ``target`` and check the copy; return its
    size.

    The target's writer makes the copy appear whole or not at all. Where the target can
    tell (an S3 ETag that is an MD5 of the parts, see :class:`CheckedUploads`), the MD5 of
    what was sent is compared with it; otherwise the copy is read back and its xxh3
    compared with the bytes sent.

    Raises:
        NotFound: ``key`` is no longer in ``source`` (deleted meanwhile).
        IntegrityError: the copy read back differs; it was deleted from ``target``.
        StoreUnavailable, StoreError: a store failed.
    """
    sent = xxhash.xxh3_64()
    size = 0
    writer = target.open_writer(key)
    checked = writer if isinstance(writer, CheckedUploads) else None
    if checked is not None:
        checked.track_md5()
    async with source.open_reader(key, chunk_bytes=COPY_CHUNK_BYTES) as reader, writer:
        async for chunk in reader:
            sent.update(chunk)
            size += len(chunk)
            await writer.write(chunk)
    if checked is not None:
        matches = checked.md5_matches
        if matches:
            return size  # the server stored exactly the bytes sent
        if matches is False:
            await target.delete(key)
            raise IntegrityError(
                f"{target.url}/{key}: the mirror's ETag is not the MD5 of the bytes sent "
                f"from {source.url}/{key}; it was deleted and is uploaded again"
            )
    back = xxhash.xxh3_64()
    read = 0
    async with target.open_reader(key, chunk_bytes=COPY_CHUNK_BYTES) as reader:
        async for chunk in reader:
            back.update(chunk)
            read += len(chunk)
    if read != size or back.intdigest() != sent.intdigest():
        await target.delete(key)
        raise IntegrityError(
            f"{target.url}/{key}: the copy read back differs from {source.url}/{key} "
            f"({read} bytes against {size}); it was deleted and is uploaded again"
        )
    return size
