"""Copying a checkpoint version to a mirror store: streamed in bounded memory, hashed on
the way, then read back from the mirror and compared before it counts as mirrored."""

from __future__ import annotations

import xxhash

from ..errors import IntegrityError
from ..stores import Store

__all__ = ["COPY_CHUNK_BYTES", "copy_version"]

COPY_CHUNK_BYTES = 8 << 20
"""Bytes read and written at a time: large enough for few requests per version, small
enough that an upload beside training holds little memory (plus the S3 writer's parts)."""


async def copy_version(source: Store, target: Store, key: str) -> int:
    """Copy the object ``key`` from ``source`` to ``target`` and check the copy; return its
    size.

    The target's writer makes the copy appear whole or not at all. The copy is then read
    back and its xxh3 compared with the bytes sent.

    Raises:
        NotFound: ``key`` is no longer in ``source`` (deleted meanwhile).
        IntegrityError: the copy read back differs; it was deleted from ``target``.
        StoreUnavailable, StoreError: a store failed.
    """
    sent = xxhash.xxh3_64()
    size = 0
    async with (
        source.open_reader(key, chunk_bytes=COPY_CHUNK_BYTES) as reader,
        target.open_writer(key) as writer,
    ):
        async for chunk in reader:
            sent.update(chunk)
            size += len(chunk)
            await writer.write(chunk)
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
