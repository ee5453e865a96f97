"""StreamingDataset in a DataLoader against SeaweedFS, beside a sequential botocore loop.

4000 objects of 50 KB. For ``num_workers`` 0, 2 and 4: the first (cold) epoch, read from the
store through an empty cache, and a later (warm) epoch, read from the disk tier the first
filled. Baseline: a plain sequential botocore ``get_object`` loop over the same objects, in
the same run. Then a starvation run: a training loop with a fixed compute time per batch,
reporting the share of time spent waiting for data and the p99 wait per batch.

Run ``python benchmarks/bench_dataset.py`` (``--write`` records the tables in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from _plots import publish, today
from _report import machine, record
from _server import bench_seaweedfs
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import asyncstore
from asyncstore.testing import SeaweedFS
from asyncstore.torch import StreamingDataset

BUCKET = "bench-dataset"
T = TypeVar("T")
Say = Callable[..., None]  # say(line="")
BATCH = 64


def sequential_botocore(server: SeaweedFS, keys: list[str]) -> float:
    client = server.client()
    started = time.perf_counter()
    for key in keys:
        client.get_object(Bucket=BUCKET, Key=f"train/{key}")["Body"].read()
    return time.perf_counter() - started


def store_gets(url: str, options: dict[str, object], keys: list[str], inflight: int) -> float:
    """Seconds for ``S3Store.get`` of every key with ``inflight`` requests at a time: what
    the store itself delivers here, the bound for any cold epoch."""

    async def run() -> float:
        async with asyncstore.open_store(url, **options) as store:
            limit = asyncio.Semaphore(inflight)

            async def one(key: str) -> None:
                async with limit:
                    await store.get(key)

            started = time.perf_counter()
            await asyncio.gather(*(one(key) for key in keys))
            return time.perf_counter() - started

    return asyncio.run(run())


def as_tensor(key: str, data: bytes) -> torch.Tensor:
    """The samples' decode step: bytes to a tensor, as an image decoder would return."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def worker_share(items: list[T]) -> list[T]:
    """This DataLoader worker's items: whole batches in turn, as StreamingDataset's workers
    take them (all of them outside a worker)."""
    info = get_worker_info()
    if info is None:
        return items
    return [
        item
        for start in range(info.id * BATCH, len(items), BATCH * info.num_workers)
        for item in items[start : start + BATCH]
    ]


class InMemory(IterableDataset[torch.Tensor]):
    """The same samples from a list in memory: what the DataLoader alone can deliver.

    Workers take whole batches in turn, as StreamingDataset's do, and decode the same way;
    no storage, cache or prefetch is involved. Its rate is the ceiling for any dataset with
    these workers on this machine.
    """

    def __init__(self, items: list[tuple[str, bytes]], seed: int | None = None) -> None:
        """``seed``: read in a shuffled order, drawn afresh each iteration as
        :class:`PlainFiles` draws it (else in the list's order)."""
        self.items = items
        self.seed = seed
        self.iterations = 0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[torch.Tensor]:
        items = self.items
        if self.seed is not None:
            items = list(items)
            random.Random(self.seed + self.iterations).shuffle(items)
            self.iterations += 1
        for key, data in worker_share(items):
            yield as_tensor(key, data)


class PlainFiles(IterableDataset[torch.Tensor]):
    """Shuffled ``open().read()`` of local files inside the DataLoader, same decode and the
    same batches per worker: plain reads with the DataLoader's own costs (collate, moving
    batches from workers) included, which the bare loop does not pay.

    Each iteration (each epoch) shuffles afresh, from ``seed`` and the number of iterations
    before it; every worker's copy counts alike, so the workers share one order per epoch.
    One persistent DataLoader then serves every epoch, as StreamingDataset's does, and no
    epoch's time includes starting workers."""

    def __init__(self, paths: list[Path], seed: int) -> None:
        self.paths = list(paths)
        self.seed = seed
        self.iterations = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = list(self.paths)
        random.Random(self.seed + self.iterations).shuffle(order)
        self.iterations += 1
        for path in worker_share(order):
            with open(path, "rb") as f:
                yield as_tensor(path.name, f.read())


def loader_for(
    ds: StreamingDataset[torch.Tensor] | InMemory | PlainFiles, workers: int
) -> DataLoader[torch.Tensor]:
    # Persistent workers keep their cache (memory tier included) from epoch to epoch;
    # tensors travel from workers through shared memory, as decoded samples do.
    return DataLoader(
        ds,
        batch_size=BATCH,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
    )


def epoch(loader: DataLoader[torch.Tensor], expected: int) -> float:
    started = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    assert count == expected
    return time.perf_counter() - started


def starvation(loader: DataLoader[torch.Tensor], compute: float) -> tuple[float, float]:
    """Share of time waiting for data, and p99 wait per batch, with ``compute`` s per batch."""
    waits: list[float] = []
    started = time.perf_counter()
    iterator = iter(loader)
    while True:
        asked = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            break
        waits.append(time.perf_counter() - asked)
        # The step: a GPU step's host thread mostly waits for the device, without the GIL.
        time.sleep(compute)
    total = time.perf_counter() - started
    waits_sorted = sorted(waits[1:])  # the first batch waits for the pipeline to fill
    p99 = waits_sorted[min(len(waits_sorted) - 1, round(0.99 * (len(waits_sorted) - 1)))]
    return sum(waits[1:]) / total, p99


def plain_reads(paths: list[Path], seed: int) -> float:
    """Samples/s of a shuffled ``open().read()`` loop over local files, with the same decode:
    what a warm epoch could reach if every sample came straight from the page cache."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    started = time.perf_counter()
    for path in order:
        with open(path, "rb") as f:
            as_tensor(path.name, f.read())
    return len(order) / (time.perf_counter() - started)


def run_larger_than_memory(
    tmp: Path,
    contents: dict[str, bytes],
    workers_list: list[int],
    memory: int,
    say: Say,
    chart: dict[str, Any] | None = None,
) -> None:
    """Warm epochs over a local directory at least three times the memory tier: most reads
    come from the disk tier, and the memory policy decides which ones do not. The figures
    go into ``chart`` too when one is given."""
    source = tmp / "local-source"
    for key, data in contents.items():
        (source / key).parent.mkdir(parents=True, exist_ok=True)
        (source / key).write_bytes(data)
    paths = [source / key for key in contents]
    n = len(paths)
    total = sum(len(v) for v in contents.values())
    plain = statistics.median(plain_reads(paths, seed) for seed in range(3))
    say(
        f"### Warm epochs larger than memory: {n} objects, {total / 1e6:,.0f} MB from a local "
        f"directory, memory tier {memory / 1e6:,.0f} MB ({total / memory:.1f}x smaller), "
        "disk tier 1 GB"
    )
    say()
    say(
        "Warm is the median of epochs 2 and 3 (shuffled, after a cold epoch 1). Plain reads: a "
        f"shuffled `open().read()` loop over the same files with the same decode, "
        f"{plain:,.0f} samples/s (median of 3). *Plain reads in the DataLoader*: the same "
        "reads as a dataset in the same DataLoader (collate and, with workers, moving "
        "batches included). Hits per tier are for epochs 2-3 in the main process "
        "(num_workers=0); with workers each keeps its own counters."
    )
    say()
    say(
        "| memory policy | num_workers | epoch 1 | warm | warm vs plain reads | "
        "plain reads in the DataLoader | warm vs that | DataLoader ceiling | warm vs ceiling "
        "| memory hits | disk hits | store fetches |"
    )
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows: list[dict[str, Any]] = []
    for workers in workers_list:
        # One loader each, an untimed epoch first: no timed epoch starts workers.
        memory_loader = loader_for(InMemory(list(contents.items())), workers)
        epoch(memory_loader, n)
        ceiling = statistics.median(n / epoch(memory_loader, n) for _ in range(3))
        files_loader = loader_for(PlainFiles(paths, 0), workers)
        epoch(files_loader, n)
        in_loader = statistics.median(n / epoch(files_loader, n) for _ in range(3))
        for policy in ("plan", "lru"):
            ds: StreamingDataset[torch.Tensor] = StreamingDataset(
                source,
                cache_dir=tmp / f"warm-{policy}-{workers}",
                memory_bytes=memory,
                disk_bytes=1 << 30,
                shuffle=True,
                cache_policy=policy,
                batch_size=BATCH,
                decode=as_tensor,
            )
            loader = loader_for(ds, workers)
            first = n / epoch(loader, len(ds))
            before = ds.stats()
            warms = []
            for number in (1, 2):
                ds.set_epoch(number)
                warms.append(n / epoch(loader, len(ds)))
            warm = statistics.median(warms)
            after = ds.stats()
            hits = "| | |"
            if workers == 0 and before and after and before.cache and after.cache:
                b, a = before.cache, after.cache
                hits = (
                    f"| {a.memory.hits - b.memory.hits:,} | {a.disk.hits - b.disk.hits:,} | "
                    f"{a.store.fetches - b.store.fetches:,}"
                )
            say(
                f"| {policy} | {workers} | {first:,.0f} | {warm:,.0f} | {warm / plain:.2f}x | "
                f"{in_loader:,.0f} | {warm / in_loader:.2f}x | {ceiling:,.0f} | "
                f"{warm / ceiling:.2f}x {hits} |"
            )
            rows.append(
                {
                    "policy": policy,
                    "workers": workers,
                    "first": first,
                    "warm": warm,
                    "in_loader": in_loader,
                    "ceiling": ceiling,
                }
            )
            ds.close()
            del loader
    say()
    if chart is not None:
        chart.update(total_mb=total / 1e6, memory_mb=memory / 1e6, plain_per_s=plain, rows=rows)


def synthetic_key(i: int) -> str:
    return f"train/{i // 1000:05d}/{i:08d}.jpg"


def anon_mib() -> float:
    """This process's anonymous resident memory (heap, not mapped files), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def private_mib() -> float:
    """Memory only this process holds (pages it wrote, its copies of a parent's), in MiB:
    for a forked worker, what it costs beyond the pages it still shares."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def record_worker_memory(key: str, data: bytes) -> bytes:
    """A decode that notes each worker's private memory at its first sample."""
    info = get_worker_info()
    if info is not None:
        note = Path(os.environ["BENCH_NOTES"]) / f"worker-{info.id}"
        if not note.exists():
            note.write_text(f"{private_mib():.1f}")
    return data


def many_keys_child(mode: str, source: str, cache: str, count: int) -> dict[str, float]:
    """One process's figures for ``count`` keys (run in a fresh interpreter)."""
    import json

    from asyncstore.torch._order import EpochOrder

    before = anon_mib()
    started = time.perf_counter()
    if mode == "list":
        # What earlier versions did: the listing as a JSON list, shuffled with random, and
        # each worker building its share from the whole plan.
        keys = json.loads((Path(cache) / "listing.json").read_text())
        opened = time.perf_counter() - started
        held = anon_mib() - before
        started = time.perf_counter()
        order = list(range(len(keys)))
        random.Random(0).shuffle(order)
        planned = time.perf_counter() - started
        plan = [keys[i] for i in order]
        with_keys = time.perf_counter() - started
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, as a fork of the main process
            share = [
                k for start in range(0, len(plan), 2 * BATCH) for k in plan[start : start + BATCH]
            ]
            os.write(writer, f"{private_mib():.1f} {len(share)}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        worker = float(os.read(reader, 100).split()[0])
        return {
            "open": opened,
            "memory": held,
            "plan": planned,
            "keys": with_keys,
            "first": float("nan"),
            "worker_memory": worker,
        }
    ds: StreamingDataset[bytes] = StreamingDataset(
        source, cache_dir=cache, shuffle=True, batch_size=BATCH, decode=record_worker_memory
    )
    opened = time.perf_counter() - started
    held = anon_mib() - before
    started = time.perf_counter()
    epoch_order = EpochOrder(count, seed=0, epoch=0, shuffle=True, rank=0, world=1)
    indices = sum(len(part) for part in epoch_order.slices())
    planned = time.perf_counter() - started
    started = time.perf_counter()
    with_keys = sum(1 for _ in ds._worker_keys(0))  # the epoch EpochOrder above plans
    looked_up = time.perf_counter() - started
    assert indices == with_keys == count
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    started = time.perf_counter()
    first = next(iter(loader))
    first_batch = time.perf_counter() - started
    assert len(first) == BATCH
    notes = Path(os.environ["BENCH_NOTES"])
    deadline = time.monotonic() + 60
    while not all((notes / f"worker-{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = [float((notes / f"worker-{i}").read_text()) for i in range(2)]
    return {
        "open": opened,
        "memory": held,
        "plan": planned,
        "keys": looked_up,
        "first": first_batch,
        "worker_memory": max(workers),
    }


def run_many_keys(tmp: Path, count: int, say: Say) -> None:
    """Ten million keys: the index built from a listing, then a dataset over it."""
    import json
    import subprocess

    from asyncstore.torch._keyindex import build_index

    source, cache, notes = tmp / "store", tmp / "cache", tmp / "notes"
    for path in (source, cache, notes):
        path.mkdir()
    say(f"### {count:,} keys: the listing's index, the epoch plan and the first batch")
    say()

    async def listing(start_after: str) -> AsyncIterator[str]:
        for i in range(count):  # a listing in S3's order, as pages arrive
            key = synthetic_key(i)
            if key > start_after:
                yield key

    import xxhash

    digest = xxhash.xxh3_64_hexdigest(f"{source}\0".encode())
    started = time.perf_counter()
    index = asyncio.run(build_index(cache / f"keys-{digest}.idx", listing))
    built = time.perf_counter() - started
    size = (cache / f"keys-{digest}.idx").stat().st_size
    # Only the objects the first batches read exist: the index and plan are what is measured.
    ds: StreamingDataset[bytes] = StreamingDataset(source, cache_dir=cache, shuffle=True)
    for key in ds.plan()[:8192]:
        (source / key).parent.mkdir(parents=True, exist_ok=True)
        (source / key).write_bytes(b"x" * 1000)
    (cache / "listing.json").write_text(json.dumps(list(index)))
    del ds, index
    results = {}
    for mode in ("list", "index"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--many-keys-child",
                mode,
                str(source),
                str(cache),
                str(count),
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "BENCH_NOTES": str(notes)},
        )
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    old, new = results["list"], results["index"]
    say(
        f"Index built from the listing in {built:.1f} s ({size / 2**20:.0f} MiB file in "
        "`cache_dir`, mapped by every process). Baseline, in the same run: the listing as a "
        "JSON list of keys, loaded and shuffled as versions before the index did."
    )
    say()
    say(
        "| | open the key list | main process memory | shuffle and shard the epoch's plan "
        "| plan as keys | first batch (2 workers) | private memory per worker |"
    )
    say("|---|---:|---:|---:|---:|---:|---:|")
    say(
        f"| JSON list + `random.shuffle` (baseline) | {old['open']:.2f} s | "
        f"{old['memory']:,.0f} MiB | {old['plan']:.2f} s | {old['keys']:.2f} s | | "
        f"{old['worker_memory']:,.0f} MiB |"
    )
    say(
        f"| compact index + keyed permutation | {new['open']:.2f} s | {new['memory']:,.0f} MiB "
        f"| {new['plan']:.2f} s | {new['keys']:.2f} s | {new['first']:.2f} s | "
        f"{new['worker_memory']:,.0f} MiB |"
    )
    say()
    say(
        "*Main process memory* is anonymous memory the dataset added (the index is a mapped "
        "file, shared). *Plan as keys* turns the whole plan into key strings: the dataset "
        "does that a slice at a time while the epoch runs. *Private memory per worker* is "
        "what a forked worker holds alone when it starts reading (its runtime included)."
    )
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=4000)
    parser.add_argument("--object-size", type=int, default=50_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    parser.add_argument(
        "--larger-than-memory",
        action="store_true",
        help="only the warm epochs over a local directory larger than the memory tier",
    )
    parser.add_argument("--memory-mb", type=int, default=64, help="memory tier for that part")
    parser.add_argument(
        "--many-keys",
        type=int,
        metavar="N",
        help="only the index, plan and first batch over N synthetic keys (e.g. 10000000)",
    )
    parser.add_argument("--many-keys-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.many_keys_child:
        import json

        mode, source, cache, count = args.many_keys_child
        print(json.dumps(many_keys_child(mode, source, cache, int(count))))
        return 0
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    if args.many_keys:
        say(f"Machine: {machine()}")
        say()
        with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
            run_many_keys(Path(tmp), args.many_keys, say)
        if args.write:
            record("bench_dataset_keys", "Ten million samples", lines, script="bench_dataset")
        return 0
    n = args.objects
    keys = [f"{i:05d}.bin" for i in range(n)]
    if args.larger_than_memory:
        say(f"Machine: {machine()}")
        say()
        with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
            contents = {
                f"{i // 1000}/{key}": os.urandom(args.object_size) for i, key in enumerate(keys)
            }
            run_larger_than_memory(Path(tmp), contents, args.workers, args.memory_mb * 10**6, say)
        if args.write:
            record(
                "bench_dataset_warm", "Datasets larger than memory", lines, script="bench_dataset"
            )
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
        server = bench_seaweedfs(Path(tmp) / "seaweedfs")
        server.start()
        try:
            server.create_bucket(BUCKET)
            options = server.store_options()

            contents = {key: os.urandom(args.object_size) for key in keys}

            async def upload() -> None:
                async with asyncstore.open_store(f"s3://{BUCKET}/train", **options) as store:
                    await asyncio.gather(*(store.put(k, v) for k, v in contents.items()))

            asyncio.run(upload())
            baseline = n / sequential_botocore(server, keys)
            store_rate = statistics.median(
                n / store_gets(f"s3://{BUCKET}/train", options, keys, 32) for _ in range(3)
            )
            say(f"Machine: {machine()}")
            say()
            say(
                f"### DataLoader over {n} objects of {args.object_size / 1000:.0f} KB "
                f"(batch {BATCH})"
            )
            say()
            say(
                "The ceiling is the same DataLoader over the decoded samples held in a list in "
                "memory: what the DataLoader itself can deliver with that many workers here."
            )
            say()
            say(
                "| reader | cold epoch samples/s | warm epoch samples/s | cold vs sequential "
                "| cold vs S3Store.get, 32 in flight | warm vs cold | DataLoader ceiling "
                "samples/s | warm vs ceiling |"
            )
            say("|---|---:|---:|---:|---:|---:|---:|---:|")
            say(f"| botocore, sequential loop (baseline) | {baseline:,.0f} | | 1.00x | | | | |")
            say(
                f"| `S3Store.get`, 32 in flight (the store's limit here) | {store_rate:,.0f} | | "
                f"{store_rate / baseline:.2f}x | 1.00x | | | |"
            )
            runs = {}
            epochs: list[dict[str, Any]] = []
            for workers in args.workers:
                memory_loader = loader_for(InMemory(list(contents.items())), workers)
                ceiling = statistics.median(n / epoch(memory_loader, n) for _ in range(3))
                cache_dir = Path(tmp) / f"cache-{workers}"
                ds: StreamingDataset[torch.Tensor] = StreamingDataset(
                    f"s3://{BUCKET}/train",
                    keys=keys,
                    cache_dir=cache_dir,
                    shuffle=True,
                    store_options=options,
                    batch_size=BATCH,
                    decode=as_tensor,
                )
                loader = loader_for(ds, workers)
                cold = n / epoch(loader, len(ds))
                warms = []
                for number in (1, 2, 3):
                    ds.set_epoch(number)
                    warms.append(n / epoch(loader, len(ds)))
                warm = statistics.median(warms)
                epochs.append({"workers": workers, "cold": cold, "warm": warms, "ceiling": ceiling})
                say(
                    f"| StreamingDataset, num_workers={workers} | {cold:,.0f} | {warm:,.0f} | "
                    f"{cold / baseline:.2f}x | {cold / store_rate:.2f}x | {warm / cold:.1f}x | "
                    f"{ceiling:,.0f} | {warm / ceiling:.2f}x |"
                )
                runs[workers] = (ds, loader, memory_loader, warm)
            say()
            say("### Starvation: a training loop with a fixed compute time per batch (warm epoch)")
            say()
            say(
                "Compute per batch is at least the warm fetch time of a batch. *Not yet "
                "fetched* counts samples the prefetcher had not delivered when asked (the "
                "scheduler's stall fraction). *Loop time in next(loader)* is the share of the "
                "loop spent inside `next(loader)`, for StreamingDataset and for the in-memory "
                "list (decode, collate and moving batches from workers: the DataLoader's own "
                "cost); their difference is what waiting for storage added."
            )
            say()
            say(
                "| num_workers | compute per batch | samples not yet fetched when asked | "
                "loop time in next(loader) | same, in-memory list | added by storage | "
                "p99 wait per batch | same, in-memory list |"
            )
            say("|---:|---:|---:|---:|---:|---:|---:|---:|")
            for workers, (ds, loader, memory_loader, warm) in runs.items():
                compute = max(0.005, BATCH / warm)
                ds.set_epoch(4)
                first = ds.totals()
                share, p99 = starvation(loader, compute)
                last = ds.totals()
                floor, floor_p99 = starvation(memory_loader, compute)
                stalled = (last.stalls - first.stalls) / max(1, last.samples - first.samples)
                say(
                    f"| {workers} | {compute * 1000:.1f} ms | {stalled:.1%} | {share:.1%} | "
                    f"{floor:.1%} | {share - floor:+.1%} | {p99 * 1000:.2f} ms | "
                    f"{floor_p99 * 1000:.2f} ms |"
                )
                ds.close()
            say()
            larger: dict[str, Any] = {}
            run_larger_than_memory(
                Path(tmp), contents, args.workers, args.memory_mb * 10**6, say, larger
            )
        finally:
            server.stop(timeout=1.0)

    if args.write:
        record("bench_dataset", "Datasets", lines)
        publish(
            "bench_dataset",
            {
                "date": today(),
                "machine": machine(),
                "objects": n,
                "object_bytes": args.object_size,
                "batch": BATCH,
                "baseline_per_s": baseline,
                "store_per_s": store_rate,
                "epochs": epochs,
                "larger_than_memory": larger,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
