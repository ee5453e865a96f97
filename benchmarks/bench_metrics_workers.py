"""What DataLoader workers' records cost, beside the same work without them, same run.

1. Epochs: the median CPU time of an epoch's workers (local store, 2 forked workers, 64
   samples a batch) with records every 0.5 s (the default), with a record at every trip to
   the background loop (about one per batch: the most a worker ever writes), and with no
   records at all (the baseline), in rounds of the three in random order.
2. One record: the time a worker takes to write its record, and the time a snapshot takes
   to read 8 workers' records.

Run ``python benchmarks/bench_metrics_workers.py``; it prints markdown tables.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

import asyncstore
import asyncstore.metrics
from asyncstore._loop import run_sync
from asyncstore.metrics import _workers
from asyncstore.torch import StreamingDataset

SAMPLES = 8192
BATCH = 64
ROUNDS = 7


def _epoch(ds: StreamingDataset[bytes]) -> float:
    # The workers' CPU time rather than the wall time: on a shared machine the wall time of
    # an epoch varies by far more than what is measured. Without persistent_workers, the
    # workers have exited and been waited for when the loop ends.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    assert sum(len(batch) for batch in loader) == SAMPLES
    del loader
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def epochs(root: Path) -> dict[str, list[float]]:
    """Per mode, the epoch times of every round, seconds."""
    ds: StreamingDataset[bytes] = StreamingDataset(root, batch_size=BATCH)
    iteration = _workers.WorkerFigures.iteration

    def silent(self: Any, store: Any, cache: Any, prefetcher: Any) -> _workers.Publisher:
        return _workers.Publisher()

    times: dict[str, list[float]] = {"none": [], "default": [], "every trip": []}
    _epoch(ds)  # the page cache warm for every mode
    for _ in range(ROUNDS):
        for mode in random.sample(list(times), len(times)):
            _workers.WorkerFigures.iteration = silent if mode == "none" else iteration  # type: ignore[method-assign]
            _workers.INTERVAL = 0.0 if mode == "every trip" else 0.5
            try:
                times[mode].append(_epoch(ds))  # forked workers inherit the mode
            finally:
                _workers.WorkerFigures.iteration = iteration  # type: ignore[method-assign]
                _workers.INTERVAL = 0.5
    return times


def one_record(root: Path) -> tuple[float, float]:
    """Seconds to write one record, and to read 8 records in a snapshot."""

    async def opened() -> tuple[asyncstore.Store, asyncstore.TieredCache]:
        store = asyncstore.open_store(str(root))
        cache = asyncstore.TieredCache(store, memory_bytes=1 << 20)
        await cache.__aenter__()
        for i in range(100):
            await cache.get(f"{i:05d}.bin")
        return store, cache

    store, cache = run_sync(opened())
    ds: StreamingDataset[bytes] = StreamingDataset(root, batch_size=BATCH)
    figures = ds._worker_figures
    assert figures.directory is not None
    writers = [_workers._Writer(figures.directory, worker) for worker in range(8)]
    for writer in writers:
        writer.start(store, cache, None)
        writer.pid = os.getpid()  # live: read, never folded
    count = 2000
    started = time.perf_counter()
    for _ in range(count):
        writers[0].publish()
    write = (time.perf_counter() - started) / count
    for writer in writers:
        writer.publish()
    started = time.perf_counter()
    for _ in range(200):
        figures.components()
    read = (time.perf_counter() - started) / 200
    run_sync(cache.aclose())
    run_sync(store.aclose())
    return write, read


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        for i in range(SAMPLES):
            (root / f"{i:05d}.bin").write_bytes(os.urandom(1024))
        times = epochs(root)
        write, read = one_record(root)
    batches = SAMPLES // BATCH
    base = statistics.median(times["none"])
    print(f"## Epochs: {SAMPLES} samples of 1 KiB, {batches} batches, 2 forked workers\n")
    print("| records | median workers' CPU per epoch (s) | vs. none | per batch (µs) |")
    print("|---|---|---|---|")
    for mode, values in times.items():
        median = statistics.median(values)
        per_batch = (median - base) / batches * 1e6
        print(f"| {mode} | {median:.3f} | {median / base:.3f} | {per_batch:+.0f} |")
    print("\n## One record\n")
    print("| step | µs |")
    print("|---|---|")
    print(f"| a worker writes its record | {write * 1e6:.0f} |")
    print(f"| a snapshot reads 8 workers' records | {read * 1e6:.0f} |")


if __name__ == "__main__":
    main()
