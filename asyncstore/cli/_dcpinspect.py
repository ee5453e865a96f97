"""``asyncstore inspect`` of a distributed (DCP) checkpoint: the state's names (the fully
qualified names of ``.metadata``'s ``state_dict_metadata``), each one's shape, dtype and
bytes, and which rank objects hold it; each rank object's bytes. Read from ``.metadata`` and
the rank objects' footers and manifests alone: no tensor data."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..checkpoint import read_manifest
from ..checkpoint.engine import RANK_OBJECT, objects_named, read_metadata
from ..errors import IntegrityError, NotFound
from ..stores import open_store

__all__ = ["DistributedInfo", "RankObjectInfo", "StateItemInfo", "inspect_dcp"]


class StateItemInfo(msgspec.Struct, frozen=True):
    """One name of a distributed checkpoint's state.

    Attributes:
        name: its fully qualified name (``"model.layer.weight"``).
        kind: ``"tensor"``, or ``"value"`` for anything else (saved pickled).
        dtype: a tensor's element type (``"float32"``); ``None`` for a value.
        shape: a tensor's whole shape, every shard together; ``None`` for a value.
        nbytes: a tensor's bytes, whole; a value's pickled bytes.
        chunks: the pieces it was saved in (a sharded tensor: one per shard).
        ranks: the bytes of it each rank object holds, by the object's name.
    """

    name: str
    kind: Literal["tensor", "value"]
    dtype: str | None
    shape: list[int] | None
    nbytes: int
    chunks: int
    ranks: dict[str, int]


class RankObjectInfo(msgspec.Struct, frozen=True):
    """One rank object of a distributed checkpoint (``__<rank>_<save>.ckpt``).

    Attributes:
        name: its name in the checkpoint's directory.
        rank: the rank that wrote it.
        size: its bytes in storage.
        raw_bytes: the bytes of what it holds, uncompressed.
        stored_bytes: the bytes its chunks take in storage (compressed).
        items: how many of the state's pieces it holds.
    """

    name: str
    rank: int
    size: int
    raw_bytes: int
    stored_bytes: int
    items: int


class DistributedInfo(msgspec.Struct, frozen=True):
    """What ``inspect`` found in a distributed checkpoint.

    Attributes:
        url: its directory.
        format: ``"dcp"``.
        created: when its first rank object was saved (Unix seconds).
        size: the bytes of every file of it, ``.metadata`` included.
        raw_bytes: what its rank objects hold, uncompressed.
        stored_bytes: what its rank objects take in storage.
        items: the state's names, sorted.
        objects: its rank objects, by rank.
    """

    url: str
    format: Literal["dcp"]
    created: float | None
    size: int
    raw_bytes: int
    stored_bytes: int
    items: list[StateItemInfo]
    objects: list[RankObjectInfo]


async def inspect_dcp(url: str, options: dict[str, Any]) -> DistributedInfo:
    """Describe the distributed checkpoint whose directory is ``url``.

    Raises:
        NotFound: there is no complete checkpoint there (no ``.metadata``).
        IntegrityError: ``.metadata`` or a rank object's manifest is damaged, or a rank
            object it names is missing.
    """
    async with open_store(url, **options) as store:
        try:
            metadata = await read_metadata(store, "")
        except NotFound:
            raise NotFound(
                f"{store.url} holds no complete distributed checkpoint (no .metadata): the "
                "save did not finish, or the URL is wrong"
            ) from None
        sizes = {info.key: info.size async for info in store.list("")}
        manifests = {}
        for name in sorted(objects_named(metadata)):
            if name not in sizes or RANK_OBJECT.match(name) is None:
                raise IntegrityError(
                    f"{store.url}/{name} is missing: the checkpoint lost a rank's shards "
                    "(damaged, or deleted outside asyncstore)"
                )
            manifests[name] = await read_manifest((store, name))
        where = store.url
    entry_bytes = {
        (name, storage.name): storage.nbytes
        for name, manifest in manifests.items()
        for storage in manifest.storages
    }
    items = _items(metadata, entry_bytes)
    objects = []
    for name, manifest in manifests.items():
        match = RANK_OBJECT.match(name)
        assert match is not None
        held = sum(1 for place in (metadata.storage_data or {}).values() if place[0] == name)
        objects.append(
            RankObjectInfo(
                name=name,
                rank=int(match.group(1)),
                size=sizes[name],
                raw_bytes=manifest.raw_bytes,
                stored_bytes=manifest.stored_bytes,
                items=held,
            )
        )
    objects.sort(key=lambda o: (o.rank, o.name))
    created = [manifest.created for manifest in manifests.values()]
    return DistributedInfo(
        url=where,
        format="dcp",
        created=min(created) if created else None,
        size=sum(sizes.values()),
        raw_bytes=sum(o.raw_bytes for o in objects),
        stored_bytes=sum(o.stored_bytes for o in objects),
        items=items,
        objects=objects,
    )


def _items(metadata: Metadata, entry_bytes: dict[tuple[str, str], int]) -> list[StateItemInfo]:
    # Where each saved piece lies: (fqn, its offset) -> (rank object, entry).
    places: dict[tuple[str, tuple[int, ...] | None], tuple[str, str]] = {}
    for index, place in (metadata.storage_data or {}).items():
        offset = None if index.offset is None else tuple(index.offset)
        places[(index.fqn, offset)] = place
    items = []
    for fqn, meta in sorted(metadata.state_dict_metadata.items()):
        ranks: dict[str, int] = {}
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            for chunk in meta.chunks:
                place = places.get((fqn, tuple(chunk.offsets)))
                if place is not None:
                    nbytes = math.prod(chunk.sizes) * dtype.itemsize
                    ranks[place[0]] = ranks.get(place[0], 0) + nbytes
            items.append(
                StateItemInfo(
                    name=fqn,
                    kind="tensor",
                    dtype=str(dtype).removeprefix("torch."),
                    shape=list(meta.size),
                    nbytes=math.prod(meta.size) * dtype.itemsize,
                    chunks=len(meta.chunks),
                    ranks=ranks,
                )
            )
            continue
        place = places.get((fqn, None))
        if place is not None:
            ranks[place[0]] = entry_bytes.get(place, 0)
        items.append(
            StateItemInfo(
                name=fqn,
                kind="value",
                dtype=None,
                shape=None,
                nbytes=sum(ranks.values()),
                chunks=len(ranks),
                ranks=ranks,
            )
        )
    return items
