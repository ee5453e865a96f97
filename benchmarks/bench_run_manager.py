"""What the run manager's safety costs a save, beside the same saves without it, same run.

1. Leases: the median time from ``save()`` to the commit of a 4 MiB state on local disk,
   with the lease each save writes and removes, and with leases switched off (the
   baseline), in alternating rounds.
2. Pack checks: how many times a pack's trailer and index are read over 20 differential
   saves with ``keep_last=3`` (each save's base and retention ask about the same packs).

Run ``python benchmarks/bench_run_manager.py``; it prints markdown tables.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from typing import Any

import torch

from asyncstore.checkpoint import Checkpointer, _leases, _packfile

ROUNDS = 3
SAVES = 40


async def _median_save(directory: str) -> float:
    state = {"w": torch.randn(1 << 20)}  # 4 MiB
    times = []
    async with Checkpointer(directory, keep_last=2, differential=False, compression=None) as c:
        for step in range(SAVES):
            started = time.perf_counter()
            await (await c.save(state, step))
            times.append(time.perf_counter() - started)
    return statistics.median(times)


async def leases() -> list[tuple[float, float]]:
    """Per round: (median with leases, median without), seconds."""
    hold, release = _leases.LeaseHolder.hold, _leases.LeaseHolder.release

    async def no_hold(self: Any) -> Any:
        return self

    async def no_release(self: Any) -> None:
        return None

    rounds = []
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory() as directory:
            with_lease = await _median_save(directory)
        _leases.LeaseHolder.hold, _leases.LeaseHolder.release = no_hold, no_release  # type: ignore[method-assign]
        try:
            with tempfile.TemporaryDirectory() as directory:
                without = await _median_save(directory)
        finally:
            _leases.LeaseHolder.hold, _leases.LeaseHolder.release = hold, release  # type: ignore[method-assign]
        rounds.append((with_lease, without))
    return rounds


async def pack_reads() -> int:
    """Trailer-and-index reads over 20 differential saves, one tensor of 8 changing each."""
    reads = 0
    real = _packfile.read_id

    async def counted(store: Any, key: str) -> _packfile.PackId:
        nonlocal reads
        reads += 1
        return await real(store, key)

    _packfile.read_id = counted
    try:
        state = {f"t{i}": torch.randn(65536) for i in range(8)}
        with tempfile.TemporaryDirectory() as directory:
            async with Checkpointer(directory, keep_last=3, chunk_bytes=1 << 18) as ckpt:
                for step in range(20):
                    state["t0"] = torch.randn(65536)
                    await (await ckpt.save(state, step))
    finally:
        _packfile.read_id = real
    return reads


async def main() -> None:
    print("| round | save to commit, with leases | without (baseline) | ratio |")
    print("|---|---|---|---|")
    for index, (with_lease, without) in enumerate(await leases(), 1):
        print(
            f"| {index} | {with_lease * 1e3:.1f} ms | {without * 1e3:.1f} ms | "
            f"{with_lease / without:.2f} |"
        )
    print()
    print(f"Pack trailer+index reads over 20 differential saves: {await pack_reads()}")


if __name__ == "__main__":
    asyncio.run(main())
