"""``asyncstore bench [URL]``: put and get throughput of a store at a few numbers of requests
in flight, for small and large objects, in a few seconds (a temporary local directory by
default)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from .._concurrency import bounded_map
from ..errors import IntegrityError
from ..stores import Store, open_store
from ._common import add_json, emit, table
from ._runs import add_store_options, human_bytes, store_options

__all__ = ["register"]

# Small: a typical training sample (tens of KB), where requests per second matter. Large: a
# checkpoint chunk or shard, where bytes per second matter.
DEFAULT_SIZES = (64 << 10, 8 << 20)
# One request at a time, a few, and 32: S3 clients degrade beyond ~32 in flight each.
DEFAULT_CONCURRENCY = (1, 8, 32)
DEFAULT_SECONDS = 4.0


class Result(msgspec.Struct, frozen=True):
    """One measurement: ``ops`` requests of ``size`` bytes with ``inflight`` at a time."""

    op: str
    size: int
    inflight: int
    ops: int
    seconds: float
    ops_per_second: float
    mb_per_second: float


async def _phase(
    store: Store, op: str, size: int, inflight: int, keys: list[str], payload: bytes, until: float
) -> Result:
    done = 0

    async def worker(first: int) -> None:
        nonlocal done
        index = first
        while time.perf_counter() < until:
            key = keys[index % len(keys)]
            if op == "put":
                await store.put(key, payload)
            else:
                data = await store.get(key)
                if len(data) != size:
                    raise IntegrityError(f"{store.url}/{key}: got {len(data)} bytes of {size}")
            done += 1
            index += inflight

    started = time.perf_counter()
    await bounded_map(worker, range(inflight), limit=inflight, name="bench")
    elapsed = max(time.perf_counter() - started, 1e-9)
    return Result(
        op, size, inflight, done, round(elapsed, 3), done / elapsed, done * size / elapsed / 1e6
    )


async def _bench(
    url: str, options: dict[str, Any], sizes: list[int], levels: list[int], seconds: float
) -> list[Result]:
    prefix = f"asyncstore-bench-{secrets.token_hex(4)}/"
    share = seconds / (len(sizes) * len(levels) * 2)
    results = []
    async with open_store(url, **options) as store:
        written: set[str] = set()
        try:
            for size in sizes:
                payload = os.urandom(size)
                # As many keys as requests in flight, rewritten: bounded space, every get
                # a distinct object.
                keys = [f"{prefix}{size}/{i}" for i in range(max(levels))]
                for key in keys:  # each get phase reads objects that are there
                    await store.put(key, payload)
                    written.add(key)
                for level in levels:
                    for op in ("put", "get"):
                        until = time.perf_counter() + share
                        results.append(await _phase(store, op, size, level, keys, payload, until))
        finally:
            for key in sorted(written):
                with contextlib.suppress(Exception):
                    await store.delete(key)
    return results


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints >= 1")
    return values


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` to the command line."""
    bench = commands.add_parser(
        "bench",
        help="put and get throughput of a store at a few concurrencies",
        description="Measure put and get throughput of the store at URL (default: a "
        "temporary local directory) for small and large objects, at several numbers of "
        "requests in flight. What it writes goes under a prefix asyncstore-bench-*/ and is "
        "deleted afterwards.",
    )
    bench.add_argument("url", nargs="?", default=None, help="a store URL or local directory")
    bench.add_argument(
        "--seconds",
        type=_seconds,
        default=DEFAULT_SECONDS,
        help=f"total time measured (default {DEFAULT_SECONDS:g})",
    )
    bench.add_argument(
        "--sizes",
        type=_ints,
        default=list(DEFAULT_SIZES),
        metavar="BYTES,...",
        help="object sizes (default 65536,8388608)",
    )
    bench.add_argument(
        "--concurrency",
        type=_ints,
        default=list(DEFAULT_CONCURRENCY),
        metavar="N,...",
        help="requests in flight (default 1,8,32)",
    )
    add_store_options(bench)
    add_json(bench)
    bench.set_defaults(handler=run)


@contextlib.contextmanager
def _target(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="asyncstore-bench-") as directory:
        yield directory


def run(args: argparse.Namespace) -> int:
    """Measure; returns the exit status."""
    with _target(args.url) as url:
        results = asyncio.run(
            _bench(url, store_options(args, url), args.sizes, args.concurrency, args.seconds)
        )
    rows = [
        [
            r.op,
            human_bytes(r.size),
            str(r.inflight),
            str(r.ops),
            f"{r.ops_per_second:,.0f}",
            f"{r.mb_per_second:,.1f}",
        ]
        for r in results
    ]
    header = ["OP", "SIZE", "INFLIGHT", "REQUESTS", "REQ/S", "MB/S"]
    where = args.url or "a temporary local directory"
    emit(args, {"url": where, "results": results}, f"store: {where}\n" + table(rows, header))
    return 0
