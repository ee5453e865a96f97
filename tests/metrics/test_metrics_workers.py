"""DataLoader workers' figures in the main process's snapshot() and Prometheus scrape."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from torch.utils.data import DataLoader

import asyncstore
import asyncstore.metrics
import asyncstore.metrics._workers as workers_module
import asyncstore.metrics.prometheus as prom
from asyncstore.metrics import Metrics
from asyncstore.testing import SeaweedFS
from asyncstore.torch import StreamingDataset

from ..conftest import BUCKET, s3_options, unique

COUNT = 40
BATCH = 4
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    for i in range(COUNT):
        (root / f"{i:03d}.bin").write_bytes(bytes([i]) * 100)
    return root


@pytest.fixture
def registry() -> prometheus_client.CollectorRegistry:
    registry = prometheus_client.CollectorRegistry()
    prom.register(registry)
    return registry


Found = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: prometheus_client.CollectorRegistry) -> Found:
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: Found, metric: str, /, **labels: str) -> float:
    return found[(metric, frozenset(labels.items()))]


def counters(found: Found) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {key: v for key, v in found.items() if key[0].endswith(("_total", "_count", "_bucket"))}


def loader(ds: StreamingDataset[Any], context: str = "fork", **options: Any) -> DataLoader[Any]:
    return DataLoader(
        ds, batch_size=BATCH, num_workers=2, multiprocessing_context=context, **options
    )


def epoch(batches: DataLoader[Any]) -> int:
    return sum(len(batch) for batch in batches)


class Workers:
    """The figures of one dataset's workers in a snapshot, summed over worker ids."""

    def __init__(self, snap: Metrics, ds: StreamingDataset[Any]) -> None:
        name = ds._worker_figures.name
        datasets = [c for c in snap.datasets if c.name == name and c.worker is not None]
        caches = [c for c in snap.caches if c.worker is not None]
        prefetchers = [c for c in snap.prefetchers if c.worker is not None]
        stores = [c for c in snap.stores if c.worker is not None]
        self.ids = sorted(c.worker for c in datasets if c.worker is not None)
        self.samples = sum(c.stats.samples for c in datasets if c.stats is not None)
        self.cache_name = caches[0].name if caches else ""
        self.memory_hits = sum(c.stats.memory.hits for c in caches)
        self.memory_misses = sum(c.stats.memory.misses for c in caches)
        self.disk_hits = sum(c.stats.disk.hits for c in caches)
        self.fetches = sum(c.stats.store.fetches for c in caches)
        self.items = sum(c.stats.items for c in prefetchers)
        self.prefetch_fetches = sum(c.stats.fetched for c in prefetchers)
        self.gets = sum(c.stats.get.requests for c in stores)


def records(ds: StreamingDataset[Any]) -> list[str]:
    directory = ds._worker_figures.directory
    assert directory is not None
    return [name for name in os.listdir(directory) if name.endswith(".rec")]


def ours() -> set[str]:
    """This process's record directories (the main process makes one per dataset)."""
    base = SHM or "/tmp"
    prefix = f"asyncstore-metrics-{os.getpid()}-"
    return {name for name in os.listdir(base) if name.startswith(prefix)}


@pytest.fixture
def no_leaks() -> Iterator[None]:
    # Datasets earlier tests dropped in reference cycles go first: collected mid-test, their
    # series would leave the scrape, and their directories the listing, within the test.
    gc.collect()
    before = ours()
    yield
    gc.collect()
    assert ours() <= before


def check_scrape(found: Found, ds: StreamingDataset[Any], seen: Workers) -> None:
    d = {"component": "dataset", "name": ds._worker_figures.name}
    assert value(found, "asyncstore_dataset_samples_total", **d) == seen.samples
    c = {"component": "cache", "name": seen.cache_name}
    assert value(found, "asyncstore_cache_hits_total", **c, tier="memory") == seen.memory_hits
    assert value(found, "asyncstore_cache_misses_total", **c, tier="memory") == seen.memory_misses
    assert value(found, "asyncstore_cache_hits_total", **c, tier="disk") == seen.disk_hits
    assert value(found, "asyncstore_cache_store_fetches_total", **c) == seen.fetches
    p = {"component": "prefetcher", "name": seen.cache_name}
    assert value(found, "asyncstore_prefetch_items_total", **p) == seen.items
    assert value(found, "asyncstore_prefetch_fetches_total", **p) == seen.prefetch_fetches
    assert value(found, "asyncstore_prefetch_accuracy", **p) == 1.0
    s = {"component": "store", "name": seen.cache_name, "op": "get"}
    assert value(found, "asyncstore_store_request_seconds_count", **s) == seen.gets


@pytest.mark.usefixtures("no_leaks")
def test_workers_that_exit_keep_their_counts_across_epochs(
    data_dir: Path, tmp_path: Path, registry: prometheus_client.CollectorRegistry
) -> None:
    # Without persistent workers, every epoch's workers are new processes that exit at its
    # end: what they counted must stay in the counters.
    ds: StreamingDataset[bytes] = StreamingDataset(
        data_dir, cache_dir=tmp_path / "cache", batch_size=BATCH
    )
    batches = loader(ds)
    assert epoch(batches) == COUNT
    first = Workers(asyncstore.metrics.snapshot(), ds)
    totals = ds.epoch_stats(0)  # what the workers counted, through the dataset's own sums
    assert totals.processes == 2
    assert totals.samples == COUNT
    assert first.ids == [0, 1]
    assert first.samples == first.items == COUNT
    assert first.memory_misses == totals.memory_misses == COUNT
    assert first.memory_hits == totals.memory_hits == 0
    assert first.fetches == totals.store_fetches == first.gets == COUNT
    assert records(ds) == []  # both workers exited: their records are folded
    found = scrape(registry)
    check_scrape(found, ds, first)

    ds.set_epoch(1)
    assert epoch(batches) == COUNT  # two new workers, cold memory tiers, a warm disk tier
    second = Workers(asyncstore.metrics.snapshot(), ds)
    totals = ds.totals()
    assert second.ids == [0, 1]
    assert second.samples == second.items == totals.samples == 2 * COUNT
    assert second.disk_hits == totals.disk_hits == COUNT
    assert second.memory_misses == totals.memory_misses == 2 * COUNT
    assert second.fetches == totals.store_fetches == COUNT
    later = scrape(registry)
    check_scrape(later, ds, second)
    # No counter went backwards from one scrape to the next.
    grown = counters(later)
    assert {key: v for key, v in counters(found).items() if grown.get(key, -1) < v} == {}


@pytest.mark.usefixtures("no_leaks")
def test_persistent_workers_over_two_epochs(
    data_dir: Path, registry: prometheus_client.CollectorRegistry
) -> None:
    ds: StreamingDataset[bytes] = StreamingDataset(data_dir, batch_size=BATCH)
    batches = loader(ds, persistent_workers=True)
    assert epoch(batches) == COUNT
    first = Workers(asyncstore.metrics.snapshot(), ds)
    assert first.samples == COUNT
    assert first.memory_misses == COUNT
    assert len(records(ds)) == 2  # the workers live on, each with its record
    ds.set_epoch(1)
    assert epoch(batches) == COUNT
    second = Workers(asyncstore.metrics.snapshot(), ds)
    totals = ds.totals()
    assert second.samples == second.items == totals.samples == 2 * COUNT
    # Each worker reads the same batches again: its memory tier has them.
    assert second.memory_hits == totals.memory_hits == COUNT
    assert second.fetches == totals.store_fetches == COUNT
    check_scrape(scrape(registry), ds, second)

    del batches  # the workers exit
    gc.collect()
    after = Workers(asyncstore.metrics.snapshot(), ds)
    assert records(ds) == []
    assert vars(after) == vars(second)
    check_scrape(scrape(registry), ds, after)


@pytest.mark.usefixtures("no_leaks")
def test_spawned_workers(data_dir: Path, registry: prometheus_client.CollectorRegistry) -> None:
    ds: StreamingDataset[bytes] = StreamingDataset(data_dir, batch_size=BATCH)
    assert epoch(loader(ds, "spawn")) == COUNT
    seen = Workers(asyncstore.metrics.snapshot(), ds)
    assert seen.ids == [0, 1]
    assert seen.samples == seen.items == seen.memory_misses == seen.fetches == COUNT
    check_scrape(scrape(registry), ds, seen)


@pytest.mark.usefixtures("no_leaks")
def test_s3_workers(seaweedfs: SeaweedFS, registry: prometheus_client.CollectorRegistry) -> None:
    options = s3_options(seaweedfs)
    url = f"s3://{BUCKET}/{unique('workers')}"

    async def fill() -> None:
        async with asyncstore.open_store(url, **options) as store:
            for i in range(COUNT):
                await store.put(f"{i:03d}.bin", bytes([i]) * 100)

    anyio.run(fill)
    ds: StreamingDataset[bytes] = StreamingDataset(url, batch_size=BATCH, store_options=options)
    assert epoch(loader(ds)) == COUNT
    seen = Workers(asyncstore.metrics.snapshot(), ds)
    assert seen.samples == seen.memory_misses == seen.gets == ds.totals().store_fetches == COUNT
    assert seen.cache_name.startswith("s3://")
    check_scrape(found := scrape(registry), ds, seen)
    assert seaweedfs.secret_key not in str(found)


def test_mid_epoch_records_follow_the_interval(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forked workers inherit the interval set here.
    ds: StreamingDataset[bytes] = StreamingDataset(data_dir, batch_size=BATCH)
    monkeypatch.setattr(workers_module, "INTERVAL", 1e9)
    batches = iter(loader(ds))
    next(batches), next(batches)  # a batch from each worker
    assert Workers(asyncstore.metrics.snapshot(), ds).ids == []  # not due yet
    assert sum(map(len, batches)) == COUNT - 2 * BATCH
    assert Workers(asyncstore.metrics.snapshot(), ds).samples == COUNT  # each iteration's end

    monkeypatch.setattr(workers_module, "INTERVAL", 0.0)  # every trip to the loop
    ds.set_epoch(1)
    batches = iter(loader(ds))
    next(batches), next(batches)
    mid = Workers(asyncstore.metrics.snapshot(), ds)
    # Each worker published after its first trip, before its first batch: its figures show.
    # Neither iteration can have ended (each worker was asked for 3 of its 5 batches), so
    # these are mid-epoch records. A first trip may take a worker's whole shard (every
    # fetch done by then, on a loaded machine): up to 2 * COUNT.
    assert COUNT + 2 * BATCH <= mid.samples <= 2 * COUNT
    assert sum(map(len, batches)) == COUNT - 2 * BATCH
    assert Workers(asyncstore.metrics.snapshot(), ds).samples == 2 * COUNT


def test_the_record_directory_goes_with_the_dataset(data_dir: Path) -> None:
    before = ours()
    ds: StreamingDataset[bytes] = StreamingDataset(data_dir, batch_size=BATCH)
    batches = loader(ds, persistent_workers=True)
    assert epoch(batches) == COUNT
    directory = ds._worker_figures.directory
    assert directory is not None
    assert os.path.isdir(directory)
    assert os.path.basename(directory) in ours() - before
    ds.close()
    del ds, batches
    gc.collect()
    assert not os.path.exists(directory)
    assert ours() == before


def test_no_directory_left_at_exit(data_dir: Path) -> None:
    # A script that never drops its dataset or loader: the interpreter's exit removes them.
    script = textwrap.dedent(
        f"""
        import os, sys
        from torch.utils.data import DataLoader
        import asyncstore.metrics
        from asyncstore.torch import StreamingDataset

        if __name__ == "__main__":
            ds = StreamingDataset({str(data_dir)!r}, batch_size={BATCH})
            loader = DataLoader(ds, batch_size={BATCH}, num_workers=2, persistent_workers=True)
            assert sum(len(batch) for batch in loader) == {COUNT}
            snap = asyncstore.metrics.snapshot()
            assert sum(c.stats.samples for c in snap.datasets if c.worker is not None) == {COUNT}
            print(ds._worker_figures.directory, os.getpid())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    directory, pid = done.stdout.split()
    assert os.path.basename(directory).startswith(f"asyncstore-metrics-{pid}-")
    assert not os.path.exists(directory)


def test_a_killed_process_s_directory_goes_at_the_next_dataset_once_stale(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGKILL (the OOM killer) leaves the directory: the next dataset on the host removes
    # it once its owner is gone and it went untouched for STALE_SECONDS, nothing else.
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setattr(workers_module, "_base", lambda: str(base))
    script = textwrap.dedent(
        f"""
        import os, signal
        from torch.utils.data import DataLoader
        from asyncstore.metrics import _workers
        from asyncstore.torch import StreamingDataset

        if __name__ == "__main__":
            _workers._base = lambda: {str(base)!r}
            ds = StreamingDataset({str(data_dir)!r}, batch_size={BATCH})
            loader = DataLoader(ds, batch_size={BATCH}, num_workers=2)
            assert sum(len(batch) for batch in loader) == {COUNT}
            print(ds._worker_figures.directory, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == -9, done.stderr
    killed = Path(done.stdout.strip())
    assert killed.parent == base
    assert killed.is_dir()
    dead = int(killed.name.split("-")[2])
    stale = time.time() - workers_module.STALE_SECONDS - 60

    def made(name: str, *, old: bool = True, kind: str = "dir") -> Path:
        path = base / name
        if kind == "dir":
            path.mkdir()
        else:
            path.write_bytes(b"")
        if old:
            os.utime(path, (stale, stale))
        return path

    fresh = made(f"asyncstore-metrics-{dead}-fresh", old=False)
    alive = made(f"asyncstore-metrics-{os.getppid()}-alive")
    unnamed = made("asyncstore-metrics-x-unnamed")
    a_file = made(f"asyncstore-metrics-{dead}-file", kind="file")
    other = made(f"other-{dead}-dir")
    os.utime(killed, (stale, stale))
    ds: StreamingDataset[bytes] = StreamingDataset(data_dir, batch_size=BATCH)
    assert not killed.exists()
    assert all(path.exists() for path in (fresh, alive, unnamed, a_file, other))
    mine = ds._worker_figures.directory
    assert mine is not None
    assert Path(mine).parent == base
    ds.close()


@pytest.mark.usefixtures("no_leaks")
def test_exited_workers_records_are_folded_at_each_epoch_without_a_scrape(
    data_dir: Path,
) -> None:
    # A job that nobody scrapes: the records of each epoch's exited workers must not pile
    # up in /dev/shm until the dataset goes.
    ds: StreamingDataset[bytes] = StreamingDataset(data_dir, batch_size=BATCH)
    batches = loader(ds)
    directory = ds._worker_figures.directory
    assert directory is not None
    # What a worker killed between writing its record and renaming it leaves behind.
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = os.path.join(directory, f".w0-{gone.stdout.strip()}-0000.tmp")
    Path(stale).write_bytes(b"half a record")
    for number in range(3):
        ds.set_epoch(number)
        assert len(records(ds)) <= 2  # at most the last epoch's two workers
        assert epoch(batches) == COUNT
    assert len(records(ds)) == 2
    ds.set_epoch(3)
    assert records(ds) == []
    assert not os.path.exists(stale)
    figures = Workers(asyncstore.metrics.snapshot(), ds)
    assert figures.samples == 3 * COUNT  # folded, not lost
