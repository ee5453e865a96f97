"""What the torch adapter tests share: a small state saved and loaded by step, a run's files,
a damaged byte, and datasets closed when the test ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import state_dict_loader

from asyncstore.torch import StreamingDataset

D = TypeVar("D", bound=StreamingDataset[Any])


def small(step: int) -> dict[str, Any]:
    """A small state whose values say its step."""
    return {"w": torch.full((3, 5), float(step)), "b": torch.arange(4) + step, "step": step}


def load_small(ckpt: Any, step: int | None = None) -> dict[str, Any]:
    """The version ``step`` (the newest when None) of a :func:`small` state, loaded through
    the Checkpointer's DCP reader."""
    target: dict[str, Any] = {"w": torch.zeros(3, 5), "b": torch.zeros(4, dtype=torch.long)}
    target["step"] = 0
    state_dict_loader.load(target, storage_reader=ckpt.dcp_reader(step))
    return target


def files(root: Path) -> list[str]:
    """Every file below ``root``, as sorted relative paths."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def flip_a_byte(path: Path, at: float = 1 / 3) -> None:
    """Flip one bit of the file at ``path``, ``at`` of the way into it."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 1
    path.write_bytes(bytes(data))


# Datasets made by the running test: an iteration in this process opens a store and a cache,
# which the folder's autouse fixture closes after the test.
_open: list[StreamingDataset[Any]] = []


def closed_after_test(ds: D) -> D:
    """``ds``, registered to be closed when the running test ends."""
    _open.append(ds)
    return ds


def close_datasets() -> None:
    """Close the datasets registered by the test that just ended."""
    while _open:
        _open.pop().close()
