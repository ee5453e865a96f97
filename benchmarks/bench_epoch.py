"""An epoch's cost on the training node: planning it on a busy machine, and warm epochs
against a DataLoader over the same samples as plain local files.

Planning: the epoch plan of 10 million keys (``EpochOrder.slices``, indices as Python ints)
in a fresh process, with and without a CPU hog (a busy-looping process pinned to the last
core), planned on the calling thread (what the dataset does) and, as the baseline, with the
same arithmetic on torch's intra-op pool at its default size (what it did before).

Warm epochs: StreamingDataset in a DataLoader with the dataset 3x the memory tier (served
from the disk tier), against the same DataLoader over a dataset of plain ``open().read()``
of the same samples as local files; and with the memory tier holding the whole dataset,
against the same DataLoader over the samples in a list in memory, read in a shuffled order
(and, for reference, in its stored order). Same decode, same batches per worker, same
collate (``torch.stack``, the DataLoader's default for tensors), same run.

Each side's page faults a sample are counted too (this process and its workers): glibc's
malloc gives the top of its heap back to the kernel once enough of it is free, and the
next batch's tensor (``torch.stack``'s output, 3.2 MB here) then faults its pages in anew,
a sample's worth of them being about 12 faults of 4 KiB. Whether a side's batches land
there depends on the heap's layout, which differs from run to run and between the sides
in one process: without workers, the ratio swings with it. ``--steady-heap`` fixes
malloc's trim and mmap thresholds (``mallopt``, as the ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` variables do) for both sides, which compares the samples' own
handling; the default allocator's figures are the ones a job gets without such settings.

Run ``python benchmarks/bench_epoch.py`` (``--write`` records the tables in
docs/benchmarks.md). The machine is shared: rerun, and read ratios, not rates.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _report import machine, record
from bench_dataset import BATCH, InMemory, PlainFiles, as_tensor, epoch, loader_for
from torch.utils.data import DataLoader

from asyncstore.torch import StreamingDataset, _order

Say = Callable[..., None]  # say(line="")
MAX_WARMUPS = 20  # untimed warm epochs at most, before the memory rows are timed


# -- planning ----------------------------------------------------------------------------------


def torch_permute(order: _order.EpochOrder, positions: torch.Tensor) -> torch.Tensor:
    """The order's arithmetic in torch, on its intra-op pool: how plans were computed before
    (the baseline). The same values as ``order.permute``."""
    low_bits, low_mask, high_mask = order._low_bits, order._low_mask, order._high_mask

    def feistel(values: torch.Tensor) -> torch.Tensor:
        high, low = values >> low_bits, values & low_mask
        for step, key in enumerate(order._keys):
            source, mask, target = (
                (low, high_mask, high) if step % 2 == 0 else (high, low_mask, low)
            )
            mixed = (source ^ (key & _order._LOW31)) * _order._MUL1
            mixed ^= mixed >> 31
            mixed = (mixed & _order._LOW31) * _order._MUL2
            mixed ^= mixed >> 29
            mixed ^= key >> 33
            target ^= mixed & mask
        return (high << low_bits) | low

    out = feistel(positions)
    waiting = (out >= order.count).nonzero().flatten()
    values = out[waiting]
    while len(waiting):
        values = feistel(values)
        inside = values < order.count
        out[waiting[inside]] = values[inside]
        waiting, values = waiting[~inside], values[~inside]
    return out


def plan_child(mode: str, count: int) -> tuple[float, float]:
    """Wall and CPU seconds (all threads) to plan an epoch of ``count`` keys in this (fresh)
    process: ``mode`` "thread" as the dataset plans it, "pool" in torch on its intra-op pool
    (the baseline), both in slices of ``SLICE`` positions, as Python ints."""
    threads = torch.get_num_threads()
    started, cpu = time.perf_counter(), time.process_time()
    order = _order.EpochOrder(count, seed=0, epoch=0, shuffle=True, rank=0, world=1)
    planned = 0
    if mode == "pool":
        for first in range(0, count, _order.SLICE):
            local = torch.arange(first, min(first + _order.SLICE, count))
            planned += len(torch_permute(order, local).tolist())
    else:
        planned = sum(len(part.tolist()) for part in order.slices())
    took, used = time.perf_counter() - started, time.process_time() - cpu
    assert planned == count
    assert torch.get_num_threads() == threads  # the pool keeps its size
    return took, used


def start_hog() -> subprocess.Popen[bytes]:
    """A process that busy-loops on the machine's last core until it is killed."""
    last = max(os.sched_getaffinity(0))
    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {last}),
    )


def plan_once(mode: str, count: int) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--plan-child", mode, str(count)],
        capture_output=True,
        text=True,
        check=True,
    )
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return float(wall), float(cpu)


def run_plan(count: int, repeats: int, say: Say) -> None:
    """Plan times, median of ``repeats`` fresh processes each, the modes alternating."""
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for hog in (False, True):
        process = start_hog() if hog else None
        try:
            time.sleep(0.2 if hog else 0.0)
            for _ in range(repeats):
                for mode in ("pool", "thread"):
                    times.setdefault((mode, hog), []).append(plan_once(mode, count))
        finally:
            if process is not None:
                process.kill()
                process.wait()
    med = {k: statistics.median(wall for wall, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(used for _, used in v) for k, v in times.items()}
    say(f"### Planning an epoch of {count:,} keys (median of {repeats} fresh processes)")
    say()
    say(
        "The plan: every index of one rank's epoch, shuffled, as Python ints "
        "(`EpochOrder.slices`). *With a CPU hog*: a busy-looping process pinned to the last "
        "core. Baseline, in the same run: the same arithmetic on torch's intra-op pool at its "
        "default size, as plans were computed before."
    )
    say()
    say(
        "| planned | idle | with a CPU hog | with the hog vs idle | range with the hog "
        "| CPU s idle | CPU s with the hog |"
    )
    say("|---|---:|---:|---:|---:|---:|---:|")
    for mode, label in (
        ("pool", "on torch's intra-op pool (baseline)"),
        ("thread", "on the calling thread (the dataset's way)"),
    ):
        idle, busy = med[(mode, False)], med[(mode, True)]
        walls = [wall for wall, _ in times[(mode, True)]]
        say(
            f"| {label} | {idle:.2f} s | {busy:.2f} s | {busy / idle:.1f}x | "
            f"{min(walls):.2f}-{max(walls):.2f} s | {cpu[(mode, False)]:.2f} | "
            f"{cpu[(mode, True)]:.2f} |"
        )
    say()
    say(
        f"With the hog: the calling thread's way takes "
        f"{med[('thread', True)] / med[('pool', True)]:.2f}x the baseline's time "
        f"(goal: at most 2 s; measured {med[('thread', True)]:.2f} s)."
    )
    say()


# -- warm epochs -------------------------------------------------------------------------------


def minor_faults() -> int:
    """Minor page faults so far of this process and its children (the DataLoader's
    workers), from /proc; 0 where there is none."""
    total = 0
    try:
        pids = [str(os.getpid())]
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += f.read().split()
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])  # minflt
    except OSError:
        pass  # no /proc, or a worker that just ended: counted as far as it went
    return total


def steady_heap() -> None:
    """Fix glibc malloc's trim threshold (never give the heap's top back) and mmap
    threshold (32 MiB, its most), as a job sets them with ``MALLOC_TRIM_THRESHOLD_`` and
    ``MALLOC_MMAP_THRESHOLD_``; forked workers inherit them."""
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if not (libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20)):
        raise SystemExit("mallopt refused the thresholds: is this glibc?")


def timed(loader: DataLoader[object], expected: int) -> tuple[float, float, int]:
    """Wall seconds, this process's CPU seconds (all its threads) and the minor page faults
    of this process and its workers, for one epoch."""
    cpu, faults = time.process_time(), minor_faults()
    wall = epoch(loader, expected)  # type: ignore[arg-type]
    return wall, time.process_time() - cpu, minor_faults() - faults


def run_warm(
    tmp: Path, objects: int, size: int, workers_list: list[int], repeats: int, say: Say
) -> None:
    """Warm epochs from the disk tier (dataset 3x the memory tier) against plain files in
    the same DataLoader, and from a memory tier holding the dataset against a list."""
    source = tmp / "source"
    contents = {f"{i // 1000}/{i:05d}.bin": os.urandom(size) for i in range(objects)}
    for key, data in contents.items():
        (source / key).parent.mkdir(parents=True, exist_ok=True)
        (source / key).write_bytes(data)
    paths = [source / key for key in contents]
    total = objects * size
    say(
        f"### Warm epochs: {objects} objects of {size / 1000:.0f} KB ({total / 1e6:,.0f} MB), "
        f"batch {BATCH}, same decode and collate (`torch.stack`) on both sides"
    )
    say()
    say(
        f"Each row alternates {repeats} warm epochs of StreamingDataset (shuffled, after a "
        f"cold one) with {repeats} of the baseline in the same DataLoader, and gives medians. "
        "*From disk*: memory tier a third of the dataset, the rest from the disk tier; "
        "baseline a dataset of shuffled `open().read()` of the same files. *From memory*: "
        "memory tier larger than the dataset, and untimed warm epochs first until the "
        "memory tiers answer 99% of the reads (with workers, each worker's tier holds only "
        "the samples dealt to it so far: about half after the cold epoch with 2 workers, "
        "the misses halving every epoch); baseline the samples in a list in memory, read in "
        "a shuffled order drawn afresh each epoch, as ours and the plain files are read. The "
        "same list read in its stored order is timed too, alternating with both (last "
        "column): its samples lie in memory in the order they are read, which the shuffled "
        "orders of every dataset here forgo. Memory hits: the share of the timed epochs' "
        "reads the memory tiers answered. CPU: this process's CPU seconds per epoch, all "
        "threads (with workers, the main process only). Faults: minor page faults a "
        "sample, this process and its workers, ours / the baseline's."
    )
    say()
    say(
        "| served from | num_workers | warm-up epochs | memory hits | warm samples/s "
        "| baseline samples/s | warm vs baseline | goal | CPU s per epoch | baseline CPU s "
        "| CPU vs baseline | faults a sample | warm vs the list in stored order |"
    )
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    goals = {("disk", 0): 0.8, ("disk", 2): 0.95, ("memory", 0): 0.9, ("memory", 2): 0.9}
    for where, memory in (("disk", total // 3), ("memory", 2 * total)):
        for workers in workers_list:
            ds: StreamingDataset[object] = StreamingDataset(
                source,
                cache_dir=tmp / f"cache-{where}-{workers}",
                memory_bytes=memory,
                disk_bytes=1 << 30,
                shuffle=True,
                batch_size=BATCH,
                decode=as_tensor,
            )
            loader = loader_for(ds, workers)  # type: ignore[arg-type]
            epoch(loader, len(ds))  # cold: fills the tiers
            warmups = 0
            while where == "memory" and warmups < MAX_WARMUPS:
                warmups += 1
                ds.set_epoch(warmups)
                epoch(loader, len(ds))
                if ds.epoch_stats(warmups).memory_hit_rate >= 0.99:
                    break
            # The baselines' loaders serve every epoch, after an untimed one (their workers
            # start there, as ours did in the cold epoch).
            ordered = None
            if where == "disk":
                baseline = loader_for(PlainFiles(paths, 0), workers)
            else:
                baseline = loader_for(InMemory(list(contents.items()), seed=0), workers)
                ordered = loader_for(InMemory(list(contents.items())), workers)
                epoch(ordered, objects)
            epoch(baseline, objects)
            ours, theirs, hits, in_order = [], [], [], []
            for number in range(warmups + 1, warmups + repeats + 1):
                ds.set_epoch(number)
                ours.append(timed(loader, len(ds)))
                hits.append(ds.epoch_stats(number).memory_hit_rate)
                theirs.append(timed(baseline, objects))
                if ordered is not None:
                    in_order.append(epoch(ordered, objects))
            ds.close()
            warm = objects / statistics.median(w for w, _, _ in ours)
            base = objects / statistics.median(w for w, _, _ in theirs)
            cpu = statistics.median(c for _, c, _ in ours)
            base_cpu = statistics.median(c for _, c, _ in theirs)
            faults = statistics.median(f for _, _, f in ours) / objects
            base_faults = statistics.median(f for _, _, f in theirs) / objects
            goal = goals.get((where, workers))
            versus_order = (
                f"{statistics.median(in_order) / statistics.median(w for w, _, _ in ours):.2f}x"
                if in_order
                else ""
            )
            say(
                f"| {where} | {workers} | {warmups} | {statistics.median(hits):.1%} "
                f"| {warm:,.0f} | {base:,.0f} | {warm / base:.2f}x | "
                f"{f'>= {goal:.2f}x' if goal else ''} | {cpu:.3f} | {base_cpu:.3f} | "
                f"{cpu / base_cpu:.2f}x | {faults:.1f} / {base_faults:.1f} | {versus_order} |"
            )
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000, help="keys in the planned epoch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plan", action="store_true", help="only the planning part")
    parser.add_argument("--warm", action="store_true", help="only the warm epochs")
    parser.add_argument("--objects", type=int, default=4000)
    parser.add_argument("--object-size", type=int, default=50_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--threads",
        type=int,
        help="torch's intra-op threads in the main process for the warm epochs (its default "
        "if not given): the collate runs on them, on both sides",
    )
    parser.add_argument(
        "--steady-heap",
        action="store_true",
        help="fix malloc's trim and mmap thresholds for the warm epochs, on both sides (see "
        "the module's docstring)",
    )
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    parser.add_argument("--plan-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan_child:
        mode, count = args.plan_child
        print(json.dumps(plan_child(mode, int(count))))
        return 0
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"Machine: {machine()}")
    say()
    if not args.warm:
        run_plan(args.keys, args.repeats, say)
    if not args.plan:
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.steady_heap:
            steady_heap()
        heap = (
            "malloc's trim and mmap thresholds fixed (`--steady-heap`)"
            if args.steady_heap
            else "glibc's default malloc"
        )
        say(f"Warm epochs with torch's intra-op pool at {torch.get_num_threads()} threads, {heap}.")
        say()
        with tempfile.TemporaryDirectory(prefix="bench-epoch-") as tmp:
            run_warm(Path(tmp), args.objects, args.object_size, args.workers, args.repeats, say)
    if args.write:
        record("bench_epoch", "An epoch's cost on the training node", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
