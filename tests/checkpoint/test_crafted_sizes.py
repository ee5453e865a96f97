"""Sizes read from a file are checked against the file before anything is allocated.

Each file here is a few hundred bytes that claim 1.5 GiB somewhere (a chunk in a pack, a
pickle's bytearray, DCP metadata), every checksum right. The reads run with the process's
data segment capped at 512 MiB above what it uses (``RLIMIT_DATA``: the heap and private
mappings, where malloc, ``bytearray`` and torch's CPU allocator get their memory), so an
allocation of the claimed size fails at once, even one never touched (which resident
memory would not show); a test then checks that the reader's own error came first and that
no failed allocation lies behind it.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import resource
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import asyncstore
from asyncstore import IntegrityError
from asyncstore.checkpoint import verify
from asyncstore.torch.dcp import StorageReader

from ..conftest import unique
from ..forge import Forged, ForgedStorage, StorageRef, forge, forge_packed, rebuild, write_pickle

MiB = 1 << 20
CLAIM = 1536 * MiB  # what the crafted files claim
HEADROOM = 512 * MiB  # what a read may allocate beyond what the process holds already
PACK = "packs/step-000000001-0badc0de.pack"


def data_segment() -> int:
    """The bytes the kernel counts against RLIMIT_DATA now (VmData)."""
    match = re.search(r"VmData:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None
    return int(match.group(1)) * 1024


@contextlib.contextmanager
def capped_memory() -> Iterator[None]:
    """Inside, no allocation of more than HEADROOM bytes in all can succeed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_segment() + HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        # The premise: an allocation of the claimed size fails here, touched or not.
        with pytest.raises(MemoryError):
            bytearray(CLAIM)
        with pytest.raises(RuntimeError, match="allocate"):
            torch.empty(CLAIM, dtype=torch.uint8)
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def failed_allocation(exc: BaseException) -> BaseException | None:
    """The failed allocation (MemoryError, or torch's RuntimeError) behind ``exc``, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or (
            isinstance(current, RuntimeError) and "allocate" in str(current)
        ):
            return current
        current = current.__cause__ or current.__context__
    return None


# -- a chunk in a pack claiming more bytes than the pack holds ---------------------------------


def packed(codec: str) -> tuple[bytes, dict[str, bytes]]:
    """A version 2 checkpoint of one tensor "t" whose one chunk, in PACK, claims CLAIM stored
    bytes: a raw chunk (so the tensor claims that size too), or a zstd one of 4 KiB."""
    if codec == "raw":
        storage = ForgedStorage(b"x" * 64, raw=CLAIM, stored_claim=CLAIM, pack=0)
        size = CLAIM
    else:
        storage = ForgedStorage(b"x" * 4096, codec="zstd", stored_claim=CLAIM, pack=0)
        size = 4096
    structure = write_pickle({"t": rebuild(StorageRef(0), 0, [size], [1])})
    return forge_packed(Forged(structure, [storage], {"t": [0]}, packs=[PACK]))


async def crafted_run(run_url: tuple[str, dict[str, Any] | None], codec: str) -> tuple[str, int]:
    """The crafted checkpoint's URL in the run, and its pack's size."""
    url, options = run_url
    checkpoint, packs = packed(codec)
    async with asyncstore.open_store(url, **(options or {})) as store:
        await store.put("v.ckpt", checkpoint)
        for key, data in packs.items():
            await store.put(key, data)
    return f"{url}/v.ckpt", len(packs[PACK])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("codec", "how"),
    [("raw", "load"), ("raw", "verify"), ("zstd", "load"), ("zstd", "into")],
)
async def test_a_chunk_claiming_more_than_its_pack_holds_is_refused_before_any_allocation(
    run_url: tuple[str, dict[str, Any] | None], codec: str, how: str
) -> None:
    # The raw chunk's claim would size the tensor's storage; the zstd one's, the buffer a
    # local read of it fills (S3 answers a range past the end with what there is).
    url, size = await crafted_run(run_url, codec)
    options = run_url[1]
    with capped_memory(), pytest.raises(IntegrityError) as raised:
        if how == "load":
            await asyncstore.load(url, store_options=options)
        elif how == "verify":
            await verify(url, store_options=options)
        else:
            into = {"t": torch.zeros(4096, dtype=torch.uint8)}
            await asyncstore.load(url, into=into, store_options=options)
    assert failed_allocation(raised.value) is None
    message = str(raised.value)
    # It names the pack, the bytes the chunk claims and the pack's real size.
    assert f"{run_url[0]}/{PACK}" in message
    assert f"claims bytes 8-{8 + CLAIM:,}" in message
    assert f"which holds {size:,} bytes" in message
    assert "tensor 't'" in message


# -- pickles claiming more bytes than they hold -----------------------------------------------


def bytearray8(claim: int) -> bytes:
    """A protocol 5 pickle of a bytearray claiming ``claim`` bytes, holding 16."""
    return (
        pickle.PROTO + b"\x05" + pickle.BYTEARRAY8 + struct.pack("<Q", claim) + bytes(16)
    ) + pickle.STOP


@pytest.mark.anyio
async def test_a_structure_whose_bytearray_claims_gigabytes_is_refused_before_allocating() -> None:
    blob = forge(Forged(bytearray8(CLAIM)))
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await store.put("k", blob)
        with capped_memory(), pytest.raises(IntegrityError) as raised:
            await asyncstore.load((store, "k"))
    assert failed_allocation(raised.value) is None
    assert f"claims a bytearray of {CLAIM:,} bytes" in str(raised.value)


@pytest.mark.parametrize(
    "opcode", [pickle.BINBYTES8, pickle.BYTEARRAY8], ids=["BINBYTES8", "BYTEARRAY8"]
)
def test_dcp_metadata_claiming_gigabytes_is_refused_before_allocating(
    tmp_path: Path, opcode: bytes
) -> None:
    body = pickle.PROTO + b"\x05" + opcode + struct.pack("<Q", CLAIM) + bytes(16) + pickle.STOP
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(
        struct.pack("<8sQ", b"ASYNCDCP", xxhash.xxh3_64_intdigest(body)) + body
    )
    with capped_memory(), pytest.raises(IntegrityError) as raised:
        StorageReader(str(checkpoint)).read_metadata()
    assert failed_allocation(raised.value) is None
    assert ".metadata" in str(raised.value)
