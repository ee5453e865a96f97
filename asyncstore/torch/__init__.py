"""PyTorch adapters: ``StreamingDataset``, a drop-in ``IterableDataset`` over any store."""

from ._dataset import DatasetStats, StreamingDataset

__all__ = ["StreamingDataset", "DatasetStats"]
