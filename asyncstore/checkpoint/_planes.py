"""The byte-plane codec (``zstd+planes2``, ``zstd+planes4``): for floating-point elements,
zstd over the planes that compress (sign and exponent) and the others stored as they are.

Splitting floats into byte planes and compressing only the planes that shrink comes from
ZipNN (Hershcovitch et al., "ZipNN: Lossless Compression for AI Models", 2024). In a
trained model's bf16 weights the high byte (sign and seven exponent bits) takes a few
values and zstd shrinks it to about a third; the low byte (mantissa) is close to random, and
running zstd over it costs time for nothing. Storing it raw gives the ratio of zstd over
every plane at a fraction of the work.

A chunk's stored bytes::

    [mask: 1 byte][length of each compressed plane: 8 bytes each, little-endian]
    [plane 0][plane 1]...[tail]

Plane ``i`` holds byte ``i`` of every element (the layout of :func:`._format.shuffle`);
bit ``i`` of the mask says it is a zstd frame, else it is stored as it is
(``raw // width`` bytes). ``tail`` is the last ``raw % width`` bytes, as they are.
"""

from __future__ import annotations

import struct
from typing import Any

import zstandard

from ..errors import IntegrityError

__all__ = [
    "PLANE_CODECS",
    "plane_width",
    "plane_ratios",
    "compress_planes",
    "decode_planes",
    "zstd_into",
]

PLANE_CODECS = ("zstd+planes2", "zstd+planes4")

_LENGTH = struct.Struct("<Q")
# A zstd frame is at least a few bytes (magic, frame header, one block header).
_FRAME_MIN = 9
# The probe compresses a plane only if zstd shrinks its sample to this fraction or less:
# a mantissa plane comes out at 0.97-1.0 and would cost zstd's time for nothing.
_PLANE_WORTH = 0.9
# Decoding never needs a window larger than the output; zstd's own default limit (128 MiB)
# caps what a frame header may ask the decoder to allocate.
_WINDOW_MIN, _WINDOW_MAX = 1 << 10, 1 << 27


# Planes are cut from the elements and put back with numpy's strided copies: single-threaded
# (the encoders already run one per core) and about 3x as fast as torch's, which this module
# used to cut into pieces below torch's grain size to keep its thread pool out (2.1 ms a
# 2 MiB plane of a bf16 chunk against 0.77 ms, measured on this project's test machine).


def plane_width(codec: str) -> int:
    """The element width of a plane codec (2 or 4); 0 for any other codec."""
    return int(codec.removeprefix("zstd+planes")) if codec in PLANE_CODECS else 0


def _compressor(level: int) -> zstandard.ZstdCompressor:
    if level > 1:
        return zstandard.ZstdCompressor(level=level)
    # Level 1 and below: an exponent plane is a stream of a few distinct bytes in no
    # repeating order, so nearly all of zstd's gain is its entropy coding of literals. A
    # tiny match table (64 entries, fits in L1) and the longest minimum match spend little
    # time on matches that are rarely there; on a bf16 exponent plane this encodes about
    # 3x as fast as level 1 and a little smaller (a 128 KiB window keeps full-size blocks,
    # each with its own Huffman table).
    return zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST,
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            min_match=7,
            target_length=0,
        )
    )


def _planes(data: memoryview, width: int) -> tuple[Any, int]:
    # The bytes of ``data`` as a (elements, width) uint8 array (read-only memory too), and
    # the elements' count.
    import numpy as np

    count = len(data) // width
    return np.frombuffer(data, dtype=np.uint8, count=count * width).reshape(count, width), count


def plane_ratios(data: memoryview, width: int, level: int) -> list[float]:
    """For each byte plane of ``data`` (a sample of ``width``-byte elements), the fraction
    zstd leaves of it."""
    import numpy as np

    planes, count = _planes(data, width)
    if not count:
        return [1.0] * width
    compressor = _compressor(level)
    plane = bytearray(count)
    ratios = []
    for index in range(width):
        np.copyto(np.frombuffer(plane, dtype=np.uint8), planes[:, index])
        ratios.append(len(compressor.compress(plane)) / count)
    return ratios


def plane_mask(ratios: list[float]) -> int:
    """The planes worth compressing, as a bit mask, given :func:`plane_ratios`."""
    return sum(1 << index for index, ratio in enumerate(ratios) if ratio <= _PLANE_WORTH)


def compress_planes(data: memoryview, width: int, mask: int, level: int) -> bytearray:
    """``data`` as the plane codec stores it: the planes in ``mask`` as zstd frames (each
    kept raw instead where zstd does not shrink it), the others as they are."""
    import numpy as np

    planes, count = _planes(data, width)
    compressor = _compressor(level)
    frames: dict[int, bytes] = {}
    plane = bytearray(count if mask else 0)
    elements = np.frombuffer(plane, dtype=np.uint8)
    for index in range(width):
        if mask >> index & 1 and count:
            np.copyto(elements, planes[:, index])
            frame = compressor.compress(plane)
            if len(frame) < count:
                frames[index] = frame
    header = 1 + _LENGTH.size * len(frames)
    tail = len(data) - count * width
    size = header + sum(len(f) for f in frames.values()) + (width - len(frames)) * count + tail
    out = bytearray(size)
    out[0] = sum(1 << index for index in frames)
    position = 1
    for frame in frames.values():
        _LENGTH.pack_into(out, position, len(frame))
        position += _LENGTH.size
    target = np.frombuffer(out, dtype=np.uint8)
    for index in range(width):
        frame_or_none = frames.get(index)
        if frame_or_none is not None:
            out[position : position + len(frame_or_none)] = frame_or_none
            position += len(frame_or_none)
        else:
            # Straight from the elements into the output: one strided copy.
            np.copyto(target[position : position + count], planes[:, index])
            position += count
    out[position:] = data[count * width :]
    return out


def decode_planes(stored: bytes | memoryview, width: int, out: memoryview) -> None:
    """Decode ``stored`` (see the module's docstring) into ``out``, exactly the raw size.

    Every length is checked against ``len(stored)`` and ``len(out)`` before anything is
    decoded: a crafted chunk is refused, and no frame decodes to more than its plane.

    Raises:
        IntegrityError: the bytes are not a plane-coded chunk of ``len(out)`` bytes (the
            caller adds where).
    """
    import numpy as np

    view = memoryview(stored)
    count, tail = divmod(len(out), width)
    if not view:
        raise IntegrityError("it is empty, with no plane header")
    mask = view[0]
    if mask >> width:
        raise IntegrityError(f"its plane mask {mask:#04x} names planes past {width}")
    compressed = [index for index in range(width) if mask >> index & 1]
    header = 1 + _LENGTH.size * len(compressed)
    if len(view) < header:
        raise IntegrityError("its plane header is cut short")
    lengths = {
        index: _LENGTH.unpack_from(view, 1 + _LENGTH.size * n)[0]
        for n, index in enumerate(compressed)
    }
    expected = header + sum(lengths.values()) + (width - len(compressed)) * count + tail
    if any(length < _FRAME_MIN for length in lengths.values()) or expected != len(view):
        raise IntegrityError(
            f"its plane lengths do not add up to its {len(view)} stored bytes for "
            f"{len(out)} decoded"
        )
    # Each plane goes straight to its bytes of the elements (a strided copy): raw planes
    # from the stored bytes, compressed ones through one plane-sized buffer.
    planes, _ = _planes(out, width)
    stored_bytes = np.frombuffer(view, dtype=np.uint8)
    buffer = bytearray(count if compressed else 0)
    elements = np.frombuffer(buffer, dtype=np.uint8)
    position = header
    for index in range(width):
        length = lengths.get(index)
        if length is None:
            np.copyto(planes[:, index], stored_bytes[position : position + count])
            position += count
        else:
            zstd_into(view[position : position + length], memoryview(buffer), "a plane")
            np.copyto(planes[:, index], elements)
            position += length
    out[count * width :] = view[position:]


def zstd_into(frame: bytes | memoryview, out: memoryview, what: str) -> None:
    """One zstd frame into ``out``: exactly ``len(out)`` bytes and not one more, its window
    bounded by ``out``'s size (a crafted frame cannot make the decoder allocate more).

    Raises:
        IntegrityError: the frame does not decode, or not to exactly ``len(out)`` bytes
            (``what`` names the frame in the message).
    """
    try:
        window = min(_WINDOW_MAX, max(_WINDOW_MIN, 1 << (len(out) - 1).bit_length()))
        decompressor = zstandard.ZstdDecompressor(max_window_size=window)
        with decompressor.stream_reader(frame) as reader:
            got = 0
            while got < len(out):
                n = reader.readinto(out[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"zstd could not decode {what} ({exc})") from None
    if got != len(out) or extra:
        raise IntegrityError(f"{what} does not decode to the {len(out)} bytes expected")
