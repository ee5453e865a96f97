"""StreamingDataset problems users meet in their first hour: a DataLoader whose batch size
differs from the dataset's, per-epoch figures in the training process, memory hits with
several workers."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from asyncstore.torch import StreamingDataset

COUNT = 61


def key_of(key: str, data: bytes) -> str:
    assert data == key.encode()
    return key


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for i in range(COUNT):
        path = root / "train" / f"{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"train/{i:04d}.bin".encode())
    return root


def test_a_loader_batch_size_other_than_the_datasets_is_named_in_a_warning(
    dataset_dir: Path,
) -> None:
    ds = StreamingDataset(dataset_dir, shuffle=True, batch_size=8, decode=key_of)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    # The worker's warning, raised there as an error (forked workers inherit the filter),
    # reaches the training process as the DataLoader's error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"batch_size=8\).*batch_size=4 and 2 workers"):
            list(loader)
    # The order it warns about: not the plan's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys = [key for batch in loader for key in batch]
    assert sorted(keys) == sorted(ds.plan())
    assert keys != ds.plan()


def test_a_loader_without_batches_is_batch_size_one(dataset_dir: Path) -> None:
    ds = StreamingDataset(dataset_dir, batch_size=4, decode=key_of)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"batch_size=4\).*batch_size=1 and 2 workers"):
            list(loader)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_matching_batch_sizes_or_one_worker_read_the_plan_without_a_warning(
    dataset_dir: Path, workers: int
) -> None:
    # One worker or none reads the plan's order whatever the batch sizes: nothing to say.
    ds = StreamingDataset(
        dataset_dir, shuffle=True, batch_size=4 if workers == 2 else 8, decode=key_of
    )
    loader = DataLoader(
        ds, batch_size=4, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    keys = [key for batch in loader for key in batch]  # warnings are errors here
    assert keys == ds.plan()
