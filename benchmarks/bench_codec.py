"""The byte-plane codec: a bf16 state saved with ``compression="auto"`` beside the same save
uncompressed, to S3 and to local disk, in one run.

A transformer-like bf16 state of ``--mib`` MiB (default 1024: normal weights at a trained
layer's scale, std 0.02, with its norms), saved with ``asyncstore.save`` and ``await``-ed to
the end:

- to S3 (SeaweedFS on loopback, started here), with ``compression=None`` (the baseline),
  ``"auto"`` (the plane codec where it pays) and ``"zstd"`` (zstd over every byte plane, for
  reference). Goal: ``"auto"`` at most 0.8x the uncompressed save's time;
- to a local directory, with ``compression=None`` (the baseline) and ``"auto"``. Goal: never
  slower than raw (``"auto"`` keeps floats raw where the disk outruns the encoders).

Each round saves with every writer, the order alternating; the ratio of each round is
taken within the round, and the table gives their median and range. The machine is shared:
repeat the run. Run ``python benchmarks/bench_codec.py`` (``--mib 256`` for a quick run;
``--write`` records the table in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _report import machine, record
from _server import bench_seaweedfs
from bench_checkpoint import cpu_seconds, nbytes, settle, transformer_state

import asyncstore

MiB = 1 << 20
BUCKET = "bench-codec"
S3_GOAL = 0.8
LOCAL_GOAL = 1.0
# Two local saves that write the same bytes differ by this much from run to run here.
LOCAL_NOISE = 0.05

Say = Callable[[str], None]


class Runs:
    """Wall seconds, client CPU seconds and stored bytes of each writer, round by round."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid  # SeaweedFS's, whose CPU is counted too
        self.rows: dict[str, list[tuple[float, float, float, int, int]]] = {}

    def _server_cpu(self) -> float:
        return 0.0 if self.server_pid is None else cpu_seconds(self.server_pid)

    async def save(
        self, name: str, state: Any, url: str | Path, compression: Any, **options: Any
    ) -> None:
        settle()
        cpu, server, wall = cpu_seconds(), self._server_cpu(), time.perf_counter()
        handle = await asyncstore.save(state, url, compression=compression, **options)
        result = await handle
        row = (
            time.perf_counter() - wall,
            cpu_seconds() - cpu,
            self._server_cpu() - server,
            result.stored_bytes,
            result.compressed_storages,
        )
        self.rows.setdefault(name, []).append(row)

    def ratios(self, name: str, base: str) -> list[float]:
        return [a[0] / b[0] for a, b in zip(self.rows[name], self.rows[base], strict=True)]


def describe(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.2f}x ({min(values):.2f}-{max(values):.2f})"


def table(runs: Runs, base: str, raw: int, goal: float, noise: float, say: Say) -> list[str]:
    lines = [
        "| save | wall s | client CPU-s | server CPU-s | stored / raw | compressed storages | "
        "wall vs uncompressed (range) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in runs.rows.items():
        wall = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        server = statistics.median(r[2] for r in rows)
        stored = statistics.median(r[3] for r in rows)
        compressed = statistics.median(r[4] for r in rows)
        verdict = ""
        if name != base and "auto" in name:
            median = statistics.median(runs.ratios(name, base))
            verdict = f" (goal <= {goal}x: {'PASS' if median <= goal + noise else 'MISS'})"
        ratio = "1.00x (baseline)" if name == base else describe(runs.ratios(name, base))
        lines.append(
            f"| {name} | {wall:.2f} | {cpu:.2f} | {server:.2f} | {stored / raw:.3f} | "
            f"{compressed:.0f} | "
            f"{ratio}{verdict} |"
        )
    for line in lines:
        say(line)
    return lines


def run_s3(state: Any, tmp: Path, rounds: int, say: Say) -> list[str]:
    raw = nbytes(state)
    server = bench_seaweedfs(tmp / "seaweedfs")
    server.start()
    try:
        server.create_bucket(BUCKET)
        options = server.store_options(part_bytes=16 * MiB, upload_max_inflight=4)
        runs = Runs(server.pid)
        writers: list[tuple[str, Any]] = [
            ("compression=None (baseline)", None),
            ("compression='auto' (plane codec)", "auto"),
            ("compression='zstd' (every plane)", "zstd"),
        ]

        async def go() -> None:
            for index in range(rounds):
                order = writers if index % 2 == 0 else writers[::-1]
                for name, compression in order:
                    url = f"s3://{BUCKET}/run/{index}-{compression}.ckpt"
                    await runs.save(name, state, url, compression, store_options=options)
                    async with asyncstore.open_store(f"s3://{BUCKET}/run", **options) as store:
                        await store.delete(f"{index}-{compression}.ckpt")

        asyncio.run(go())
    finally:
        server.stop(timeout=1.0)
    say(f"### Saving the {raw / MiB:,.0f} MiB bf16 state to S3 (SeaweedFS on loopback)")
    say("")
    return table(runs, writers[0][0], raw, S3_GOAL, 0.0, say)


def run_local(state: Any, tmp: Path, rounds: int, say: Say) -> list[str]:
    raw = nbytes(state)
    runs = Runs()
    writers: list[tuple[str, Any]] = [
        ("compression=None (baseline)", None),
        ("compression='auto'", "auto"),
    ]
    where = tmp / "local"
    where.mkdir()

    async def go() -> None:
        for index in range(rounds):
            order = writers if index % 2 == 0 else writers[::-1]
            for name, compression in order:
                path = where / f"{index}-{compression}.ckpt"
                await runs.save(name, state, path, compression)
                path.unlink()

    asyncio.run(go())
    shutil.rmtree(where)
    say(f"### Saving the {raw / MiB:,.0f} MiB bf16 state to a local directory")
    say("")
    return table(runs, writers[0][0], raw, LOCAL_GOAL, LOCAL_NOISE, say)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    args = parser.parse_args()

    def say(line: str = "") -> None:
        print(line, flush=True)

    state = transformer_state(args.mib * MiB, torch.bfloat16)
    lines = [
        f"Machine: {machine()}. A transformer-like bf16 state (normal weights, std 0.02); "
        f"medians of {args.rounds} rounds, the writers' order alternating; ratios taken "
        "within each round (median, range). The machine is shared with other work: repeat.",
        "",
    ]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name).resolve()
        lines += run_s3(state, tmp, args.rounds, say)
        say("")
        lines += ["", *run_local(state, tmp, args.rounds, say)]
    lines += [
        "",
        f"Local goal: never slower than raw ({LOCAL_NOISE:.0%} allowed for noise: when "
        "'auto' keeps the floats raw both saves write the same bytes).",
    ]
    if args.write:
        record("bench_codec", "Plane-coded bf16 checkpoints", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
