"""PyTorch adapters: ``StreamingDataset``, a drop-in ``IterableDataset`` over any store, and
``save`` / ``save_async`` / ``load``, drop-in replacements for ``torch.save`` / ``torch.load``;
``dcp_to_torch_save`` / ``torch_save_to_dcp``, DCP's format conversions for asyncstore's
distributed layout."""

from ._checkpoint import Checkpointer
from ._dataset import DatasetStats, EpochTotals, StreamingDataset
from ._dcpformat import dcp_to_torch_save, torch_save_to_dcp
from ._torchload import load
from ._torchsave import export, save, save_async

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
