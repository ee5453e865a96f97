"""Warm disk-tier hits read on the consumer's thread (the training loop's, or a DataLoader
worker's): every sample's bytes as the store has them, every read counted once, and, when
the page cache does not hold the tier, the loop reading ahead again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from asyncstore import NotFound
from asyncstore.cache import DiskRow, RowReader, TieredCache
from asyncstore.torch import StreamingDataset

from ..helpers import SAMPLE_KEYS, key_of
from .helpers import closed_after_test


def dataset(data: Path, cache: Path) -> StreamingDataset[str]:
    # A memory tier of a few samples: a warm epoch reads most of them from the disk tier.
    return closed_after_test(
        StreamingDataset(
            data,
            cache_dir=cache,
            memory_bytes=64,
            shuffle=True,
            seed=3,
            decode=key_of,  # checks each sample's bytes
            batch_size=4,
        )
    )


def samples(root: Path, count: int) -> Path:
    """``count`` samples in ``root``, each sample's bytes its key (as ``key_of`` checks)."""
    root.mkdir()
    for i in range(count):
        (root / f"{i:04d}.bin").write_bytes(f"{i:04d}.bin".encode())
    return root


def keys(ds: StreamingDataset[str], workers: int = 0) -> list[str]:
    loader = DataLoader(
        ds,
        batch_size=4,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        persistent_workers=workers > 0,
    )
    return [key for batch in loader for key in batch]


class Reads:
    """Counts the rows read on consumers' threads in this process, and can make them all
    come back unread, as when the page cache does not hold them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cold: bool = False) -> None:
        self.rows = 0
        real = RowReader.read

        def read(reader: RowReader, row: DiskRow) -> bytes | None:
            self.rows += 1
            if cold:
                reader.cold += 1
                return None
            return real(reader, row)

        monkeypatch.setattr(RowReader, "read", read)


def test_warm_disk_hits_are_read_by_the_consumer_and_counted_once(
    dataset_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = dataset(dataset_dir, tmp_path / "cache")
    assert sorted(keys(ds)) == SAMPLE_KEYS  # cold: from the store
    reads = Reads(monkeypatch)
    ds.set_epoch(1)
    assert keys(ds) == ds.plan()
    stats = ds.epoch_stats(1)
    assert stats.store_fetches == 0
    assert stats.memory_hits + stats.disk_hits == len(SAMPLE_KEYS)
    assert stats.disk_hits > len(SAMPLE_KEYS) // 2
    assert reads.rows == stats.disk_hits  # each disk hit read by the consumer, counted once


def test_a_cold_page_cache_hands_the_reads_back_to_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several times the samples the prefetcher's window takes at the start of an epoch
    # (some hundreds, as rows, before the consumer reads the first).
    ds = dataset(samples(tmp_path / "data", 1500), tmp_path / "cache")
    keys(ds)
    reads = Reads(monkeypatch, cold=True)
    ds.set_epoch(1)
    assert keys(ds) == ds.plan()  # the rows not read were got the regular way
    stats = ds.epoch_stats(1)
    assert stats.store_fetches == 0
    assert stats.memory_hits + stats.disk_hits == 1500  # each counted once
    # After the first rows came back unread, the loop read the rest itself (the rows its
    # window held already aside): far fewer rows than disk hits.
    assert 0 < reads.rows < stats.disk_hits // 2


def test_workers_read_their_disk_hits_and_the_epoch_counts_them_once(
    dataset_dir: Path, tmp_path: Path
) -> None:
    ds = dataset(dataset_dir, tmp_path / "cache")
    keys(ds, workers=2)
    ds.set_epoch(1)
    assert keys(ds, workers=2) == ds.plan()
    stats = ds.epoch_stats(1)
    assert stats.processes == 2
    assert stats.store_fetches == 0
    assert stats.memory_hits + stats.disk_hits == len(SAMPLE_KEYS)
    assert stats.disk_hits > len(SAMPLE_KEYS) // 2


def test_a_row_whose_regular_read_fails_comes_after_the_samples_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = dataset(samples(tmp_path / "data", 200), tmp_path / "cache")
    keys(ds)
    failing: list[str] = []
    real_read, real_get = RowReader.read, TieredCache.get

    def read(reader: RowReader, row: DiskRow) -> bytes | None:
        if not failing and len(failing_after) > 20:  # the 22nd row: not read, and its
            failing.append(row.key)  # regular read fails
            return None
        failing_after.append(row.key)
        return real_read(reader, row)

    async def get(cache: TieredCache, key: str, *args: Any) -> bytes:
        if key in failing:
            raise NotFound(f"{key} is gone")
        return await real_get(cache, key, *args)

    failing_after: list[str] = []
    monkeypatch.setattr(RowReader, "read", read)
    monkeypatch.setattr(TieredCache, "get", get)
    ds.set_epoch(1)
    got: list[str] = []
    with pytest.raises(NotFound, match="is gone"):
        for key in ds:
            got.append(key)
    plan = ds.plan()
    assert failing
    assert got == plan[: plan.index(failing[0])]  # in order, up to the failed one
