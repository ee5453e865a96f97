"""What a checkpoint holds, from its manifest and pickled structure alone: its tensors'
dtypes, shapes, codecs and chunks, without reading a byte of tensor data.

A differential version keeps its chunks in packs beside it (see :mod:`._packs`): the pack
its own save wrote is named after it (``packs/step-000001000-<token>.pack``); a chunk in any
other pack was written by an earlier version and is counted as *shared*.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import msgspec
import torch

from .._concurrency import to_thread
from ..errors import IntegrityError
from . import _format as fmt
from ._load import storage_loader
from ._packs import PACKS
from ._reader import ChunkReader, manifest_of
from ._target import open_source, resolve
from ._unpickle import RestrictedUnpickler

__all__ = ["CheckpointInfo", "TensorInfo", "inspect"]


class TensorInfo(msgspec.Struct, frozen=True):
    """One tensor storage of a checkpoint.

    Attributes:
        name: the entry that first referenced it (``"model.0.weight"``).
        dtype: its element type (``"float32"``).
        shape: the shape of the first tensor viewing it, from the pickled structure;
            ``None`` when the structure holds objects that only a trusted load may build.
        location: the device it was saved from.
        nbytes: its bytes.
        stored_bytes: the bytes its chunks take in storage (compressed).
        ratio: ``nbytes / stored_bytes`` (1.0 for an empty storage).
        codec: the codec of its chunks (several joined by ``+`` when they differ).
        chunks: how many chunks it is stored in.
        shared_chunks: of those, how many lie in a pack an earlier version wrote.
    """

    name: str
    dtype: str
    shape: list[int] | None
    location: str
    nbytes: int
    stored_bytes: int
    ratio: float
    codec: str
    chunks: int
    shared_chunks: int


class CheckpointInfo(msgspec.Struct, frozen=True):
    """What :func:`inspect` found in a checkpoint.

    Attributes:
        url: where it is.
        format: its format version (1: one object; 2: chunks may lie in packs).
        created: when it was saved (Unix seconds).
        metadata: the metadata saved with it.
        raw_bytes: the tensors' bytes plus the pickled structure.
        stored_bytes: what its save wrote (chunks earlier versions held left out).
        size: the bytes of the checkpoint object itself.
        packs: the packs its chunks lie in, relative to its directory.
        tensors: one entry per tensor storage, in manifest order.
        digest: the whole-checkpoint digest, 16 hex digits: the form of
            :attr:`SaveResult.digest <asyncstore.SaveResult.digest>` (the manifest keeps
            it as an int).
    """

    url: str
    format: int
    created: float
    metadata: dict[str, Any]
    raw_bytes: int
    stored_bytes: int
    size: int
    packs: list[str]
    tensors: list[TensorInfo]
    digest: str


async def inspect(target: Any, store_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``target`` (as for :func:`asyncstore.load`) from its
    footer, manifest and pickled structure; no tensor data is read.

    Raises:
        IntegrityError: it is not an asyncstore checkpoint, or its manifest is damaged.
        NotFound: there is nothing at ``target``.
    """
    resolved = resolve(target, store_options, writing=False)
    try:
        source = open_source(resolved)
        try:
            size = await source.size()
            manifest = await manifest_of(source)
            if manifest is None:
                raise IntegrityError(f"{source.url} is not an asyncstore checkpoint")
            shapes = await _shapes(ChunkReader(source, manifest))
            url = source.url
        finally:
            await source.aclose()
    finally:
        await resolved.aclose()
    own = _own_pack_prefix(url)
    tensors = []
    for storage in manifest.storages:
        stored = sum(chunk.stored for chunk in storage.chunks)
        codecs = collections.Counter(chunk.codec for chunk in storage.chunks)
        shared = sum(
            1
            for index in range(len(storage.chunks))
            if storage.pack_of(index) != fmt.INLINE
            and not manifest.packs[storage.pack_of(index)].startswith(own)
        )
        tensors.append(
            TensorInfo(
                name=storage.name,
                dtype=storage.dtype,
                shape=shapes.get(storage.id),
                location=storage.location,
                nbytes=storage.nbytes,
                stored_bytes=stored,
                ratio=round(storage.nbytes / stored, 3) if stored else 1.0,
                codec="+".join(sorted(codecs)) if codecs else "-",
                chunks=len(storage.chunks),
                shared_chunks=shared,
            )
        )
    return CheckpointInfo(
        url=url,
        format=manifest.format,
        created=manifest.created,
        metadata=manifest.metadata,
        raw_bytes=manifest.raw_bytes,
        stored_bytes=manifest.stored_bytes,
        size=size,
        packs=list(manifest.packs),
        tensors=tensors,
        digest=f"{manifest.digest:016x}",  # as SaveResult gives it
    )


def _own_pack_prefix(url: str) -> str:
    # The pack a version's save wrote: packs/<its name without .ckpt>-<token>.pack.
    stem = url.rpartition("/")[2].rsplit(".", 1)[0]
    return f"{PACKS}{stem}-"


async def _shapes(reader: ChunkReader) -> dict[int, list[int]]:
    """Each storage's first tensor's shape, from the pickled structure unpickled over
    storages without memory; empty when the structure needs a trusted load."""
    structure = await reader.structure()
    by_id = {storage.id: storage for storage in reader.manifest.storages}
    ids: dict[int, int] = {}  # a placeholder storage's C pointer -> its id
    persistent_load = storage_loader(reader.source.url, by_id, {}, ids)
    unpickler = RestrictedUnpickler(io.BytesIO(structure), persistent_load, reader.source.url)
    try:
        obj = await to_thread(unpickler.load)
    except Exception:
        # A class only a trusted load builds (UnsafeCheckpoint), or a structure that does
        # not unpickle: the manifest's figures still stand, without shapes.
        return {}
    shapes: dict[int, list[int]] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            sid = ids.get(item.untyped_storage()._cdata)
            if sid is not None and sid not in shapes:
                shapes[sid] = list(item.shape)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
    return shapes
