"""Crafted plane-coded chunks: every checksum right, every length and frame a lie.

Each file is built byte by byte (``tests/forge.py``); the loader must refuse it with
IntegrityError, never crash, never decode past a plane, never allocate for a length it was
told.
"""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from asyncstore import IntegrityError
from asyncstore.checkpoint._planes import decode_planes

from ..forge import Forged, ForgedStorage, StorageRef, forge, rebuild, write_pickle
from .helpers import load_forged, peak_rss, reset_peak_rss

pytestmark = pytest.mark.anyio

MiB = 1 << 20
ELEMENTS = 4096  # bf16: two planes of 4096 bytes
RAW = 2 * ELEMENTS


def bf16_bytes() -> bytes:
    gen = torch.Generator().manual_seed(3)
    tensor = (torch.randn(ELEMENTS, generator=gen) * 0.02).to(torch.bfloat16)
    return tensor.view(torch.uint8).numpy().tobytes()


def frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1).compress(data)


def chunk(*parts: bytes) -> bytes:
    return b"".join(parts)


def length(n: int) -> bytes:
    return struct.pack("<Q", n)


def forged(stored: bytes, raw: int = RAW, data: bytes | None = None) -> bytes:
    """A bf16 tensor "w" of ``raw`` bytes whose one chunk, plane-coded, stores ``stored``
    (its decoded checksum that of ``data``, by default the genuine bytes)."""
    genuine = bf16_bytes() if data is None else data
    structure = write_pickle({"w": rebuild(StorageRef(0, "bfloat16"), 0, [raw // 2], [1])})
    storage = ForgedStorage(
        genuine, "bfloat16", name="w", codec="zstd+planes2", raw=raw, stored=stored
    )
    return forge(Forged(structure, [storage]))


def planes() -> tuple[bytes, bytes]:
    data = bf16_bytes()
    return data[0::2], data[1::2]


def cases() -> dict[str, tuple[bytes, str]]:
    low, high = planes()
    good = frame(high)
    return {
        "a mask naming a third plane": (chunk(b"\x06", length(len(good)), low, good), "mask"),
        "a header cut short": (b"\x03" + length(10)[:4], "cut short"),
        "lengths past the chunk": (chunk(b"\x02", length(1 << 62), low, good), "add up"),
        "lengths short of the chunk": (chunk(b"\x02", length(len(good) - 1), low, good), "add up"),
        "a raw plane short": (chunk(b"\x02", length(len(good)), low[:-1], good), "add up"),
        "a frame too short to be one": (chunk(b"\x02", length(3), low, b"\x28\xb5\x2f"), "add up"),
        "garbage for a frame": (chunk(b"\x02", length(64), low, bytes(range(64))), "zstd"),
        "a frame one byte short": (
            chunk(b"\x02", length(len(frame(high[:-1]))), low, frame(high[:-1])),
            "does not decode",
        ),
        "a frame one byte long": (
            chunk(b"\x02", length(len(frame(high + b"x"))), low, frame(high + b"x")),
            "cannot be decoded",
        ),
        "planes swapped": (
            chunk(b"\x02", length(len(frame(low))), high, frame(low)),
            "do not match their checksum",
        ),
    }


def test_an_empty_chunk_is_refused() -> None:
    # (A load refuses it earlier: its manifest claims more than zstd can expand from nothing.)
    with pytest.raises(IntegrityError, match="no plane header"):
        decode_planes(b"", 2, memoryview(bytearray(RAW)))


@pytest.mark.parametrize("case", list(cases()))
async def test_a_crafted_plane_chunk_is_refused(case: str) -> None:
    stored, message = cases()[case]
    with pytest.raises(IntegrityError, match=message):
        await load_forged(forged(stored))


async def test_the_genuine_chunk_loads() -> None:
    # The cases above differ from this one only where they say: it loads.
    low, high = planes()
    good = frame(high)
    loaded = await load_forged(forged(chunk(b"\x02", length(len(good)), low, good)))
    assert loaded["w"].view(torch.uint8).numpy().tobytes() == bf16_bytes()


async def test_no_byte_flip_of_a_plane_chunk_loads_wrong_bytes() -> None:
    # Checksums redone over each damaged chunk: only the decoder's checks and the decoded
    # bytes' checksum stand between it and the caller. Each flip is refused, or (a bit zstd
    # ignores) decodes to the genuine bytes; never anything else, never a crash.
    data = bf16_bytes()[:160]  # 80 elements: a chunk small enough to damage everywhere
    low, high = data[0::2], data[1::2]
    good = frame(high)
    stored = chunk(b"\x02", length(len(good)), low, good)
    assert (await load_forged(forged(stored, len(data), data)))["w"].numel() == 80
    refused = 0
    for position in range(len(stored)):
        damaged = bytearray(stored)
        damaged[position] ^= 0x01
        try:
            loaded = await load_forged(forged(bytes(damaged), len(data), data))
        except IntegrityError:
            refused += 1
        else:
            assert loaded["w"].view(torch.uint8).numpy().tobytes() == data, position
    assert refused >= len(stored) - 4  # all but a few frame-header bits


async def test_a_frame_claiming_far_more_than_its_plane_allocates_nothing_for_it() -> None:
    # A plane of 4 MiB; its frame says, and decodes to, 1 GiB of zeros. Decoding stops at
    # the plane's end: the load fails without the gigabyte ever being allocated.
    elements = 4 * MiB
    packer = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
    zeros = bytes(MiB)
    bomb = b"".join(packer.compress(zeros) for _ in range(1024)) + packer.flush()
    assert zstandard.get_frame_parameters(bomb).content_size == 1 << 30
    stored = chunk(b"\x02", length(len(bomb)), bytes(elements), bomb)
    blob = forged(stored, 2 * elements, bytes(2 * elements))
    reset_peak_rss()
    before = peak_rss()
    with pytest.raises(IntegrityError):
        await load_forged(blob)
    assert peak_rss() - before < 200 * MiB
