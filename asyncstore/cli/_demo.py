"""``asyncstore demo``: writes, lists and reads back a few objects through a store (a local
directory by default, no server needed) and prints what it did and how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import xxhash

from ..stores import open_store

__all__ = ["DEFAULT_DEMO_URL", "register"]

# Where ``asyncstore demo`` writes without --url: a directory beside the caller, so the demo
# needs no server and what it wrote is easy to find and remove.
DEFAULT_DEMO_URL = "./asyncstore-demo"


def _sample(index: int, size: int) -> bytes:
    # Deterministic content, so the read-back check needs no copy of what was written.
    seed = xxhash.xxh3_128_digest(index.to_bytes(8, "little"))
    return (seed * (size // len(seed) + 1))[:size]


async def _demo(url: str, count: int, size: int, max_inflight: int) -> None:
    async with open_store(url) as store:
        print(f"store: {store.url}")
        limit = asyncio.Semaphore(max_inflight)

        async def put(i: int) -> None:
            async with limit:
                await store.put(f"demo/sample-{i:05d}.bin", _sample(i, size))

        started = time.perf_counter()
        await asyncio.gather(*(put(i) for i in range(count)))
        elapsed = time.perf_counter() - started
        total = count * size
        print(
            f"wrote   {count} objects of {size} bytes in {elapsed:.3f} s "
            f"({count / elapsed:,.0f} objects/s, {total / elapsed / 1e6:,.1f} MB/s)"
        )

        started = time.perf_counter()
        listed = [info async for info in store.list("demo/")]
        elapsed = time.perf_counter() - started
        print(
            f"listed  {len(listed)} objects under demo/ in {elapsed:.3f} s "
            f"(first {listed[0].key if listed else '-'}, last {listed[-1].key if listed else '-'})"
        )

        async def check(i: int) -> bool:
            async with limit:
                return await store.get(f"demo/sample-{i:05d}.bin") == _sample(i, size)

        started = time.perf_counter()
        ok = sum(await asyncio.gather(*(check(i) for i in range(count))))
        elapsed = time.perf_counter() - started
        print(
            f"read    {count} objects back in {elapsed:.3f} s "
            f"({count / elapsed:,.0f} objects/s): {ok} of {count} byte-identical"
        )

        head = await store.get("demo/sample-00000.bin", start=0, end=16)
        print(f"ranged  first 16 bytes of demo/sample-00000.bin: {head.hex()}")

        async with store.open_writer("demo/stream.bin") as writer:
            for i in range(8):
                await writer.write(_sample(i, size))
        streamed = 0
        async with store.open_reader("demo/stream.bin", chunk_bytes=size) as reader:
            async for chunk in reader:
                streamed += len(chunk)
        print(f"stream  wrote and read back {streamed} bytes through a writer and a reader")
        if ok != count or streamed != 8 * size:
            raise SystemExit("demo: data read back did not match what was written")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the command line."""
    demo = commands.add_parser("demo", help="write, list and read back objects through a store")
    demo.add_argument(
        "--url",
        default=DEFAULT_DEMO_URL,
        help=f"store URL or local directory (default: {DEFAULT_DEMO_URL})",
    )
    demo.add_argument("--objects", type=int, default=500, help="how many objects (default 500)")
    demo.add_argument("--size", type=int, default=50_000, help="bytes per object (default 50000)")
    demo.add_argument(
        "--max-inflight", type=int, default=32, help="requests in flight (default 32)"
    )
    demo.set_defaults(handler=run, parser=demo)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    if args.objects < 1 or args.size < 1 or args.max_inflight < 1:
        args.parser.error("--objects, --size and --max-inflight must be positive")
    asyncio.run(_demo(args.url, args.objects, args.size, args.max_inflight))
    return 0
