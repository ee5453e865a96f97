"""PyTorch adapters: ``StreamingDataset``, a drop-in ``IterableDataset`` over any store, and
``save`` / ``save_async`` / ``load``, drop-in replacements for ``torch.save`` / ``torch.load``;
``dcp_to_torch_save`` / ``torch_save_to_dcp``, DCP's format conversions for asyncstore's
distributed layout."""

import typing

from .._lazy import lazy_names as _lazy_names
from ._checkpoint import Checkpointer
from ._dataset import DatasetStats, EpochTotals, StreamingDataset
from ._torchload import load
from ._torchsave import export, save, save_async

if typing.TYPE_CHECKING:
    from ._dcpformat import dcp_to_torch_save, torch_save_to_dcp

__all__ = [
    "StreamingDataset",
    "DatasetStats",
    "EpochTotals",
    "Checkpointer",
    "save",
    "save_async",
    "load",
    "export",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
]

# The format conversions import torch.distributed.checkpoint (with DTensor and sympy, most of
# a second): paid for by a program that converts, not by every DataLoader worker.
__getattr__, __dir__ = _lazy_names(
    __name__, {"dcp_to_torch_save": "._dcpformat", "torch_save_to_dcp": "._dcpformat"}
)
