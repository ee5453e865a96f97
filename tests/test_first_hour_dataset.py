"""StreamingDataset problems users meet in their first hour: a DataLoader whose batch size
differs from the dataset's, per-epoch figures in the training process, memory hits with
several workers."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from asyncstore import InvalidArgument
from asyncstore.torch import StreamingDataset

from .helpers import SAMPLES, key_of, raised_by_workers


def test_a_loader_batch_size_other_than_the_datasets_is_named_in_a_warning(
    dataset_dir: Path,
) -> None:
    ds = StreamingDataset(dataset_dir, shuffle=True, batch_size=8, decode=key_of)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    # The worker's warning, raised there as an error (forked workers inherit the filter),
    # reaches the training process as the DataLoader's error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raised_by_workers(loader, UserWarning, r"batch_size=8\).*batch_size=4 and 2 workers")
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
        raised_by_workers(loader, UserWarning, r"batch_size=4\).*batch_size=1 and 2 workers")


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


def worker_of(ds: StreamingDataset[str], epoch: int, batch: int, workers: int) -> dict[str, int]:
    """Which worker reads each sample of ``epoch``: workers take whole batches in turn."""
    return {key: (position // batch) % workers for position, key in enumerate(ds.plan(epoch))}


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epochs_figures_across_workers_reach_the_training_process(
    dataset_dir: Path, tmp_path: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Disk-tier batches wait long for more entries (the forked workers inherit this): the
    # warm epoch below finds the cold epoch's samples on disk only if each worker flushed
    # its writes when its iteration ended.
    monkeypatch.setattr("asyncstore.cache._writes.WRITE_DELAY", 30.0)
    ds = StreamingDataset(
        dataset_dir,
        cache_dir=tmp_path / "cache",
        disk_bytes=1 << 30,
        shuffle=shuffle,
        seed=3,
        batch_size=4,
        decode=key_of,
    )
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    for epoch in range(2):
        ds.set_epoch(epoch)
        # No pause: each worker puts what it fetched on the shared disk tier as its
        # iteration ends, before the other worker may look for it in the next epoch.
        assert sorted(key for batch in loader for key in batch) == sorted(ds.plan())
    cold, warm = ds.epoch_stats(0), ds.epoch_stats(1)
    assert ds.stats() is None  # the training process read nothing itself
    # The cold epoch: every sample once, each read from the store.
    assert (cold.epoch, cold.processes, cold.samples) == (0, 2, SAMPLES)
    assert cold.store_fetches == SAMPLES
    assert cold.store_bytes == sum(len(key) for key in ds.plan(0))
    assert cold.memory_hits == cold.disk_hits == 0
    assert cold.memory_misses == cold.disk_misses == SAMPLES
    assert cold.hit_rate == 0.0
    assert 0 < cold.store_latency_p50 <= cold.store_latency_p99
    # The warm epoch: no store read; a worker's memory tier holds what that worker read in
    # the cold epoch, the node's disk tier everything.
    assert (warm.epoch, warm.processes, warm.samples) == (1, 2, SAMPLES)
    assert warm.store_fetches == warm.store_bytes == warm.disk_misses == 0
    assert warm.memory_hits + warm.disk_hits == SAMPLES
    assert warm.hit_rate == 1.0
    assert warm.disk_hit_rate == (1.0 if warm.disk_hits else 0.0)  # 0.0: no disk reads
    before, after = worker_of(ds, 0, 4, 2), worker_of(ds, 1, 4, 2)
    same_worker = sum(1 for key in before if before[key] == after[key])
    assert warm.memory_hits == same_worker
    assert warm.memory_hit_rate == same_worker / SAMPLES
    if not shuffle:
        assert same_worker == SAMPLES  # the same order: each sample stays on its worker
    else:
        assert same_worker < SAMPLES  # dealt afresh: about half back on the same worker
    # Each epoch's own, and every epoch's together.
    assert ds.epoch_stats() == warm
    everything = ds.totals()
    assert everything.epoch is None
    assert everything.samples == 2 * SAMPLES
    assert everything.store_fetches == SAMPLES
    assert everything.memory_hits == warm.memory_hits
    del loader


def test_figures_of_an_epoch_not_kept_are_refused(dataset_dir: Path) -> None:
    ds = StreamingDataset(dataset_dir, decode=key_of)
    assert ds.epoch_stats(0).samples == 0  # current, nothing read yet
    with pytest.raises(InvalidArgument, match="epoch=1: no figures"):
        ds.epoch_stats(1)
    for epoch in range(10):
        ds.set_epoch(epoch)
        assert len(list(ds)) == SAMPLES
        assert ds.epoch_stats().samples == SAMPLES
    assert ds.epoch_stats(2).samples == SAMPLES
    with pytest.raises(InvalidArgument, match=r"epoch=1: no figures.*last 8"):
        ds.epoch_stats(1)
    with pytest.raises(InvalidArgument, match="epoch=-1"):
        ds.epoch_stats(-1)
    ds.set_epoch(9)  # the same epoch again: its figures add up
    list(ds)
    assert ds.epoch_stats(9).samples == 2 * SAMPLES
    assert ds.totals().samples == 11 * SAMPLES
    ds.close()
