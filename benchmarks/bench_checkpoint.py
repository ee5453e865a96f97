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

``--differential`` runs only ten saves through a ``Checkpointer`` with a tenth of the state
changing between saves, full versions against differential ones (bytes written, time).

``--mirror`` runs only the comparison of a ``Checkpointer`` that commits to a local directory
and uploads to an S3 mirror (following the local write), against ``asyncstore.save``
straight to S3 and to a local file (blocking time, local commit, time until the version is
in S3), with a training simulation that checkpoints through the mirrored Checkpointer: a
state of ``--mib`` MiB (default 256) or ``--gib`` GiB in ``--tensors`` fp32 tensors;
``--pin`` keeps this process (training and asyncstore) and the SeaweedFS server on separate
cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import gc
import itertools
import logging
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
from _plots import publish, today
from _report import machine, record
from _server import bench_seaweedfs
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import asyncstore
from asyncstore.checkpoint import staging_pool
from asyncstore.testing import SeaweedFS
from asyncstore.torch import Checkpointer as SyncCheckpointer
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


def run_saves(
    label: str,
    state: dict[str, torch.Tensor],
    tmp: Path,
    say: Say,
    chart: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Saves of ``state`` by every writer, then loads; the table through ``say``, and the
    writers' blocking and total times into ``chart[label]`` (for the chart) when given."""
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

    async def torch_format_once() -> None:
        # torch's own file through asyncstore: a staging budget above the state's size,
        # so that the call returns after the snapshot (the commit fsyncs, as torch_once).
        target = tmp / "ours-torch.pt"
        drop(target)
        settle()
        started = time.perf_counter()
        with PeakMemory() as memory:
            handle = await asyncstore.save(
                state, target, format="torch", staging_bytes=max(size + MiB, 32 * MiB)
            )
            blocking = time.perf_counter() - started
            await handle
        note("ours torch blocking", blocking)
        note("ours torch total", time.perf_counter() - started)
        note("ours torch extra", memory.extra)
        drop(target)

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
            runner.run(torch_format_once())
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

    chart_rows: list[dict[str, Any]] = []

    def row(
        name: str, blocking: float | None, total: float, extra: str = "", short: str = ""
    ) -> None:
        chart_rows.append({"writer": short or name, "blocking": blocking, "total": total})
        block = f"{blocking:.2f} s" if blocking is not None else ""
        say(f"| {name} | {block} | {total:.2f} s | {total / raw:.2f}x | {extra} |")

    row("raw write + fsync of the same bytes (the limit)", None, raw, short="raw write + fsync")
    row(
        "O_DIRECT write + fsync of the same bytes from aligned memory (the device's limit)",
        None,
        direct,
        f"{direct / raw:.2f}x the buffered write",
        short="O_DIRECT write + fsync",
    )
    row("torch.save + fsync", med("torch.save total"), med("torch.save total"))
    torch_total = med("torch.save total")
    row(
        "asyncstore save, format='torch' (the same file as torch.save)",
        med("ours torch blocking"),
        med("ours torch total"),
        f"total {med('ours torch total') / torch_total:.2f}x torch.save's, blocking "
        f"{med('ours torch blocking') / torch_total:.2f}x; peak extra memory "
        f"{max(results['ours torch extra']) / MiB:,.0f} MiB",
        short="asyncstore save, format='torch'",
    )
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
                short=f"asyncstore save, {compression!r} ({attempt})",
            )
    if chart is not None:
        chart[label] = {"mib": size / MiB, "raw_total": raw, "rows": chart_rows}
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


BLOCK = 5  # loads in a row of one loader, in run_small_loads


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
    loaders: dict[str, Callable[[], object]] = {
        "torch": lambda: torch.load(tmp / "small.pt", weights_only=True),
        "ours": lambda: asyncstore.torch.load(tmp / "small.ckpt"),
    }
    # Blocks of loads, the two loaders alternating block by block (so that drift hits
    # both alike): within a block, each load pays for the garbage collections its own
    # allocations bring on. Loads interleaved one by one would bill one loader for the
    # collections the other's objects triggered.
    for _ in range(rounds):
        for name, load in loaders.items():
            with timer() as t:
                for _ in range(BLOCK):
                    load()
            times[name].append(t[0] / BLOCK)
    base = statistics.median(times["torch"])
    ours = statistics.median(times["ours"])
    say(
        f"### Loading a state of {len(model):,} small tensors (medians of {rounds} blocks of "
        f"{BLOCK} loads)"
    )
    say()
    say("| reader | time | vs torch.load |")
    say("|---|---:|---:|")
    say(f"| torch.load (weights_only=True) | {base * 1000:.0f} ms | 1.00x |")
    say(f"| asyncstore load (weights_only=True) | {ours * 1000:.0f} ms | {ours / base:.2f}x |")
    say()


def run_s3(state: dict[str, torch.Tensor], tmp: Path, say: Say) -> None:
    size = nbytes(state)
    server = bench_seaweedfs(tmp / "seaweedfs")
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


# -- local first, then the mirror ------------------------------------------------------------


def mirror_state(size: int, count: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """``count`` fp32 matrices of 1024 columns, about ``size`` bytes in all (random normal
    values, which do not compress)."""
    rows = max(1, size // count // (1024 * 4))
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.weight": torch.randn(rows, 1024, generator=gen) * 0.02 for i in range(count)
    }


def version_name(step: int) -> str:
    """A Checkpointer's name for the version of ``step`` (see docs/checkpoints.md)."""
    return f"step-{step:09d}.ckpt"


def _stat_cpu_seconds(stat: Path) -> float:
    """CPU time (user + system) in a process's or a thread's ``stat`` file under /proc."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    # utime and stime are the stat file's fields 14 and 15; the split starts at field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of process ``pid``, all its threads; this process's by
    default."""
    return _stat_cpu_seconds(Path(f"/proc/{pid or 'self'}/stat"))


def asyncstore_cpu_seconds() -> float:
    """CPU time (user + system) of this process's asyncstore threads: its event loop's and
    its worker threads' (named ``asyncstore...``), whatever else the process runs."""
    total = 0.0
    for thread in threading.enumerate():
        if not thread.name.startswith("asyncstore") or thread.native_id is None:
            continue
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total += _stat_cpu_seconds(Path(f"/proc/self/task/{thread.native_id}/stat"))
    return total


def busy_seconds() -> float:
    """CPU time the whole machine spent busy (every process, all cores) since boot."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def spread(values: list[float], unit: str = "s") -> str:
    """The median, and the range when there are several values: ``0.12 s (0.11-0.14)``."""
    med = statistics.median(values)
    if len(values) < 2:
        return f"{med:.2f} {unit}"
    return f"{med:.2f} {unit} ({min(values):.2f}-{max(values):.2f})"


def count_range(values: list[float]) -> str:
    """``2``, or ``2-3`` when they differ."""
    low, high = min(values), max(values)
    return f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"


class Warnings(logging.Handler):
    """The warnings asyncstore logs during a benchmark (a failed upload's reason, above
    all), kept for the report: a figure that counts failures should say what they were."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        # Shown as it comes too, as Python shows a warning no handler takes.
        print(f"{record.levelname}: {record.name}: {record.getMessage()}", file=sys.stderr)
        self.seen[record.getMessage()] += 1

    def report(self, say: Say) -> None:
        """Say each distinct warning with its count, if there were any."""
        if self.seen:
            say()
            say("Warnings logged by asyncstore:")
            common = self.seen.most_common()
            for message, count in common[:10]:
                say(f"- {count} x {message}")
            if len(common) > 10:
                say(f"- and {len(common) - 10} other messages")


WARNINGS = Warnings()
logging.getLogger("asyncstore").addHandler(WARNINGS)


def verdict(value: float, limit: float) -> str:
    return "PASS" if value <= limit else "MISS"


class MirrorBench:
    """Issue 13's goal, measured in one run against one SeaweedFS server: a Checkpointer
    that commits to a local directory and then uploads to an S3 mirror, beside
    ``asyncstore.save`` straight to S3 and ``asyncstore.save`` to a local file."""

    POLL_SECONDS = 0.05
    """How often the mirror is listed while waiting for a version to appear there: the
    resolution of the "in S3" times, at 20 LIST requests a second."""

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        tmp: Path,
        server: SeaweedFS,
        compression: Compression,
        say: Say,
    ) -> None:
        self.state = state
        self.tmp = tmp
        self.server = server
        self.compression: Compression = compression
        self.say = say
        # The same S3 options for the direct saves and the mirror.
        self.options = server.store_options(part_bytes=16 * MiB, upload_max_inflight=4)
        self.results: dict[str, list[float]] = {}

    def note(self, name: str, value: float) -> None:
        self.results.setdefault(name, []).append(value)

    # The three ways of saving, each from a settled machine and an empty target.

    async def local_once(self, step: int) -> None:
        target = self.tmp / "local" / version_name(step)
        settle()
        started = time.perf_counter()
        handle = await asyncstore.save(self.state, target, compression=self.compression)
        self.note("local blocking", time.perf_counter() - started)
        await handle
        self.note("local total", time.perf_counter() - started)
        drop(target)

    async def direct_once(self, step: int) -> None:
        url = f"s3://{BUCKET}/direct/{version_name(step)}"
        settle()
        started = time.perf_counter()
        handle = await asyncstore.save(
            self.state, url, compression=self.compression, store_options=self.options
        )
        self.note("direct blocking", time.perf_counter() - started)
        await handle
        self.note("direct total", time.perf_counter() - started)

    async def mirrored_once(self, step: int) -> None:
        local = self.tmp / f"mirrored-{step}"
        settle()
        async with asyncstore.Checkpointer(
            local,
            mirror=f"s3://{BUCKET}/mirrored-{step}",
            mirror_options=self.options,
            keep_last=2,
            compression=self.compression,
        ) as ckpt:
            # Opened, and its look for unfinished uploads done, before the clock starts,
            # as in a run that has been going for a while.
            await ckpt.versions()
            await asyncio.sleep(0.2)
            started = time.perf_counter()
            handle = await ckpt.save(self.state, step)
            self.note("mirror blocking", time.perf_counter() - started)
            await handle
            self.note("mirror local commit", time.perf_counter() - started)
            deadline = started + 600
            while not any(v.step == step and v.where == "both" for v in await ckpt.versions()):
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"step {step} never reached the mirror: {ckpt.stats()}")
                await asyncio.sleep(self.POLL_SECONDS)
            self.note("mirror in S3", time.perf_counter() - started)
            # Then checked (the ETag, or a read-back), before it counts as mirrored.
            while ckpt.stats().uploads < 1:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"step {step} was never checked: {ckpt.stats()}")
                await asyncio.sleep(0.01)
            self.note("mirror checked", time.perf_counter() - started)
            stats = ckpt.stats()
            self.note("upload seconds", stats.last_upload_seconds)
            self.note("early MiB", stats.bytes_uploaded_early / MiB)
            self.note("upload failures", stats.upload_failures)
        drop(local)

    def saves(self, rounds: int) -> None:
        """Every kind once untimed (staging memory faulted in, SeaweedFS's volumes made),
        then ``rounds`` rounds, the order rotating from one round to the next."""
        kinds = [self.local_once, self.direct_once, self.mirrored_once]
        with asyncio.Runner() as runner:
            for kind in kinds:
                runner.run(kind(1))
            self.results.clear()
            own, served, busy = cpu_seconds(), cpu_seconds(self.server.pid), busy_seconds()
            started = time.perf_counter()
            for r in range(rounds):
                for kind in kinds[r % 3 :] + kinds[: r % 3]:
                    runner.run(kind(1000 * (r + 1)))
            self.note("saves seconds", time.perf_counter() - started)
            others = busy_seconds() - busy - (cpu_seconds() - own)
            self.note("saves other cpu", others - (cpu_seconds(self.server.pid) - served))

    def simulate(
        self, steps: int, every: int, rounds: int, thread_counts: list[int], pin: bool = False
    ) -> dict[str, list[float]]:
        """CPU training steps, with no checkpoints and with a mirrored Checkpointer saving
        every ``every`` steps (not at the last step: the last upload overlaps the steps after
        it, as it would in a longer run), the steps on each of ``thread_counts`` threads.
        The two kinds of run alternate, so that the machine's drift hits both alike.

        ``pin`` (one training thread only): this process (training and asyncstore alike)
        runs on the first core, the SeaweedFS server on the others, as if the S3 server
        were another machine: asyncstore's work then costs training its own core time."""
        everywhere = os.sched_getaffinity(0)
        first = min(everywhere)

        def place(cores: set[int] | None = None) -> None:
            # Threads started later inherit their starter's cores.
            for pid in (None, self.server.pid):
                for task in os.listdir(f"/proc/{pid or 'self'}/task"):
                    tid = int(task)
                    if cores is not None:
                        target = cores
                    else:
                        target = {first} if pid is None else everywhere - {first}
                    with contextlib.suppress(ProcessLookupError):  # a thread that ended
                        os.sched_setaffinity(tid, target or everywhere)

        a = torch.randn(384, 384)
        tensors = list(self.state.values())

        def step(i: int) -> None:
            # A fixed amount of work standing in for forward and backward.
            x = a
            for _ in range(12):
                x = torch.tanh(x @ a)
            # The optimizer changes the weights, one tensor a step in turn: with a save every
            # len(tensors) steps or more, every byte differs from the previous version's, as
            # in training, and a differential save has nothing to skip.
            tensors[i % len(tensors)].add_(1e-7)

        times: dict[str, list[float]] = {}

        def note(name: str, value: float) -> None:
            times.setdefault(name, []).append(value)

        runs = itertools.count()

        def run(name: str, mirrored: bool) -> None:
            ckpt: SyncCheckpointer | None = None
            n = next(runs)  # each run starts from an empty directory and prefix
            local = self.tmp / f"sim-{n}"
            settle()
            if mirrored:
                ckpt = SyncCheckpointer(
                    local,
                    mirror=f"s3://{BUCKET}/sim-{n}",
                    mirror_options=self.options,
                    keep_last=2,
                    compression=self.compression,
                )
                ckpt.versions()  # opened before the clock starts
                time.sleep(0.2)
            if pin:
                place()
            cpu, server_cpu, busy = cpu_seconds(), cpu_seconds(self.server.pid), busy_seconds()
            own = asyncstore_cpu_seconds()
            blocking = 0.0
            started = time.perf_counter()
            for i in range(1, steps + 1):
                step(i)
                if ckpt is not None and i % every == 0 and i < steps:
                    before = time.perf_counter()
                    ckpt.save(self.state, i)
                    blocking += time.perf_counter() - before
            note(f"{name} loop", time.perf_counter() - started)
            if ckpt is not None:
                ckpt.close()  # waits for the uploads and retention still going on
                stats = ckpt.stats()
                note(f"{name} saves", stats.saves)
                note(f"{name} uploads", stats.uploads)
                note(f"{name} upload failures", stats.upload_failures)
            note(f"{name} total", time.perf_counter() - started)
            note(f"{name} blocking", blocking)
            used, served = cpu_seconds() - cpu, cpu_seconds(self.server.pid) - server_cpu
            note(f"{name} cpu", used)
            note(f"{name} asyncstore cpu", asyncstore_cpu_seconds() - own)
            note(f"{name} server cpu", served)
            # What other processes took meanwhile: a run that shared the cores with
            # something else shows it here.
            note(f"{name} other cpu", busy_seconds() - busy - used - served)
            drop(local)

        default_threads = torch.get_num_threads()
        try:
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for r in range(rounds):
                    kinds = [("none", False), ("mirror", True)]
                    for kind, mirrored in kinds if r % 2 == 0 else kinds[::-1]:
                        run(f"{threads} {kind}", mirrored)
        finally:
            torch.set_num_threads(default_threads)
            if pin:
                place(everywhere)
        return times

    def report_saves(self, rounds: int) -> None:
        say, res = self.say, self.results
        size = nbytes(self.state)

        def med(name: str) -> float:
            return statistics.median(res[name])

        say(
            f"### Local first with an S3 mirror, against straight to S3: "
            f"{size / MiB:,.0f} MiB fp32 in {len(self.state)} tensors"
        )
        say()
        say(
            f"compression={self.compression!r}, so that every writer stores the same bytes; "
            f"S3 options: 16 MiB parts, 4 in flight. Medians of {rounds} rounds (order "
            "rotating), range in brackets; every time counts from the call. *Blocking*: "
            "until the call returned. *Local commit*: `await handle`. *In S3*: the version "
            "listed in S3 (`versions()` giving `where == 'both'`, asked every "
            f"{self.POLL_SECONDS * 1000:.0f} ms). "
            "*Checked*: the mirror's copy checked (the server's CRC32C of every part "
            "against what was sent), counted in `stats().uploads`."
        )
        say()
        say("| save | blocking | local commit | in S3 | checked |")
        say("|---|---:|---:|---:|---:|")
        say(
            "| `asyncstore.save` to a local file | "
            f"{spread(res['local blocking'])} | {spread(res['local total'])} | | |"
        )
        say(
            "| `asyncstore.save` straight to S3 | "
            f"{spread(res['direct blocking'])} | | {spread(res['direct total'])} | |"
        )
        say(
            "| `Checkpointer(local, mirror=s3)`, `save` | "
            f"{spread(res['mirror blocking'])} | {spread(res['mirror local commit'])} | "
            f"{spread(res['mirror in S3'])} | {spread(res['mirror checked'])} |"
        )
        say()
        say(
            f"The mirror's upload (`stats().last_upload_seconds`: from the pack's start, "
            f"during the save, to the version's check) took {spread(res['upload seconds'])}, "
            f"{spread(res['early MiB'], 'MiB')} of it sent before the local commit; "
            f"{sum(res['upload failures']):.0f} upload attempts failed. Other processes "
            f"used {med('saves other cpu'):.1f} CPU seconds during these "
            f"{med('saves seconds'):.0f} s of saves (the machine's noise)."
        )
        say()

    def report_simulation(
        self,
        sim: dict[str, list[float]],
        steps: int,
        every: int,
        rounds: int,
        thread_counts: list[int],
        pin: bool = False,
    ) -> dict[int, float]:
        """The simulation's table; returns the throughput lost by training threads."""
        say = self.say
        size = nbytes(self.state)
        cores = os.cpu_count() or 1
        say(
            f"### Training simulation: {steps} CPU steps, the mirrored Checkpointer saving the "
            f"{size / MiB:,.0f} MiB state every {every} steps"
        )
        say()
        say(
            f"Medians of {rounds} rounds, the two kinds of run alternating. Steps/s counts "
            "the training loop; the throughput lost is the median of the rounds' own ratios "
            "(each round's run with checkpoints against its run without). The run's end "
            "waits for the last upload (closing the checkpointer). CPU seconds to the run's "
            "end: this process's (training and asyncstore), of which asyncstore's own "
            "threads (its event loop and workers), the SeaweedFS server's, which shares the "
            "same cores, and every other process's (the machine's noise)."
            + (
                " Pinned: this process (training and asyncstore) on one core, SeaweedFS on "
                "the other."
                if pin
                else ""
            )
        )
        say()
        say(
            "| training threads | checkpointing | steps/s | throughput lost | "
            "blocked in save | to the run's end | CPU, process | of which asyncstore's | "
            "CPU, SeaweedFS | CPU, others |"
        )
        say("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        lost_by_threads: dict[int, float] = {}
        for threads in thread_counts:
            paired = zip(sim[f"{threads} mirror loop"], sim[f"{threads} none loop"], strict=True)
            lost_by_threads[threads] = statistics.median(m / n - 1 for m, n in paired)
            for kind, title in (("none", "none (baseline)"), ("mirror", "Checkpointer + mirror")):
                name = f"{threads} {kind}"
                loop = statistics.median(sim[f"{name} loop"])
                lost = f"{lost_by_threads[threads]:.1%}" if kind == "mirror" else ""
                blocked = f"{statistics.median(sim[name + ' blocking']):.2f} s"
                say(
                    f"| {threads} of {cores} cores | {title} | {steps / loop:.1f} | {lost} | "
                    f"{blocked if kind == 'mirror' else ''} | "
                    f"{statistics.median(sim[name + ' total']):.2f} s | "
                    f"{statistics.median(sim[name + ' cpu']):.1f} s | "
                    f"{statistics.median(sim[name + ' asyncstore cpu']):.2f} s | "
                    f"{statistics.median(sim[name + ' server cpu']):.1f} s | "
                    f"{statistics.median(sim[name + ' other cpu']):.1f} s |"
                )
        uploads = [u for t in thread_counts for u in sim[f"{t} mirror uploads"]]
        saves = [s for t in thread_counts for s in sim[f"{t} mirror saves"]]
        failures = [f for t in thread_counts for f in sim[f"{t} mirror upload failures"]]
        say()
        say(
            f"Each run with checkpoints committed {count_range(saves)} versions and uploaded "
            f"{count_range(uploads)}; {sum(failures):.0f} upload attempts failed. Each "
            "round's loop times, without and with checkpoints:"
        )
        for threads in thread_counts:
            pairs = zip(sim[f"{threads} none loop"], sim[f"{threads} mirror loop"], strict=True)
            rounds_text = ", ".join(f"{n:.2f} / {m:.2f} s ({m / n - 1:+.1%})" for n, m in pairs)
            say(f"- {threads} training thread{'s' if threads > 1 else ''}: {rounds_text}")
        say()
        for threads in thread_counts:
            used = sim[f"{threads} mirror asyncstore cpu"]
            own = statistics.median(used)
            base = statistics.median(sim[f"{threads} none loop"])
            say(
                f"asyncstore's own threads used {own:.2f} CPU seconds per run with checkpoints "
                f"({min(used):.2f}-{max(used):.2f} over the rounds; "
                f"{threads} training thread{'s' if threads > 1 else ''}), "
                f"{own / base:.1%} of the baseline run's {base:.2f} s: the part of the "
                "throughput lost that is asyncstore's own work"
                + (", on the training core" if pin else "")
                + ". The rest of the loss is the training steps running slower beside it, and "
                "the rounds' spread."
            )
        say()
        return lost_by_threads

    def report_goals(self, lost_by_threads: dict[int, float]) -> None:
        say, res = self.say, self.results
        cores = os.cpu_count() or 1

        def med(name: str) -> float:
            return statistics.median(res[name])

        blocking_ratio = med("mirror blocking") / med("local blocking")
        mirror_ratio = med("mirror in S3") / med("direct total")
        checked_ratio = med("mirror checked") / med("direct total")
        say("### Against the goals")
        say()
        say("| goal | measured | reading |")
        say("|---|---:|---|")
        say(
            "| blocking the same as a local save (<= 1.2x `asyncstore.save` to a local file) | "
            f"{blocking_ratio:.2f}x | {verdict(blocking_ratio, 1.2)} |"
        )
        say(
            "| in S3 <= 1.1x the direct S3 save's total | "
            f"{mirror_ratio:.2f}x | {verdict(mirror_ratio, 1.1)} |"
        )
        say(
            "| (the same, counting the check of the copy) | "
            f"{checked_ratio:.2f}x | {verdict(checked_ratio, 1.1)} |"
        )
        for threads, share in lost_by_threads.items():
            say(
                f"| training throughput lost <= 5%, {threads} of {cores} cores training | "
                f"{share:.1%} | {verdict(share, 0.05)} |"
            )
        say()


def run_differential(size: int, tmp: Path, say: Say, saves: int = 10) -> None:
    """Issue 13's goal for differential saves: ``saves`` saves of one state through a
    Checkpointer, about a tenth of its bytes changing between saves (a different tenth each
    time), full versions (``differential=False``) against differential ones, alternating
    save by save, to local disk."""
    state = transformer_state(size, torch.float32, seed=3)
    names = sorted(k for k in state if k != "lm_head.weight")  # tied: changes with embed
    total = nbytes(state)

    def change(step: int) -> int:
        # Tensors from a point that moves with the step, until a tenth of the bytes: as a
        # run whose layers do not all change between two saves.
        changed = 0
        start = step * len(names) // 10
        with torch.no_grad():
            for name in names[start:] + names[:start]:
                size = state[name].numel() * state[name].element_size()
                if changed + size > total * 0.105:
                    continue  # too large for what is left of the tenth
                state[name].add_(1e-3)
                changed += size
        return changed

    async def go() -> list[tuple[int, Any, Any]]:
        rows = []
        async with (
            asyncstore.Checkpointer(tmp / "full", keep_last=3, differential=False) as full,
            asyncstore.Checkpointer(tmp / "diff", keep_last=3) as diff,
        ):
            for step in range(saves):
                changed = change(step) if step else 0
                # In a thread: the retention after the last commit (deleting a version)
                # goes on in the event loop meanwhile, not during the next save.
                await asyncio.to_thread(settle)
                a = await (await full.save(state, step))
                await asyncio.to_thread(settle)
                b = await (await diff.save(state, step))
                rows.append((changed, a, b))
        return rows

    rows = asyncio.run(go())
    say(f"### Differential saves: {saves} saves of {total / MiB:.0f} MiB fp32, a tenth changing")
    say()
    say(
        "`Checkpointer(differential=False)` (every version whole) against the default "
        "(differential), to local disk, the two alternating save by save; compression "
        "'auto'. Between saves about a tenth of the bytes change, a different tenth each "
        "time. *Written*: `SaveResult.stored_bytes`; *total*: from the call to the commit."
    )
    say()
    say(
        "| save | changed | full: written | full: total | differential: written "
        "| differential: total | skipped |"
    )
    say("|---:|---:|---:|---:|---:|---:|---:|")
    for step, (changed, a, b) in enumerate(rows):
        say(
            f"| {step} | {changed / MiB:.0f} MiB | {a.stored_bytes / MiB:.0f} MiB | "
            f"{a.total_seconds:.2f} s | {b.stored_bytes / MiB:.1f} MiB | "
            f"{b.total_seconds:.2f} s | {b.skipped_bytes / MiB:.0f} MiB |"
        )
    later = rows[1:]  # the first save of each is whole
    full_bytes = statistics.median(a.stored_bytes for _, a, _ in later)
    diff_bytes = statistics.median(b.stored_bytes for _, _, b in later)
    full_time = statistics.median(a.total_seconds for _, a, _ in later)
    diff_time = statistics.median(b.total_seconds for _, _, b in later)
    say()
    say(f"Medians of saves 1-{saves - 1}:")
    say()
    say("| goal | measured | reading |")
    say("|---|---:|---|")
    written = diff_bytes / full_bytes
    say(
        f"| differential writes <= 15% of a full save's bytes | {written:.1%} "
        f"({diff_bytes / MiB:.0f} of {full_bytes / MiB:.0f} MiB) | {verdict(written, 0.15)} |"
    )
    ratio = diff_time / full_time
    say(
        f"| differential total <= 0.3x a full save's | {ratio:.2f}x "
        f"({diff_time:.2f} s against {full_time:.2f} s) | {verdict(ratio, 0.3)} |"
    )
    say()


def run_mirror(
    tmp: Path,
    say: Say,
    size: int,
    tensors: int,
    rounds: int,
    steps: int,
    every: int,
    sim_rounds: int,
    thread_counts: list[int],
    compression: Compression,
    pin: bool,
    server_dir: Path | None = None,
) -> None:
    state = mirror_state(size, tensors)
    with contextlib.ExitStack() as stack:
        where = tmp
        if server_dir is not None:
            where = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=server_dir)))
            say(f"SeaweedFS keeps its data in {server_dir}, not on the checkpoints' disk.")
            say()
        server = bench_seaweedfs(where / "seaweedfs")
        server.start()
        stack.callback(server.stop, timeout=1.0)
        server.create_bucket(BUCKET)
        bench = MirrorBench(state, tmp, server, compression, say)
        bench.saves(rounds)
        bench.report_saves(rounds)
        sim = bench.simulate(steps, every, sim_rounds, thread_counts, pin)
        lost = bench.report_simulation(sim, steps, every, sim_rounds, thread_counts, pin)
        bench.report_goals(lost)
        WARNINGS.report(say)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--size",
        "--mib",
        dest="mib",
        type=int,
        help="state size in MiB (default 1024; 256 with --mirror)",
    )
    sizes.add_argument("--gib", type=float, help="state size in GiB")
    parser.add_argument("--steps", type=int, help="training steps (default 800; 750 with --mirror)")
    parser.add_argument(
        "--every", type=int, help="steps between saves (default 200; 250 with --mirror)"
    )
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    parser.add_argument(
        "--small-loads", action="store_true", help="only the loads of many small tensors"
    )
    parser.add_argument(
        "--mirror",
        action="store_true",
        help="only the Checkpointer with an S3 mirror against saving straight to S3",
    )
    parser.add_argument(
        "--differential",
        action="store_true",
        help="only the Checkpointer's differential saves against full versions",
    )
    parser.add_argument("--tensors", type=int, default=50, help="with --mirror: tensors")
    parser.add_argument("--rounds", type=int, default=3, help="with --mirror: rounds of saves")
    parser.add_argument(
        "--sim-rounds", type=int, default=4, help="with --mirror: rounds of the simulation"
    )
    parser.add_argument(
        "--sim-threads",
        type=int,
        nargs="+",
        help="with --mirror: training threads of the simulation, one setting after another "
        "(default: all cores but one, which a GPU job's host leaves to I/O and data loading)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="with --mirror --sim-threads 1: this process (training and asyncstore) on one "
        "core, SeaweedFS on the others",
    )
    parser.add_argument(
        "--server-dir",
        type=Path,
        help="with --mirror: where SeaweedFS keeps its data (default: beside the local "
        "checkpoints, on the same disk); a tmpfs such as /dev/shm models an S3 whose disks "
        "are not the training node's",
    )
    parser.add_argument(
        "--compression",
        choices=("none", "auto"),
        default="none",
        help="with --mirror: compression of every save",
    )
    args = parser.parse_args()
    sim_threads = args.sim_threads or [max(1, (os.cpu_count() or 1) - 1)]
    if args.pin and sim_threads != [1]:
        parser.error("--pin needs --sim-threads 1")
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"Machine: {machine()}")
    say()
    if args.gib is not None:
        size = int(args.gib * 1024) * MiB
    else:
        size = (args.mib or (256 if args.mirror else 1024)) * MiB
    with tempfile.TemporaryDirectory(
        prefix="bench-checkpoint-", dir=os.environ.get("BENCH_DIR")
    ) as name:
        tmp = Path(name)
        if args.mirror:
            compression: Compression = None if args.compression == "none" else "auto"
            run_mirror(
                tmp,
                say,
                size,
                args.tensors,
                args.rounds,
                args.steps or 750,
                args.every or 250,
                args.sim_rounds,
                sim_threads,
                compression,
                args.pin,
                args.server_dir,
            )
            if args.write:
                record(
                    "bench_checkpoint_mirror" + ("_pinned" if args.pin else ""),
                    "Checkpoints: local first, then the mirror"
                    + (" (training process and SeaweedFS pinned apart)" if args.pin else ""),
                    lines,
                    script="bench_checkpoint",
                )
            return 0
        if args.differential:
            run_differential(size, tmp, say)
            if args.write:
                record(
                    "bench_checkpoint_differential",
                    "Checkpoints: differential saves",
                    lines,
                    script="bench_checkpoint",
                )
            return 0
        if args.small_loads:
            run_small_loads(tmp, say)
            if args.write:
                record("bench_checkpoint_small_loads", "Checkpoint loads of small tensors", lines)
            return 0
        run_small_loads(tmp, say)
        fp32 = transformer_state(size, torch.float32)
        saves: dict[str, Any] = {}
        run_saves("fp32", fp32, tmp, say, saves)
        del fp32
        gc.collect()
        bf16 = transformer_state(size, torch.bfloat16)
        run_saves("bf16", bf16, tmp, say, saves)
        run_s3(bf16, tmp, say)
        del bf16
        gc.collect()
        sim = transformer_state(size // 4, torch.float32, seed=1)
        simulate(sim, tmp, say, args.steps or 800, args.every or 200)
    if args.write:
        record("bench_checkpoint", "Checkpoints", lines)
        publish("bench_checkpoint", {"date": today(), "machine": machine(), "saves": saves})
    return 0


if __name__ == "__main__":
    sys.exit(main())
