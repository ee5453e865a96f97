"""Checkpoint saves and loads: asyncstore beside raw writes, torch.save, DCP and a hand-written
aiobotocore multipart upload, all measured in one run.

A transformer-like state (embeddings, attention and MLP matrices, norms; random normal
values) of ``--size`` MiB, in fp32 and in bf16:

- the limit: the same bytes written raw to one file, then fsync;
- ``torch.save`` + fsync; DCP ``save`` and ``async_save`` (blocking and total time);
- asyncstore ``save`` (blocking and total; first and later saves; compression None and
  "auto"), with the extra memory it held at its peak;
- loads beside ``torch.load``;
- to S3 (SeaweedFS on loopback) beside a hand-written aiobotocore multipart upload;
- a training simulation: CPU steps with a save every K steps, throughput lost.

Run ``python benchmarks/bench_checkpoint.py`` (``--size 64`` for a quick run, ``--write`` to
record the tables in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from _baselines import aiobotocore_client, multipart_put
from _report import machine, record
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import asyncstore
from asyncstore.checkpoint import staging_pool
from asyncstore.testing import SeaweedFS
from asyncstore.torch import save_async

MiB = 1 << 20
Say = Callable[..., None]
Compression = Literal["auto", "zstd"] | None
BUCKET = "bench-checkpoint"


def transformer_state(size: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``size`` bytes of a decoder-only transformer's weights, as a state dict."""
    width = 1024 if size >= 256 * MiB else 256
    element = torch.empty(0, dtype=dtype).element_size()
    vocab = 32_000 if width == 1024 else 8_000
    per_layer = (12 * width * width + 4 * width) * element
    layers = max(1, (size - vocab * width * element) // per_layer)
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    state = {"embed.weight": weight(vocab, width)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            state[p + f"attn.{name}.weight"] = weight(width, width)
        state[p + "mlp.up.weight"] = weight(4 * width, width)
        state[p + "mlp.down.weight"] = weight(width, 4 * width)
        for norm in ("norm1", "norm2"):
            state[p + f"{norm}.weight"] = torch.ones(width, dtype=dtype)
            state[p + f"{norm}.bias"] = torch.zeros(width, dtype=dtype)
    state["lm_head.weight"] = state["embed.weight"]  # tied, as many models do
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()
    }
    return sum(storages.values())


def fsync_path(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class PeakMemory:
    """Samples this process's resident memory in a thread; ``extra`` is the peak over the
    level when it started."""

    def __init__(self) -> None:
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


@contextmanager
def timer() -> Iterator[list[float]]:
    out: list[float] = []
    started = time.perf_counter()
    yield out
    out.append(time.perf_counter() - started)


def settle() -> None:
    """Start every measurement alike: dirty pages written back, garbage collected."""
    gc.collect()
    os.sync()
    time.sleep(0.5)


def storage_bytes(state: dict[str, torch.Tensor]) -> Iterator[memoryview]:
    """Each storage's bytes once (tied weights share one), in the state's order."""
    seen: set[int] = set()
    for tensor in state.values():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            yield _memview(torch.empty(0, dtype=torch.uint8).set_(storage))


def raw_write(state: dict[str, torch.Tensor], path: Path) -> float:
    """The limit: every storage's bytes into one file, then fsync."""
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for view in storage_bytes(state):
            while view:
                view = view[f.write(view) :]
        os.fsync(f.fileno())
    return time.perf_counter() - started


def aligned_copy(state: dict[str, torch.Tensor]) -> mmap.mmap:
    """Every storage's bytes, one after another, in page-aligned memory (for O_DIRECT)."""
    size = nbytes(state)
    payload = mmap.mmap(-1, -(-size // 4096) * 4096)
    position = 0
    for view in storage_bytes(state):
        payload[position : position + len(view)] = view
        position += len(view)
    return payload


def direct_write(payload: mmap.mmap, path: Path, piece: int = 32 * MiB) -> float:
    """The device's limit: the same bytes from page-aligned memory, with O_DIRECT, then
    fsync (the page cache never sees them)."""
    view = memoryview(payload)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    try:
        for start in range(0, len(view), piece):
            chunk = view[start : start + piece]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    view.release()
    return time.perf_counter() - started


def _memview(flat: torch.Tensor) -> memoryview:
    array = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    return memoryview(array).cast("B")


def run_saves(label: str, state: dict[str, torch.Tensor], tmp: Path, say: Say) -> dict[str, float]:
    size = nbytes(state)
    results: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    payload = aligned_copy(state)

    def raw_once() -> None:
        settle()
        note("raw total", raw_write(state, tmp / "raw.bin"))
        drop(tmp / "raw.bin")
        settle()
        note("direct total", direct_write(payload, tmp / "direct.bin"))
        drop(tmp / "direct.bin")

    # Every writer starts from a missing target, as the raw write does: replacing a 1 GiB
    # file costs freeing the old one's blocks (0.17-0.21 s on this disk), which is not the
    # writer's doing.
    def torch_once() -> None:
        drop(tmp / "torch.pt")
        settle()
        with timer() as t:
            torch.save(state, tmp / "torch.pt")
            fsync_path(tmp / "torch.pt")
        note("torch.save total", t[0])

    def dcp_once(attempt: str, asynchronous: bool) -> None:
        target = tmp / f"dcp-{attempt}"
        settle()
        started = time.perf_counter()
        if asynchronous:
            future: Any = dcp_async_save(state, checkpoint_id=str(target))
            note(f"dcp async {attempt} blocking", time.perf_counter() - started)
            future.result()
        else:
            dcp_save(state, checkpoint_id=str(target))
        fsync_path(target)
        kind = "dcp async" if asynchronous else "dcp"
        note(f"{kind} {attempt} total", time.perf_counter() - started)
        drop(target)

    async def ours_once(compression: Compression, attempt: str) -> None:
        pool = staging_pool()
        if attempt == "first":
            pool.trim()
        target = tmp / f"ours-{compression}.ckpt"
        drop(target)
        settle()
        started = time.perf_counter()
        with PeakMemory() as memory:
            handle = await asyncstore.save(state, target, compression=compression)
            blocking = time.perf_counter() - started
            result = await handle
        name = f"ours {compression} {attempt}"
        note(f"{name} blocking", blocking)
        note(f"{name} total", time.perf_counter() - started)
        note(f"{name} extra", memory.extra)
        note(f"{name} ratio", result.stored_bytes / size)
        note("budget", pool.budget)

    compressions: tuple[Compression, ...] = (None, "auto")

    async def ours_first() -> None:
        for compression in compressions:
            await ours_once(compression, "first")

    async def ours_later() -> None:
        for compression in compressions:
            await ours_once(compression, "later")

    # First saves (fresh staging memory), then rounds that interleave the writers: this
    # disk's speed drifts by 2-3x from one minute to the next (write-back, throttling).
    # Our saves share one event loop, as a training job's do.
    with asyncio.Runner() as runner:
        runner.run(ours_first())
        dcp_once("first", False)
        dcp_once("first", True)
        for _ in range(3):
            raw_once()
            runner.run(ours_later())
            torch_once()
            dcp_once("later", False)
            dcp_once("later", True)

    def med(name: str) -> float:
        return statistics.median(results[name])

    raw = med("raw total")
    direct = med("direct total")
    say(f"### Saving a {size / MiB:,.0f} MiB {label} state to local disk")
    say()
    say(
        "Medians of 3 interleaved rounds (first saves: one run, fresh staging memory); "
        "blocking is the time until the call returned, total until the data was on disk."
    )
    say()
    say("| writer | blocking | total | total vs raw write | notes |")
    say("|---|---:|---:|---:|---|")

    def row(name: str, blocking: float | None, total: float, extra: str = "") -> None:
        block = f"{blocking:.2f} s" if blocking is not None else ""
        say(f"| {name} | {block} | {total:.2f} s | {total / raw:.2f}x | {extra} |")

    row("raw write + fsync of the same bytes (the limit)", None, raw)
    row(
        "O_DIRECT write + fsync of the same bytes from aligned memory (the device's limit)",
        None,
        direct,
        f"{direct / raw:.2f}x the buffered write",
    )
    row("torch.save + fsync", med("torch.save total"), med("torch.save total"))
    for attempt in ("first", "later"):
        row(f"DCP save ({attempt})", med(f"dcp {attempt} total"), med(f"dcp {attempt} total"))
    dcp_blocking = med("dcp async later blocking")
    for attempt in ("first", "later"):
        row(
            f"DCP async_save ({attempt})",
            med(f"dcp async {attempt} blocking"),
            med(f"dcp async {attempt} total"),
        )
    for compression in compressions:
        for attempt in ("first", "later"):
            name = f"ours {compression} {attempt}"
            blocking = med(f"{name} blocking")
            extra = (
                f"stored {med(f'{name} ratio'):.2f} of raw; peak extra memory "
                f"{max(results[f'{name} extra']) / MiB:,.0f} MiB (staging budget "
                f"{max(results['budget']) / MiB:,.0f} MiB)"
            )
            extra += f"; total {med(f'{name} total') / direct:.2f}x the O_DIRECT write"
            if attempt == "later":
                extra += f"; blocking {blocking / dcp_blocking:.2f}x DCP async_save's"
            row(
                f"asyncstore save, compression={compression!r} ({attempt})",
                blocking,
                med(f"{name} total"),
                extra,
            )
    torch_once()  # the file the loads below read
    summary = {name: med(name) for name in results}
    say()
    say(f"### Loading the {label} state (files in the page cache)")
    say()
    say("| reader | time | vs torch.load |")
    say("|---|---:|---:|")
    loads: dict[str, list[float]] = {}
    for _ in range(2):
        with timer() as t:
            torch.load(tmp / "torch.pt", weights_only=True)
        loads.setdefault("torch", []).append(t[0])
        with timer() as t:
            asyncstore.torch.load(tmp / "ours-auto.ckpt")
        loads.setdefault("auto", []).append(t[0])
        with timer() as t:
            asyncstore.torch.load(tmp / "ours-None.ckpt")
        loads.setdefault("none", []).append(t[0])
    base = min(loads["torch"])
    say(f"| torch.load (weights_only=True) | {base:.2f} s | 1.00x |")
    for key, name in (("none", "compression=None"), ("auto", "compression='auto'")):
        say(
            f"| asyncstore load, {name} | {min(loads[key]):.2f} s | {min(loads[key]) / base:.2f}x |"
        )
    summary["load torch"] = base
    summary["load ours"] = min(loads["none"])
    say()
    for name in ("torch.pt", "ours-None.ckpt", "ours-auto.ckpt"):
        drop(tmp / name)
    payload.close()
    return summary


def run_small_loads(tmp: Path, say: Say, rounds: int = 7) -> None:
    """Loads of a state of many small tensors (norms, biases, an optimizer's step counts),
    where the unpickling of the structure, not the bytes, sets the time."""
    generator = torch.Generator().manual_seed(2)
    model = collections.OrderedDict(
        (f"layers.{i}.{part}", torch.randn(64, generator=generator))
        for i in range(1000)
        for part in ("norm.weight", "norm.bias", "bias")
    )
    state = {"model": model, "step": 1000}
    torch.save(state, tmp / "small.pt")
    asyncstore.torch.save(state, tmp / "small.ckpt", compression=None)
    times: dict[str, list[float]] = {"torch": [], "ours": []}
    for _ in range(rounds):  # interleaved, so that drift hits both alike
        with timer() as t:
            torch.load(tmp / "small.pt", weights_only=True)
        times["torch"].append(t[0])
        with timer() as t:
            asyncstore.torch.load(tmp / "small.ckpt")
        times["ours"].append(t[0])
    base = statistics.median(times["torch"])
    ours = statistics.median(times["ours"])
    say(f"### Loading a state of {len(model):,} small tensors (medians of {rounds})")
    say()
    say("| reader | time | vs torch.load |")
    say("|---|---:|---:|")
    say(f"| torch.load (weights_only=True) | {base * 1000:.0f} ms | 1.00x |")
    say(f"| asyncstore load (weights_only=True) | {ours * 1000:.0f} ms | {ours / base:.2f}x |")
    say()


def run_s3(state: dict[str, torch.Tensor], tmp: Path, say: Say) -> None:
    size = nbytes(state)
    server = SeaweedFS(data_dir=tmp / "seaweedfs")
    server.start()
    try:
        server.create_bucket(BUCKET)
        options = server.store_options(part_bytes=16 * MiB, upload_max_inflight=4)
        payload = b"".join(storage_bytes(state))

        async def handwritten(key: str) -> float:
            # The baseline: one aiobotocore client, 16 MiB parts, 4 in flight.
            started = time.perf_counter()
            async with aiobotocore_client(server, 8) as client:
                await multipart_put(client, BUCKET, key, payload, 16 * MiB, 4)
            return time.perf_counter() - started

        async def ours(key: str, compression: Compression) -> tuple[float, float]:
            started = time.perf_counter()
            handle = await asyncstore.save(
                state, f"s3://{BUCKET}/{key}", compression=compression, store_options=options
            )
            blocking = time.perf_counter() - started
            await handle
            return blocking, time.perf_counter() - started

        async def run() -> None:
            base = statistics.median([await handwritten(f"hand-{i}") for i in range(2)])
            say(f"### Saving the {size / MiB:,.0f} MiB bf16 state to S3 (SeaweedFS on loopback)")
            say()
            say("| writer | blocking | total | vs hand-written multipart |")
            say("|---|---:|---:|---:|")
            say(
                "| aiobotocore multipart, 16 MiB parts, 4 in flight (baseline) | | "
                f"{base:.2f} s | 1.00x |"
            )
            compressions: tuple[Compression, ...] = (None, "auto")
            for compression in compressions:
                runs = [await ours(f"ours-{compression}-{i}", compression) for i in range(2)]
                blocking = statistics.median(r[0] for r in runs)
                total = statistics.median(r[1] for r in runs)
                say(
                    f"| asyncstore save, compression={compression!r} | {blocking:.2f} s | "
                    f"{total:.2f} s | {total / base:.2f}x |"
                )
            say()

        asyncio.run(run())
    finally:
        server.stop(timeout=1.0)


def simulate(state: dict[str, torch.Tensor], tmp: Path, say: Say, steps: int, every: int) -> None:
    """CPU training steps with a save every ``every`` steps: throughput lost to saving.

    Run twice: with the steps using every core, and leaving one core free (as a GPU job's
    host mostly is, and as data loading needs anyway).
    """
    size = nbytes(state)
    a = torch.randn(384, 384)

    def step() -> None:
        # A fixed amount of work standing in for forward and backward.
        x = a
        for _ in range(12):
            x = torch.tanh(x @ a)
        for tensor in list(state.values())[:4]:
            tensor.mul_(1.0)  # the optimizer touches the weights

    def run(save: Callable[[int], Any] | None) -> float:
        pending: list[Any] = []
        started = time.perf_counter()
        for i in range(1, steps + 1):
            step()
            if save is not None and i % every == 0:
                pending.append(save(i))
        for future in pending:
            if future is not None:
                future.result()
        return time.perf_counter() - started

    def with_torch(i: int) -> None:
        path = tmp / "sim.pt"
        torch.save(state, path)
        fsync_path(path)

    def with_ours(i: int) -> Any:
        return save_async(state, tmp / "sim.ckpt", compression=None)

    say(
        f"### Training simulation: {steps} CPU steps, a save of {size / MiB:,.0f} MiB every "
        f"{every} steps"
    )
    say()
    say("Medians of 2 interleaved rounds; the run time includes waiting for the last save.")
    say()
    say("| training threads | saving with | run time | throughput lost to checkpointing |")
    say("|---|---|---:|---:|")
    cores = os.cpu_count() or 1
    default_threads = torch.get_num_threads()
    for threads in sorted({cores, max(1, cores - 1)}, reverse=True):
        torch.set_num_threads(threads)
        # Interleaved and repeated: this machine's speed drifts from minute to minute.
        times: dict[str, list[float]] = {"none": [], "torch": [], "ours": []}
        for _ in range(2):
            for name, save in (("none", None), ("torch", with_torch), ("ours", with_ours)):
                settle()
                times[name].append(run(save))
        baseline = statistics.median(times["none"])
        label = f"{threads} of {cores} cores"
        for name, title in (
            ("none", "no saves (baseline)"),
            ("torch", "torch.save + fsync"),
            ("ours", "asyncstore.torch.save_async, compression=None"),
        ):
            value = statistics.median(times[name])
            lost = "" if name == "none" else f"{value / baseline - 1:.1%}"
            say(f"| {label} | {title} | {value:.2f} s | {lost} |")
    torch.set_num_threads(default_threads)
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    parser.add_argument(
        "--small-loads", action="store_true", help="only the loads of many small tensors"
    )
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"Machine: {machine()}")
    say()
    size = args.size * MiB
    with tempfile.TemporaryDirectory(
        prefix="bench-checkpoint-", dir=os.environ.get("BENCH_DIR")
    ) as name:
        tmp = Path(name)
        if args.small_loads:
            run_small_loads(tmp, say)
            if args.write:
                record("bench_checkpoint_small_loads", "Checkpoint loads of small tensors", lines)
            return 0
        run_small_loads(tmp, say)
        fp32 = transformer_state(size, torch.float32)
        run_saves("fp32", fp32, tmp, say)
        del fp32
        gc.collect()
        bf16 = transformer_state(size, torch.bfloat16)
        run_saves("bf16", bf16, tmp, say)
        run_s3(bf16, tmp, say)
        del bf16
        gc.collect()
        sim = transformer_state(size // 4, torch.float32, seed=1)
        simulate(sim, tmp, say, args.steps, args.every)
    if args.write:
        record("bench_checkpoint", "Checkpoints", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
