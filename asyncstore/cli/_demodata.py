"""The demo's synthetic dataset: small image-like objects, deterministic from their index.

Each object is a 3x64x64 uint8 image (12 KiB) after an 8-byte header holding the sample's
index and label, so any process can check what it read without a copy of what was written.
The label is learnable from the image: each class has its own smooth pattern, and every
sample adds its own noise to it.
"""

from __future__ import annotations

import struct
import time
from functools import cache

import msgspec
import torch

from .._concurrency import bounded_each
from ..errors import InvalidArgument, NotFound
from ..stores import Store
from ._common import progress

__all__ = ["CLASSES", "DatasetInfo", "decode", "dataset_prefix", "sample", "upload"]

CLASSES = 10
SHAPE = (3, 64, 64)
_HEADER = struct.Struct("<IB3x")  # index, label, padding to 8 bytes
SAMPLE_BYTES = _HEADER.size + SHAPE[0] * SHAPE[1] * SHAPE[2]
# Requests in flight while uploading: what S3 clients sustain before they degrade.
_INFLIGHT = 32


class DatasetInfo(msgspec.Struct):
    """Where the demo's dataset lies and whether this run had to upload it.

    Attributes:
        url: the dataset's prefix, the URL the training reads from.
        samples: objects in it.
        bytes: their total size.
        uploaded: whether this run wrote them (False: they were already there).
        upload_seconds: how long writing them took (0 when already there).
    """

    url: str
    samples: int
    bytes: int
    uploaded: bool
    upload_seconds: float


def dataset_prefix(samples: int) -> str:
    """The key prefix of a dataset of ``samples`` objects (one per size: never mixed)."""
    return f"synthetic-{samples}/"


def _key(index: int) -> str:
    return f"{index:08d}.bin"


@cache
def _template(label: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 + label)
    coarse = torch.rand((1, SHAPE[0], 8, 8), generator=generator)
    return torch.nn.functional.interpolate(coarse, size=SHAPE[1:], mode="bilinear")[0] * 255


def sample(index: int) -> bytes:
    """The object of sample ``index``: header, then the image's bytes."""
    label = index % CLASSES
    generator = torch.Generator().manual_seed(index)
    noise = torch.rand(SHAPE, generator=generator) * 255
    image = (0.6 * _template(label) + 0.4 * noise).to(torch.uint8)
    return _HEADER.pack(index, label) + bytes(image.flatten().tolist())


def decode(key: str, data: bytes) -> tuple[int, int, torch.Tensor]:
    """``(index, label, image)`` of an object read back, checked against its key."""
    if len(data) != SAMPLE_BYTES:
        raise InvalidArgument(f"{key}: {len(data)} bytes, a demo sample has {SAMPLE_BYTES}")
    index, label = _HEADER.unpack_from(data)
    if key.rsplit("/", 1)[-1] != _key(index):
        raise InvalidArgument(f"{key} holds sample {index}: not the demo's dataset")
    image = torch.frombuffer(bytearray(data[_HEADER.size :]), dtype=torch.uint8)
    return index, label, image.view(SHAPE)


async def upload(store: Store, samples: int) -> DatasetInfo:
    """Write the dataset of ``samples`` objects under :func:`dataset_prefix`, unless a
    complete one is already there (its marker object is written last)."""
    prefix = dataset_prefix(samples)
    marker = f"{prefix.rstrip('/')}.complete"
    url = f"{store.url.rstrip('/')}/{prefix}"
    total = samples * SAMPLE_BYTES
    try:
        await store.stat(marker)
    except NotFound:
        pass
    else:
        return DatasetInfo(url, samples, total, uploaded=False, upload_seconds=0.0)
    started = time.perf_counter()
    with progress(total, f"uploading {samples} samples") as bar:

        async def put(index: int) -> None:
            data = sample(index)  # made here: a few ms each, no whole dataset in memory
            await store.put(prefix + _key(index), data)
            bar.update(len(data))

        await bounded_each(put, range(samples), limit=_INFLIGHT, name="upload")
    await store.put(marker, b"%d\n" % samples)
    return DatasetInfo(url, samples, total, True, time.perf_counter() - started)
