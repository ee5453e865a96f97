"""PyTorch adapters: ``StreamingDataset``, a drop-in ``IterableDataset`` over any store."""

from ._dataset import DatasetStats, EpochTotals, StreamingDataset

__all__ = ["StreamingDataset", "DatasetStats", "EpochTotals"]
