"""PyTorch adapters: ``StreamingDataset``, a drop-in ``IterableDataset`` over any store, and
``save`` / ``save_async`` / ``load``, drop-in replacements for ``torch.save`` / ``torch.load``."""

from ._checkpoint import Checkpointer, export, load, save, save_async
from ._dataset import DatasetStats, EpochTotals, StreamingDataset

__all__ = [
    "StreamingDataset",
    "DatasetStats",
    "EpochTotals",
    "Checkpointer",
    "save",
    "save_async",
    "load",
    "export",
]
