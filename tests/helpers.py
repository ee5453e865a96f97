"""What test modules of several folders share: comparisons of a loaded state against the
state that was saved, from its structure down to each tensor's bytes; the small dataset of
the StreamingDataset tests; and an error expected from a DataLoader's workers, with the
workers shut down before the test goes on."""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes: unlike ``torch.equal``, a NaN
    equals the same NaN, and ``-0.0`` differs from ``0.0``."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = (torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1) for t in (a, b))
    if a.dtype == torch.bool:
        return torch.equal(flat_a, flat_b)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def _equal_values(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype, where
    assert got.shape == want.shape, where
    assert torch.equal(got, want), where


def _equal_bytes(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert same_bits(got, want), where
    assert got.stride() == want.stride(), where


def _walk(
    got: Any, want: Any, tensors: Callable[[torch.Tensor, torch.Tensor, str], None], where: str
) -> None:
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        tensors(got, want, where)
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _walk(got[key], want[key], tensors, f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _walk(a, b, tensors, f"{where}/{i}")
    else:
        assert got == want, where


def assert_same(got: Any, want: Any) -> None:
    """Assert that ``got`` is ``want`` again: the same types at every level (a tuple stays a
    tuple, an ``OrderedDict`` an ``OrderedDict``), dict keys in the same order, and tensors
    of the same dtype and shape holding equal values."""
    _walk(got, want, _equal_values, "")


def assert_same_bytes(got: Any, want: Any) -> None:
    """As :func:`assert_same`, and each tensor holds the same bytes (see :func:`same_bits`)
    with the same strides: for formats that promise a tensor back exactly as it was saved."""
    _walk(got, want, _equal_bytes, "")


def raised_by_workers(loader: Iterable[Any], expected: type[BaseException], match: str) -> None:
    """Iterate ``loader`` expecting ``expected`` (its message matching ``match``), then let the
    loader's iterator go at once.

    torch re-raises a worker's error from a frame that holds the error, whose traceback holds
    that frame: a cycle that keeps the iterator, its workers and its queues alive until the
    garbage collector runs. The collector then closes the queues (their finalizers run before
    the iterator's ``__del__``) and the iterator's shutdown sends its stop message into a
    closed queue: torch waits 5 s for each worker, in whichever later test the collector
    happens to run. Clearing the traceback's frames breaks the cycle, so the iterator is freed
    here and shuts its workers down the normal way."""
    with pytest.raises(expected) as raised:
        for _ in loader:
            pass
    assert re.search(match, str(raised.value)), str(raised.value)
    traceback.clear_frames(raised.tb)


SAMPLES = 61
"""Samples in the dataset tests' dataset: odd and prime, so no world size of 2 or 3 divides
it and ranks' streams are padded."""

SAMPLE_KEYS = [f"train/{i:04d}.bin" for i in range(SAMPLES)]
"""Its keys, in their listed order; each sample's bytes are its key."""


def write_samples(root: Path) -> Path:
    """Write the dataset (:data:`SAMPLE_KEYS`) as files below ``root``; returns ``root``."""
    for key in SAMPLE_KEYS:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    return root


def key_of(key: str, data: bytes) -> str:
    """A decode for that dataset: checks the sample's bytes and returns its key."""
    assert data == key.encode()
    return key
