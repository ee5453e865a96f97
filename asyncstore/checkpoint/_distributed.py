"""Distributed checkpoints on a store: the layout ``asyncstore.torch.dcp`` writes, and what a
:class:`Checkpointer` needs to list, verify, retain and clean one up.

A distributed checkpoint is a directory. Each rank that has items writes them as one
asyncstore checkpoint object, ``__<rank>_<save>.ckpt``; once every rank has written, the
coordinator writes ``.metadata`` (``torch.distributed.checkpoint``'s ``Metadata``, with
where each item lies). The checkpoint is complete once ``.metadata`` is there, and it is made
of the rank objects that ``.metadata`` names and nothing else: ``<save>`` is new for every
save, so a save into a directory that holds a checkpoint never writes over an object the
current ``.metadata`` names; that checkpoint stays whole until the new ``.metadata``
replaces it (atomically), and its objects are removed after: those that are rank objects a
save wrote there (named so, and starting with the checkpoint magic; see
:func:`is_rank_object`), since a ``.metadata`` is checksummed, not proof of who wrote it.

``.metadata`` is ``MAGIC``, the xxh3-64 of the pickle (little-endian), then the pickle. It is
read with an unpickler that builds only what DCP's metadata is made of (its dataclasses,
``torch.Size``, dtypes, layouts; see :mod:`._dcpunpickle`): a crafted file cannot run code,
and a damaged one fails its checksum. This module imports torch only to read or write a
``.metadata``: listing a run's versions does not need it.
"""

from __future__ import annotations

import pickle
import re
import struct
from typing import TYPE_CHECKING

import xxhash

from ..errors import IntegrityError, NotFound
from ..stores import CleansUpWrites, Store
from . import _format as fmt

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "METADATA",
    "RANK_OBJECT",
    "decode_metadata",
    "encode_metadata",
    "is_rank_object",
    "objects_named",
    "read_metadata",
    "remove_checkpoint",
    "remove_unnamed",
]

METADATA = ".metadata"
MAGIC = b"ASYNCDCP"
_HEADER = struct.Struct("<8sQ")

RANK_OBJECT = re.compile(r"^__(\d+)_([0-9a-f]{8,32})\.ckpt$")
"""A rank's object: ``__<rank>_<save>.ckpt``, ``<save>`` in hex, new for every save."""


def encode_metadata(metadata: Metadata) -> bytes:
    """``.metadata``'s bytes for ``metadata``."""
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(MAGIC, xxhash.xxh3_64_intdigest(data)) + data


def decode_metadata(data: bytes, where: str) -> Metadata:
    """The ``Metadata`` in ``.metadata``'s bytes (read from ``where``, for messages).

    Raises:
        IntegrityError: the bytes are damaged, or are not asyncstore's DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    from ._dcpunpickle import MetadataUnpickler

    if len(data) < _HEADER.size or data[: len(MAGIC)] != MAGIC:
        raise IntegrityError(
            f"{where} is not asyncstore DCP metadata (it does not start with {MAGIC!r}): "
            "a checkpoint written by another tool, or a damaged file"
        )
    _, digest = _HEADER.unpack_from(data)
    body = memoryview(data)[_HEADER.size :]
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise IntegrityError(f"{where} does not match its checksum: the file is damaged")
    try:
        metadata = MetadataUnpickler(bytes(body), where).load()
    except IntegrityError:
        raise
    except Exception as exc:  # a pickle that passed its checksum but does not build
        raise IntegrityError(f"{where} does not unpickle ({exc!r})") from exc
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"{where} holds {type(metadata).__name__}, not DCP metadata")
    return metadata


def objects_named(metadata: Metadata) -> set[str]:
    """The rank objects ``metadata`` says its items lie in."""
    names = set()
    for place in (metadata.storage_data or {}).values():
        if isinstance(place, tuple) and len(place) == 2 and isinstance(place[0], str):
            names.add(place[0])
    return names


async def read_metadata(store: Store, prefix: str) -> Metadata:
    """The ``Metadata`` of the checkpoint at ``prefix`` (a directory key ending in ``/``).

    Raises:
        NotFound: there is no ``.metadata``: no complete checkpoint there.
        IntegrityError: it is damaged.
    """
    key = prefix + METADATA
    return decode_metadata(await store.get(key), f"{store.url}/{key}")


async def is_rank_object(store: Store, prefix: str, name: str) -> bool:
    """Whether ``name`` (as a ``.metadata`` names it) is a rank object that a save wrote
    directly under ``prefix``: named ``__<rank>_<save>.ckpt``, and starting with the
    checkpoint magic (one ranged read of its first 8 bytes). ``False`` too when it is gone.

    A ``.metadata`` is only checksummed, not proof of who wrote it: one crafted or copied
    from elsewhere may name the user's files (``notes.txt``, ``../precious.txt``, a file of
    theirs named like a rank object), which nothing may delete on its word.
    """
    if not RANK_OBJECT.match(name) or "/" in name or ".." in name:
        return False
    try:
        head = await store.get(prefix + name, 0, len(fmt.MAGIC))
    except NotFound:
        return False
    return head == fmt.MAGIC


def _ours(name: str) -> bool:
    # Only what a save writes is ever removed: a checkpoint directory given by hand may
    # hold the user's own files.
    return name == METADATA or RANK_OBJECT.match(name) is not None


async def remove_unnamed(store: Store, prefix: str, keep: set[str]) -> int:
    """Remove the rank objects and ``.metadata`` under ``prefix`` (a directory key ending
    in ``/``, or ``""``) whose names are not in ``keep``: earlier saves' rank objects, and
    what writes killed mid-way left. Other files are left alone. Returns how many items
    were removed."""
    removed = 0
    names = [info.key[len(prefix) :] async for info in store.list(prefix)]
    for name in names:
        if _ours(name) and name not in keep:
            await store.delete(prefix + name)
            removed += 1
    if isinstance(store, CleansUpWrites):
        for key in await store.abandoned_writes(prefix):
            name = key[len(prefix) :]
            if _ours(name) and name not in keep:
                removed += await store.clean_up_writes(key)
    return removed


async def remove_checkpoint(store: Store, prefix: str) -> int:
    """Remove the checkpoint at ``prefix``: ``.metadata`` first (it stops being a
    checkpoint at once), then its rank objects and leftovers; returns how many items."""
    await store.delete(prefix + METADATA)
    return 1 + await remove_unnamed(store, prefix, set())
