"""What S3 checkpoints cost the CPU: client and server core-seconds per GiB saved and loaded,
beside bare aiobotocore doing the same transfers, all in one run.

A transformer-like fp32 state of ``--mib`` MiB (default 512), compression off, against
SeaweedFS on loopback (its CPU read from ``/proc/<pid>/stat``). Per GiB:

- **saves**: ``asyncstore.save`` to S3, ``await``-ed to the end (snapshot, serialization,
  xxh3 checksums and the upload included), beside a bare aiobotocore multipart upload of
  the same bytes: 16 MiB parts, 4 in flight, sent straight from memory, once with botocore's
  default payload signing (the SHA-256 of every body over http) and once unsigned with no
  checksum: the transport's floor, and the baseline. Goal: asyncstore's client CPU at most
  1.2x the floor's. Also a ``Checkpointer`` with a local directory and an S3 mirror (the
  local write, and its read-back for the mirror, counted too);
- **loads**: ``asyncstore.load`` of that checkpoint (every chunk verified), into fresh
  tensors and into preallocated ones (``into=``, as a resumed job loads into its model),
  beside bare ranged GETs of the same object (16 MiB, 4 in flight) into one preallocated
  buffer. Goal: at most 1.1x, for the load into preallocated tensors (a fresh load also pays
  the kernel for zeroing new pages).

Rounds alternate the order of the writers. Run ``python benchmarks/bench_s3_cost.py``
(``--mib 128`` for a quick run; ``--write`` records the table in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from _report import machine, record
from _server import bench_seaweedfs
from aiobotocore.session import get_session
from bench_checkpoint import cpu_seconds, nbytes, storage_bytes, transformer_state

import asyncstore
from asyncstore.testing import SeaweedFS

MiB = 1 << 20
GiB = 1 << 30
PART = 16 * MiB
INFLIGHT = 4
BUCKET = "bench-s3-cost"
SAVE_GOAL = 1.2
LOAD_GOAL = 1.1


@asynccontextmanager
async def client_of(server: SeaweedFS, *, sign_payload: bool) -> AsyncIterator[Any]:
    """An aiobotocore client of ``server``, with botocore's own per-request checksums off."""
    from aiobotocore.config import AioConfig

    options = server.store_options()
    config = AioConfig(
        max_pool_connections=INFLIGHT + 4,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # Over http botocore signs every payload unless told not to (the request stays
        # signed either way).
        s3={"addressing_style": "path", "payload_signing_enabled": sign_payload},
    )
    async with get_session().create_client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name=options.get("region") or "us-east-1",
        aws_access_key_id=options["aws_access_key_id"],
        aws_secret_access_key=options["aws_secret_access_key"],
        config=config,
    ) as client:
        yield client


async def bare_upload(client: Any, key: str, parts: list[bytes]) -> None:
    """A multipart upload of ``parts`` (each sent as it lies), ``INFLIGHT`` at a time."""
    upload = await client.create_multipart_upload(Bucket=BUCKET, Key=key)
    slots = asyncio.Semaphore(INFLIGHT)

    async def send(number: int, body: bytes) -> dict[str, Any]:
        async with slots:
            resp = await client.upload_part(
                Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

    done = await asyncio.gather(*(send(i + 1, p) for i, p in enumerate(parts)))
    await client.complete_multipart_upload(
        Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": done}
    )


async def bare_download(client: Any, key: str, into: bytearray) -> None:
    """Ranged GETs of ``key`` into ``into``, ``INFLIGHT`` at a time."""
    slots = asyncio.Semaphore(INFLIGHT)
    view = memoryview(into)

    async def fetch(start: int) -> None:
        end = min(start + PART, len(into))
        async with slots:
            resp = await client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end - 1}")
            async with resp["Body"] as body:
                data = await body.read()
        view[start:end] = data

    await asyncio.gather(*(fetch(s) for s in range(0, len(into), PART)))


class Meter:
    """Client and server CPU seconds, and wall seconds, of each measured call, by name."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.runs: dict[str, list[tuple[float, float, float]]] = {}

    async def measure(self, name: str, work: Callable[[], Awaitable[object]]) -> None:
        client, server, wall = cpu_seconds(), cpu_seconds(self.server_pid), time.perf_counter()
        await work()
        self.runs.setdefault(name, []).append(
            (
                cpu_seconds() - client,
                cpu_seconds(self.server_pid) - server,
                time.perf_counter() - wall,
            )
        )

    def median(self, name: str, field: int) -> float:
        return statistics.median(run[field] for run in self.runs[name])


def run(mib: int, rounds: int, say: Callable[[str], None]) -> list[str]:
    state = transformer_state(mib * MiB, torch.float32)
    size = nbytes(state)
    joined = b"".join(storage_bytes(state))
    parts = [joined[i : i + PART] for i in range(0, len(joined), PART)]
    with tempfile.TemporaryDirectory() as tmp, bench_seaweedfs(Path(tmp)) as server:
        server.create_bucket(BUCKET)
        options = server.store_options(part_bytes=PART, upload_max_inflight=INFLIGHT)
        assert server.pid is not None
        meter = Meter(server.pid)

        async def go() -> None:
            async with (
                client_of(server, sign_payload=True) as signed,
                client_of(server, sign_payload=False) as plain,
            ):
                saves: list[tuple[str, Callable[[str], Awaitable[object]]]] = [
                    ("bare, payload signed", lambda key: bare_upload(signed, key, parts)),
                    ("bare, unsigned, no checksum", lambda key: bare_upload(plain, key, parts)),
                    (
                        "asyncstore.save",
                        lambda key: _save(state, f"s3://{BUCKET}/{key}", options),
                    ),
                    (
                        "Checkpointer(local, mirror=s3)",
                        lambda key: _mirrored(
                            state, Path(tmp) / key, f"s3://{BUCKET}/{key}", options
                        ),
                    ),
                ]
                for r in range(rounds):
                    order = saves[r % len(saves) :] + saves[: r % len(saves)]
                    for name, save in order:
                        await meter.measure(name, functools.partial(save, f"{name[:4]}-{r}"))
                into = bytearray(size)
                url = f"s3://{BUCKET}/asyn-0"
                model = {name: torch.zeros_like(t) for name, t in state.items()}
                model["lm_head.weight"] = model["embed.weight"]  # tied, as saved
                for r in range(rounds):
                    loads: list[tuple[str, Callable[[], Awaitable[object]]]] = [
                        ("bare ranged GETs", lambda: bare_download(plain, "asyn-0", into)),
                        ("asyncstore.load", lambda: asyncstore.load(url, store_options=options)),
                        (
                            "asyncstore.load(into=)",
                            lambda: asyncstore.load(url, into=model, store_options=options),
                        ),
                    ]
                    for name, load in loads[r % 3 :] + loads[: r % 3]:
                        await meter.measure(name, load)

        asyncio.run(go())
    gib = size / GiB
    lines = [
        f"Machine: {machine()}. A {size / MiB:,.0f} MiB fp32 state, compression off; "
        f"16 MiB parts, {INFLIGHT} in flight; medians of {rounds} rounds (order alternating). "
        "Core-seconds per GiB: the client (this process, every thread) and SeaweedFS "
        "(`/proc/<pid>/stat`), on the same 2 cores.",
        "",
        "| transfer | client CPU-s/GiB | server CPU-s/GiB | wall s/GiB | client vs floor |",
        "|---|---:|---:|---:|---:|",
    ]
    floors = {
        "save": meter.median("bare, unsigned, no checksum", 0),
        "load": meter.median("bare ranged GETs", 0),
    }
    goals = {"asyncstore.save": SAVE_GOAL, "asyncstore.load(into=)": LOAD_GOAL}
    for name in meter.runs:
        kind = "load" if "load" in name or "GETs" in name else "save"
        client = meter.median(name, 0)
        ratio = client / floors[kind]
        verdict = ""
        if name in goals:
            limit = goals[name]
            verdict = f" (goal <= {limit}x: {'PASS' if ratio <= limit else 'MISS'})"
        lines.append(
            f"| {name} | {client / gib:.2f} | {meter.median(name, 1) / gib:.2f} | "
            f"{meter.median(name, 2) / gib:.2f} | {ratio:.2f}x{verdict} |"
        )
    for line in lines:
        say(line)
    return lines


async def _mirrored(
    state: dict[str, torch.Tensor], local: Path, mirror: str, options: dict[str, Any]
) -> None:
    # One version committed locally and uploaded (closing waits for the upload); the local
    # write and its read-back for the mirror are the client's too.
    async with asyncstore.Checkpointer(
        local, mirror=mirror, mirror_options=options, compression=None
    ) as ckpt:
        await (await ckpt.save(state, 1))


async def _save(state: dict[str, torch.Tensor], url: str, options: dict[str, Any]) -> None:
    handle = await asyncstore.save(state, url, compression=None, store_options=options)
    await handle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="state size in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    args = parser.parse_args()
    lines = run(args.mib, args.rounds, lambda line: print(line, flush=True))
    if args.write:
        record("bench_s3_cost", "CPU per GiB of S3 checkpoints", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
