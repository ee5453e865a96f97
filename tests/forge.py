"""Forging checkpoints byte by byte, as an attacker would: any structure pickle, any
manifest, with every checksum recomputed so that only the loader's own checks stand between
the file and the caller."""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash
import zstandard

from asyncstore.checkpoint import _format as fmt
from asyncstore.checkpoint._planes import compress_planes, plane_width


@dataclass
class ForgedStorage:
    """A storage to forge: its bytes, and what the manifest claims about it."""

    data: bytes  # its raw bytes, encoded with ``codec`` unless ``stored`` is given
    dtype: str = "uint8"
    location: str = "cpu"
    name: str = "t"
    id: int | None = None  # default: its index
    nbytes: int | None = None  # default: len(data)
    codec: str = "raw"
    raw: int | None = None  # the raw size its chunk claims; default: len(data)
    stored: bytes | None = None  # the chunk's stored bytes as they are, not encoded here
    pack: int | None = None  # the index in Forged.packs of the pack its chunk lies in
    stored_claim: int | None = None  # the stored size its chunk claims; default: the real one


@dataclass
class Forged:
    structure: bytes
    storages: list[ForgedStorage] = field(default_factory=list)
    entries: dict[str, list[int]] | None = None
    structure_codec: str = "raw"
    structure_raw: int | None = None  # the decoded size the manifest claims
    structure_stored: bytes | None = None  # its stored bytes as they are
    packs: list[str] = field(default_factory=list)  # the packs' keys, as the manifest names them


def _encode(data: bytes, codec: str) -> bytes:
    if codec == "raw":
        return data
    width = plane_width(codec)
    if width:  # every plane a zstd frame (where zstd shrinks it)
        return bytes(compress_planes(memoryview(data), width, (1 << width) - 1, 3))
    return fmt.compress(memoryview(data), codec, 3)


def forge(spec: Forged) -> bytes:
    """A checkpoint object holding exactly what ``spec`` says, checksums and all."""
    checkpoint, packs = forge_packed(spec)
    assert not packs, "a spec with packs: use forge_packed"
    return checkpoint


def forge_packed(spec: Forged) -> tuple[bytes, dict[str, bytes]]:
    """A checkpoint object holding exactly what ``spec`` says, and the packs its chunks lie
    in (by key, relative to the checkpoint's directory), checksums and all."""
    out = io.BytesIO()
    out.write(fmt.MAGIC)
    packs = {name: io.BytesIO() for name in spec.packs}
    for pack in packs.values():
        pack.write(fmt.PACK_MAGIC)

    def chunk(
        data: bytes,
        codec: str,
        raw: int | None,
        given: bytes | None,
        pack: int | None = None,
        claim: int | None = None,
    ) -> fmt.Chunk:
        stored = _encode(data, codec) if given is None else given
        into = out if pack is None else packs[spec.packs[pack]]
        offset = into.tell()
        into.write(stored)
        return fmt.Chunk(
            offset,
            len(stored) if claim is None else claim,
            len(data) if raw is None else raw,
            codec,
            xxhash.xxh3_64_intdigest(stored),
            xxhash.xxh3_64_intdigest(data),
        )

    structure = chunk(
        spec.structure, spec.structure_codec, spec.structure_raw, spec.structure_stored
    )
    storages = []
    for index, s in enumerate(spec.storages):
        chunks = (
            (chunk(s.data, s.codec, s.raw, s.stored, s.pack, s.stored_claim),)
            if s.data or s.raw
            else ()
        )
        storages.append(
            fmt.Storage(
                index if s.id is None else s.id,
                (len(s.data) if s.raw is None else s.raw) if s.nbytes is None else s.nbytes,
                s.dtype,
                s.location,
                s.name,
                chunks,
                (s.pack,) if s.pack is not None and chunks else (),
            )
        )
    manifest = fmt.Manifest(
        fmt.FORMAT_VERSION,
        0.0,
        {},
        structure,
        storages,
        spec.entries,
        sum(len(s.data) for s in spec.storages),
        out.tell(),
        0,
        packs=list(spec.packs),
    )
    manifest = msgspec.structs.replace(manifest, digest=fmt.digest_of(manifest))
    encoded = fmt.encode_manifest(manifest)
    offset = out.tell()
    out.write(encoded)
    footer = fmt.Footer(
        fmt.FORMAT_VERSION, 0, offset, len(encoded), xxhash.xxh3_64_intdigest(encoded)
    )
    out.write(fmt.encode_footer(footer))
    return out.getvalue(), {name: pack.getvalue() for name, pack in packs.items()}


# -- pickles built opcode by opcode ----------------------------------------------------------


class Global:
    """``module.name`` as a pickle GLOBAL, without importing it here."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class Call:
    """``func(*args)`` as a pickle REDUCE."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __repr__(self) -> str:
        return f"{self.func!r}{self.args!r}"


class Build:
    """``obj`` followed by BUILD with ``state``: ``obj.__setstate__(state)``."""

    def __init__(self, obj: Any, state: Any) -> None:
        self.obj, self.state = obj, state

    def __repr__(self) -> str:
        return f"Build({self.obj!r}, {self.state!r})"


class Pid:
    """A persistent id of any shape, emitted as the tuple it is and BINPERSID."""

    def __init__(self, value: tuple[Any, ...]) -> None:
        self.value = value


class StorageRef:
    """A persistent id for storage ``id`` viewed as ``dtype``."""

    def __init__(self, id: Any, dtype: str = "uint8") -> None:
        self.id, self.dtype = id, dtype

    def __repr__(self) -> str:
        return f"StorageRef({self.id!r}, {self.dtype!r})"


def rebuild(
    storage: StorageRef,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool = False,
    hooks: Any = None,
    plain_size: bool = False,
) -> Call:
    """``torch._utils._rebuild_tensor_v2`` over ``storage``, as ``torch.save`` writes it
    (the size as a ``torch.Size``, or as a plain tuple with ``plain_size``)."""
    return Call(
        Global("torch._utils", "_rebuild_tensor_v2"),
        storage,
        offset,
        tuple(size) if plain_size else Call(Global("torch", "Size"), tuple(size)),
        tuple(stride),
        requires_grad,
        Call(Global("collections", "OrderedDict")) if hooks is None else hooks,
    )


def write_pickle(obj: Any, plain_protocol: int = 3) -> bytes:
    """Pickle ``obj``, where :class:`Global`, :class:`Call`, :class:`Build` and
    :class:`StorageRef` (and :class:`Pid`) become the opcodes they name (protocol 2, unframed)."""
    out = io.BytesIO()
    out.write(pickle.PROTO + b"\x02")

    def emit(value: Any) -> None:
        if isinstance(value, Global):
            out.write(pickle.GLOBAL + f"{value.module}\n{value.name}\n".encode())
        elif isinstance(value, Call):
            emit(value.func)
            emit(tuple(value.args))
            out.write(pickle.REDUCE)
        elif isinstance(value, Build):
            emit(value.obj)
            emit(value.state)
            out.write(pickle.BUILD)
        elif isinstance(value, StorageRef):
            emit(("storage", value.id, value.dtype))
            out.write(pickle.BINPERSID)
        elif isinstance(value, Pid):
            emit(value.value)
            out.write(pickle.BINPERSID)
        elif isinstance(value, tuple):
            out.write(pickle.MARK)
            for item in value:
                emit(item)
            out.write(pickle.TUPLE)
        elif isinstance(value, list):
            out.write(pickle.EMPTY_LIST + pickle.MARK)
            for item in value:
                emit(item)
            out.write(pickle.APPENDS)
        elif isinstance(value, dict):
            out.write(pickle.EMPTY_DICT + pickle.MARK)
            for k, v in value.items():
                emit(k)
                emit(v)
            out.write(pickle.SETITEMS)
        else:
            # Plain values (int, float, str, bool, None, bytes): pickle's own encoding,
            # without its PROTO and STOP (protocol 3: bytes as bytes, and no framing;
            # torch.save's protocol 2 writes bytes as a call of _codecs.encode).
            body = pickle.dumps(value, protocol=plain_protocol)
            out.write(body[2:-1])

    emit(obj)
    out.write(pickle.STOP)
    return out.getvalue()


def zstd_bomb(raw: int) -> bytes:
    """A small zstd frame that claims to decode to ``raw`` bytes."""
    return zstandard.ZstdCompressor(level=1).compress(bytes(min(raw, 1 << 16)))
