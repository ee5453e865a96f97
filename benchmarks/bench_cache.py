"""TieredCache read rates and hit rates, beside their limits measured in the same run.

Rates: 4000 objects of 50 KB in SeaweedFS, read (1) cold through the cache, (2) from a warm
disk tier, (3) from a warm memory tier, (4) straight from the store, and (5) with plain
``open().read()`` of the same bytes from local files — the limit for the disk tier.

Hit rates: three freshly shuffled epochs over a dataset twice the size of the memory tier,
for LRU, the plan policy and the offline optimum (Belady).

Run ``python benchmarks/bench_cache.py`` (``--write`` records the tables in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from _plots import publish, today
from _report import machine, record
from _server import bench_seaweedfs

import asyncstore
from asyncstore.cache import TieredCache
from asyncstore.stores import MemoryStore, drop_memory_store
from asyncstore.testing import SeaweedFS, belady_hits

BUCKET = "bench-cache"


async def read_all(cache: TieredCache | asyncstore.Store, keys: list[str], inflight: int) -> float:
    """Seconds to read every key with ``inflight`` reads at a time."""
    queue = iter(keys)

    async def worker() -> None:
        for key in queue:
            await cache.get(key)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return time.perf_counter() - started


async def rates(server: SeaweedFS, count: int, size: int, work: Path) -> list[tuple[str, float]]:
    options = server.store_options()
    keys = [f"train/{i:05d}.bin" for i in range(count)]
    payloads = [os.urandom(size) for _ in range(count)]
    files = work / "files"
    files.mkdir()
    for key, data in zip(keys, payloads, strict=True):
        (files / key.replace("/", "_")).write_bytes(data)
    rows: list[tuple[str, float]] = []
    async with asyncstore.open_store(f"s3://{BUCKET}/data", **options) as store:
        await asyncio.gather(*(store.put(k, d) for k, d in zip(keys, payloads, strict=True)))
        del payloads
        disk = work / "disk-tier"
        budget = 4 * count * size
        async with TieredCache(
            store, memory_bytes=2 * count * size, disk_dir=disk, disk_bytes=budget
        ) as cache:
            rows.append(("cold: through the cache from the store", await read_all(cache, keys, 32)))
            rows.append(("warm memory tier", await read_all(cache, keys, 1)))
        # A fresh cache on the same directory: memory is cold, every read hits the disk tier.
        async with TieredCache(store, memory_bytes=1, disk_dir=disk, disk_bytes=budget) as cache:
            rows.append(("warm disk tier (8 reads in flight)", await read_all(cache, keys, 8)))
            assert cache.stats().disk.hits == count
        rows.append(("store directly (32 in flight)", await read_all(store, keys, 32)))
    paths = [files / key.replace("/", "_") for key in keys]
    rows.append(("plain open().read() of local files (the limit)", plain_reads(paths)))
    return rows


def plain_reads(paths: list[Path]) -> float:
    """Seconds for a plain loop of ``open().read()`` over ``paths``: the disk tier's limit."""
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            f.read()
    return time.perf_counter() - started


async def hit_rates(count: int, epochs: int, seed: int) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    dataset = [f"s/{i:05d}" for i in range(count)]
    order: list[str] = []
    for _ in range(epochs):
        rng.shuffle(dataset)
        order += dataset
    store = MemoryStore(f"bench-hits-{seed}")
    try:
        for key in dataset:
            await store.put(key, b"x" * 100)
        capacity = count // 2
        out: list[tuple[str, float]] = []
        for policy in ("lru", "plan"):
            async with TieredCache(store, memory_bytes=capacity * 100, policy=policy) as cache:
                if policy == "plan":
                    cache.plan(order)
                for key in order:
                    await cache.get(key)
                out.append((f"TieredCache policy={policy!r}", cache.stats().hit_rate))
        out.append(("offline optimum (Belady)", belady_hits(order, capacity) / len(order)))
        return out
    finally:
        drop_memory_store(f"bench-hits-{seed}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=4000)
    parser.add_argument("--object-size", type=int, default=50_000)
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        server = bench_seaweedfs(Path(tmp) / "seaweedfs")
        server.start()
        try:
            server.create_bucket(BUCKET)
            work = Path(tmp) / "work"
            work.mkdir()
            rows = asyncio.run(rates(server, args.objects, args.object_size, work))
        finally:
            server.stop(timeout=1.0)
    n = args.objects
    by_name = dict(rows)
    cold = n / by_name["cold: through the cache from the store"]
    plain = n / by_name["plain open().read() of local files (the limit)"]
    say(f"Machine: {machine()}")
    say()
    say(f"### {n} objects of {args.object_size / 1000:.0f} KB")
    say()
    say("| read | gets/s | vs cold | vs plain local files |")
    say("|---|---:|---:|---:|")
    for name, seconds in rows:
        rate = n / seconds
        say(f"| {name} | {rate:,.0f} | {rate / cold:.1f}x | {rate / plain:.2f}x |")
    say()
    hits = asyncio.run(hit_rates(n, 3, seed=0))
    optimum = hits[-1][1]
    say(f"### Hit rate: 3 shuffled epochs over {n} objects, memory tier holds half of them")
    say()
    say("| policy | hit rate | vs optimum |")
    say("|---|---:|---:|")
    for name, rate in hits:
        say(f"| {name} | {rate:.3f} | {rate / optimum:.2f}x |")

    if args.write:
        record("bench_cache", "Cache", lines)
        *policies, (_, optimum) = hits
        publish(
            "bench_cache",
            {
                "date": today(),
                "machine": machine(),
                "objects": n,
                "object_bytes": args.object_size,
                "reads": [
                    {
                        "read": name,
                        "per_s": n / seconds,
                        "cache": "cache" in name or "tier" in name,
                        "limit": "(the limit)" in name,
                    }
                    for name, seconds in rows
                ],
                "hit_rates": {
                    "epochs": 3,
                    "objects": n,
                    "capacity": n // 2,
                    "policies": [
                        {"policy": name.split("'")[1], "hit_rate": rate} for name, rate in policies
                    ],
                    "optimum": optimum,
                },
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
