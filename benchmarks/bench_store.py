"""Store throughput against a real SeaweedFS, beside baselines measured in the same run.

Small objects: 4000 objects of 50 KB, put and get through an asyncstore S3 store at several
concurrency levels, against a plain sequential botocore loop over the same objects.

Large object: one 1 GiB object, multipart put and ranged parallel get through asyncstore,
against a hand-written aiobotocore multipart / ranged-get loop with the same part size and the
same number of requests in flight.

Run ``python benchmarks/bench_store.py`` (``--write`` also records the table in
docs/benchmarks.md). It starts its own SeaweedFS on free loopback ports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiobotocore
import botocore
from _baselines import aiobotocore_client, multipart_put
from _plots import publish, today
from _report import machine, record
from _server import bench_seaweedfs

import asyncstore
from asyncstore.testing import SeaweedFS

MiB = 1 << 20
BUCKET = "bench"
PART = 16 * MiB


async def timed(func: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await func()
    return time.perf_counter() - started


# -- small objects ------------------------------------------------------------------------------


def small_payloads(count: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


def botocore_sequential(
    server: SeaweedFS, prefix: str, payloads: list[bytes]
) -> tuple[float, float]:
    client = server.client()
    started = time.perf_counter()
    for i, data in enumerate(payloads):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{i:05d}", Body=data)
    put = time.perf_counter() - started
    started = time.perf_counter()
    for i, data in enumerate(payloads):
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{i:05d}")["Body"].read()
        assert len(body) == len(data)
    get = time.perf_counter() - started
    return put, get


async def asyncstore_small(
    server: SeaweedFS, prefix: str, payloads: list[bytes], concurrency: int
) -> tuple[float, float]:
    url = f"s3://{BUCKET}/{prefix}"
    async with asyncstore.open_store(
        url, **server.store_options(max_inflight=concurrency)
    ) as store:
        # The store bounds requests in flight itself; the caller just starts them all.
        async def put_all() -> None:
            await asyncio.gather(*(store.put(f"{i:05d}", data) for i, data in enumerate(payloads)))

        async def get_all() -> None:
            got = await asyncio.gather(*(store.get(f"{i:05d}") for i in range(len(payloads))))
            assert all(len(g) == len(p) for g, p in zip(got, payloads, strict=True))

        return await timed(put_all), await timed(get_all)


# -- one large object ---------------------------------------------------------------------------


async def aiobotocore_large(
    server: SeaweedFS, key: str, data: bytes, put_inflight: int, get_inflight: int
) -> tuple[float, float]:
    """A careful hand-written loop: what a user would write without asyncstore."""
    async with aiobotocore_client(server, max(put_inflight, get_inflight) + 4) as client:

        async def put() -> None:
            await multipart_put(client, BUCKET, key, data, PART, put_inflight)

        async def get() -> None:
            limit = asyncio.Semaphore(get_inflight)

            async def piece(offset: int) -> bytes:
                async with limit:
                    resp = await client.get_object(
                        Bucket=BUCKET, Key=key, Range=f"bytes={offset}-{offset + PART - 1}"
                    )
                    async with resp["Body"] as body:
                        chunk: bytes = await body.read()
                        return chunk

            pieces = await asyncio.gather(*(piece(off) for off in range(0, len(data), PART)))
            assert sum(map(len, pieces)) == len(data)
            b"".join(pieces)

        return await timed(put), await timed(get)


async def asyncstore_large(server: SeaweedFS, key: str, data: bytes) -> tuple[float, float]:
    async with asyncstore.open_store(f"s3://{BUCKET}", **server.store_options()) as store:

        async def put() -> None:
            await store.put(key, data)

        async def get() -> None:
            got = await store.get(key)
            assert len(got) == len(data)

        return await timed(put), await timed(get)


# -- report -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=4000)
    parser.add_argument("--object-size", type=int, default=50_000)
    parser.add_argument("--large-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each large transfer")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    args = parser.parse_args()

    lines: list[str] = []
    # The figures behind the tables, for benchmarks/results/ and the chart.
    small: dict[str, Any] = {"objects": args.objects, "object_bytes": args.object_size}
    large: dict[str, Any] = {"mib": args.large_mib, "part_mib": PART // MiB, "repeat": args.repeat}

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="bench-seaweedfs-") as data_dir:
        server = bench_seaweedfs(data_dir)
        server.start()
        try:
            server.create_bucket(BUCKET)
            payloads = small_payloads(args.objects, args.object_size)
            n, kb = args.objects, args.object_size / 1000
            say(
                f"Machine: {machine()}; aiobotocore {aiobotocore.__version__}, "
                f"botocore {botocore.__version__}"
            )
            say()
            say(f"### {n} objects of {kb:.0f} KB")
            say()
            say("| client | in flight | put objects/s | get objects/s | get vs sequential |")
            say("|---|---:|---:|---:|---:|")
            base_put, base_get = botocore_sequential(server, "seq", payloads)
            small["baseline"] = {"put_per_s": n / base_put, "get_per_s": n / base_get}
            small["asyncstore"] = []
            say(
                f"| botocore, sequential loop (baseline) | 1 | {n / base_put:,.0f} | "
                f"{n / base_get:,.0f} | 1.00x |"
            )
            for c in args.concurrency:
                put, get = asyncio.run(asyncstore_small(server, f"c{c}", payloads, c))
                small["asyncstore"].append(
                    {"inflight": c, "put_per_s": n / put, "get_per_s": n / get}
                )
                say(
                    f"| asyncstore S3Store | {c} | {n / put:,.0f} | {n / get:,.0f} | "
                    f"{base_get / get:.2f}x |"
                )
            del payloads

            size = args.large_mib * MiB
            data = os.urandom(size)
            ours_put: list[float] = []
            ours_get: list[float] = []
            hand_put: list[float] = []
            hand_get: list[float] = []
            defaults = asyncstore.S3Config()
            for _ in range(args.repeat):  # interleaved, so drift hits both alike
                p, g = asyncio.run(
                    aiobotocore_large(
                        server,
                        "large-hand",
                        data,
                        defaults.upload_max_inflight,
                        defaults.max_inflight,
                    )
                )
                hand_put.append(p)
                hand_get.append(g)
                p, g = asyncio.run(asyncstore_large(server, "large-ours", data))
                ours_put.append(p)
                ours_get.append(g)
            mb = size / 1e6
            say()
            say(
                f"### One {args.large_mib} MiB object, {PART // MiB} MiB parts "
                f"(median of {args.repeat})"
            )
            say()
            say("| client | put MB/s | get MB/s |")
            say("|---|---:|---:|")
            hp, hg = statistics.median(hand_put), statistics.median(hand_get)
            op, og = statistics.median(ours_put), statistics.median(ours_get)
            say(
                f"| hand-written aiobotocore loop (baseline; {defaults.upload_max_inflight} parts "
                f"/ {defaults.max_inflight} ranges in flight) | {mb / hp:,.0f} | "
                f"{mb / hg:,.0f} |"
            )
            say(f"| asyncstore `put` / `get` (defaults) | {mb / op:,.0f} | {mb / og:,.0f} |")
            say(f"| ratio asyncstore / baseline | {hp / op:.2f}x | {hg / og:.2f}x |")
            large["baseline_put_inflight"] = defaults.upload_max_inflight
            large["baseline_get_inflight"] = defaults.max_inflight
            large["baseline"] = {"put_mb_s": mb / hp, "get_mb_s": mb / hg}
            large["asyncstore"] = {"put_mb_s": mb / op, "get_mb_s": mb / og}
        finally:
            server.stop(timeout=1.0)

    if args.write:
        record("bench_store", "Stores", lines)
        publish(
            "bench_store",
            {"date": today(), "machine": machine(), "small": small, "large": large},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
