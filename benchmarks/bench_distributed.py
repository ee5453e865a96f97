"""Distributed checkpoints: DCP through asyncstore's storage plugin beside DCP's own
``FileSystemWriter`` and ``FileSystemReader``, two ranks of a gloo process group, all
measured in one run.

Two rank processes (gloo, on the CPU) hold a sharded state of ``--gib`` GiB in all (default
1; ``--mib`` for quick runs): ``--tensors`` fp32 matrices of random normal values (which do
not compress), each a DTensor sharded by rows (``Shard(0)``) over a 1-D mesh of the two
ranks, plus a small replicated DTensor and a step count. Each round measures:

- to a local directory, through ``asyncstore.torch.dcp.StorageWriter``/``StorageReader``
  and through DCP's ``FileSystemWriter``/``FileSystemReader`` (defaults: one writer thread,
  ``sync_files=True``): ``dcp.save``; ``dcp.async_save``, blocking (until it returns) and
  total (until its future completes); ``dcp.load`` with the checkpoint's files out of the
  page cache (cold) and read once before (warm); the bytes each stored;
- to S3 (SeaweedFS on loopback, started here): the plugin with an ``s3://`` URL, beside
  ``FileSystemWriter`` to a local directory followed by a hand-written aiobotocore upload of
  its files (each rank its own, the coordinator ``.metadata`` last); loads: the plugin from
  S3, beside a hand-written download of the same files and ``FileSystemReader``.

Every figure is timed inside the ranks, from a ``dist.barrier()`` to the end of the call;
the tables take the slower rank's figure in each round, then the median over the rounds
(after one warm-up round, which is not counted). The plugin and the baseline take turns
going first from one round to the next.

Run ``python benchmarks/bench_distributed.py`` (``--mib 64`` for a quick run, ``--write`` to
record the tables in docs/benchmarks.md, ``--uncompressed`` to measure the plugin with
``compression=None`` too, ``--profile`` to sample where rank 0's threads spend their time in
the plugin's local save, async_save and load).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from _baselines import aiobotocore_client, multipart_put, ranged_get_to_file
from _report import machine, record
from _server import bench_seaweedfs
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from asyncstore.testing import SeaweedFS
from asyncstore.torch.dcp import StorageReader as PluginReader
from asyncstore.torch.dcp import StorageWriter as PluginWriter

MiB = 1 << 20
WORLD = 2
BUCKET = "bench-distributed"
PART = 16 * MiB  # the plugin's S3 default part size, and the baseline's parts and ranges
UPLOAD_INFLIGHT = 4  # the plugin's S3 default (upload_max_inflight), per object
DOWNLOAD_INFLIGHT = 8  # the plugin's checkpoint reader keeps 8 reads in flight per object
KINDS = ("plugin", "fs")  # the plugin with its defaults, and DCP's own FileSystemWriter
RAW = "raw"  # the plugin with compression=None (--uncompressed), for local figures
Say = Callable[..., None]


# -- in the rank processes -------------------------------------------------------------------


def sharded_state(total: int, tensors: int, mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """About ``total`` bytes of fp32 matrices sharded by rows, a replicated vector and a step
    count. Each rank draws its own rows: nothing of the full matrices is ever built."""
    columns = 4096 if total >= 256 * MiB else 1024
    rows = max(WORLD, total // tensors // (columns * 4) // WORLD * WORLD)
    generator = torch.Generator().manual_seed(1000 + rank)
    state: dict[str, Any] = {}
    for i in range(tensors):
        local = torch.randn(rows // WORLD, columns, generator=generator).mul_(0.02)
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    norm = torch.randn(columns, generator=torch.Generator().manual_seed(7))  # alike on all
    state["norm.weight"] = DTensor.from_local(norm, mesh, [Replicate()], run_check=False)
    state["step"] = 1000
    return state


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """A state of the same layout to load into."""
    return {
        key: (
            DTensor.from_local(
                torch.zeros_like(value.to_local()), value.device_mesh, value.placements
            )
            if isinstance(value, DTensor)
            else 0
        )
        for key, value in state.items()
    }


def tensors_of(state: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in state.items():
        if isinstance(value, DTensor):
            yield key, value.to_local()


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def drop_from_page_cache(path: Path) -> None:
    """Write back and evict every file under ``path`` from the page cache (no root needed)."""
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(path: Path) -> None:
    """Read every file under ``path`` once, into the page cache."""
    for file in files_under(path):
        with open(file, "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass


class ThreadSampler:
    """Samples every thread's Python stack every few milliseconds (a poor man's py-spy):
    which functions the threads were in, and each thread's CPU time from /proc."""

    # Innermost frames of a thread that waits (an idle pool worker, an event loop in
    # select, a caller blocked on a future): counted apart as idle.
    IDLE = frozenset({"_worker", "select", "wait", "_wait_for_tstate_lock", "result"})
    # Stack frames the inclusive counts keep: asyncstore's and DCP's.
    OURS = ("/asyncstore/", "/torch/distributed/")

    def __init__(self, interval: float = 0.004) -> None:
        self.interval = interval
        self.idle: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.samples: collections.Counter[str] = collections.Counter()
        self.cpu: dict[str, float] = {}
        self._start_cpu: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    @staticmethod
    def _group(name: str) -> str:
        # Pool threads differ only by a number: count them together.
        return name.rstrip("0123456789_-").rstrip("_") or name

    @staticmethod
    def _where(frame: FrameType) -> str:
        code = frame.f_code
        parts = Path(code.co_filename).parts
        short = "/".join(parts[-2:])
        return f"{code.co_name} ({short}:{code.co_firstlineno})"

    @staticmethod
    def _thread_cpu() -> dict[int, float]:
        ticks = os.sysconf("SC_CLK_TCK")
        out: dict[int, float] = {}
        for task in Path("/proc/self/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
        return out

    def _refresh_names(self) -> None:
        for t in threading.enumerate():
            if t.native_id is not None:
                self._names[t.native_id] = self._group(t.name)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            idents = {t.ident: self._group(t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = idents.get(ident, "?")
                self.samples[group] += 1
                if frame.f_code.co_name in self.IDLE:
                    self.idle[group] += 1
                    continue
                self.leaf[f"[{group}] {self._where(frame)}"] += 1
                seen: set[str] = set()
                current: FrameType | None = frame
                while current is not None:
                    if any(part in current.f_code.co_filename for part in self.OURS):
                        where = f"[{group}] {self._where(current)}"
                        if where not in seen:
                            seen.add(where)
                            self.inclusive[where] += 1
                    current = current.f_back
            self._refresh_names()

    def __enter__(self) -> ThreadSampler:
        self._refresh_names()
        self._start_cpu = self._thread_cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._refresh_names()
        for tid, seconds in self._thread_cpu().items():
            name = self._names.get(tid, f"native {tid}")
            used = seconds - self._start_cpu.get(tid, 0.0)
            self.cpu[name] = self.cpu.get(name, 0.0) + used

    def summary(self, top: int = 25) -> dict[str, Any]:
        return {
            "samples": dict(self.samples),
            "idle": dict(self.idle),
            "cpu": self.cpu,
            "leaf": self.leaf.most_common(top),
            "inclusive": self.inclusive.most_common(top),
        }


class Rank:
    """One rank's side of the benchmark: the state, the measurements, the results."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.rank = dist.get_rank()
        # async_save's collectives on a group of their own, as the plugin requires of a
        # background save (and as PyTorch advises): the same for both writers.
        self.save_group = dist.new_group(backend="gloo")
        self.tmp = Path(config["tmp"])
        mesh = init_device_mesh("cpu", (WORLD,))
        self.state = sharded_state(config["bytes"], config["tensors"], mesh, self.rank)
        self.target = zeros_like(self.state)
        self.results: dict[str, list[float]] = {}
        self.profiles: dict[str, Any] = {}
        self.s3: dict[str, Any] | None = config.get("s3")

    # -- helpers -----------------------------------------------------------------------

    def note(self, name: str, value: float) -> None:
        self.results.setdefault(name, []).append(value)

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"  [rank 0] {text}", file=sys.stderr, flush=True)

    def on_zero(self, action: Callable[[], object]) -> None:
        """``action`` on rank 0 alone; every rank goes on once it is done."""
        if self.rank == 0:
            action()
        dist.barrier()

    def settle(self) -> None:
        """Start every measurement alike: dirty pages written back, garbage collected."""
        gc.collect()
        self.on_zero(os.sync)
        time.sleep(0.3)

    def start(self) -> float:
        """The start of a measurement: every rank at a barrier."""
        dist.barrier()
        return time.perf_counter()

    def clear(self, path: Path) -> None:
        self.on_zero(lambda: shutil.rmtree(path, ignore_errors=True))

    def writer(self, kind: str, where: str, sync_files: bool = True) -> StorageWriter:
        if kind == "plugin":
            return PluginWriter(where, store_options=self.store_options(where))
        if kind == RAW:
            return PluginWriter(where, store_options=self.store_options(where), compression=None)
        return FileSystemWriter(where, sync_files=sync_files)

    def reader(self, kind: str, where: str) -> StorageReader:
        if kind in ("plugin", RAW):
            return PluginReader(where, store_options=self.store_options(where))
        return FileSystemReader(where)

    def store_options(self, where: str) -> dict[str, Any]:
        if not where.startswith("s3://"):
            return {}
        assert self.s3 is not None
        return dict(self.s3["store_options"])

    def check_and_reset_target(self) -> None:
        """Every loaded tensor equals the saved one; then zeros again for the next load."""
        for (key, want), (_, got) in zip(
            tensors_of(self.state), tensors_of(self.target), strict=True
        ):
            if not torch.equal(want, got):
                raise AssertionError(f"rank {self.rank}: {key} was not loaded back")
            got.zero_()
        if self.target["step"] != self.state["step"]:
            raise AssertionError(f"rank {self.rank}: step was not loaded back")
        self.target["step"] = 0

    # -- local -------------------------------------------------------------------------

    def local_save(self, kind: str) -> None:
        path = self.tmp / kind
        self.clear(path)
        self.settle()
        writer = self.writer(kind, str(path))
        started = self.start()
        dcp_save(self.state, storage_writer=writer)
        self.note(f"local {kind} save", time.perf_counter() - started)
        if self.rank == 0:
            self.note(f"local {kind} bytes", sum(f.stat().st_size for f in files_under(path)))

    def local_async_save(self, kind: str) -> None:
        path = self.tmp / f"{kind}-async"
        self.clear(path)
        self.settle()
        writer = self.writer(kind, str(path))
        started = self.start()
        response = dcp_async_save(self.state, storage_writer=writer, process_group=self.save_group)
        self.note(f"local {kind} async blocking", time.perf_counter() - started)
        future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        assert isinstance(future, Future)
        future.result()
        self.note(f"local {kind} async total", time.perf_counter() - started)
        self.clear(path)  # only the blocking save's directory is loaded from

    def local_load(self, kind: str, warm: bool) -> None:
        path = self.tmp / kind
        self.settle()
        self.on_zero(lambda: read_through(path) if warm else drop_from_page_cache(path))
        reader = self.reader(kind, str(path))
        started = self.start()
        dcp_load(self.target, storage_reader=reader)
        self.note(f"local {kind} load {'warm' if warm else 'cold'}", time.perf_counter() - started)
        self.check_and_reset_target()

    # -- S3 ----------------------------------------------------------------------------

    def client(self, connections: int = 8) -> Any:
        assert self.s3 is not None
        # The baseline's client, made as the other benchmarks make it: a SeaweedFS handle
        # that names the server the parent started (this process starts nothing).
        server = SeaweedFS(access_key=self.s3["access_key"], secret_key=self.s3["secret_key"])
        server.endpoint_url = self.s3["endpoint_url"]
        return aiobotocore_client(server, connections)

    async def _listing(self, prefix: str) -> list[dict[str, Any]]:
        async with self.client() as client:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET, Prefix=prefix + "/"
            )
            return [item async for page in pages for item in page.get("Contents", [])]

    async def _delete(self, prefix: str) -> None:
        async with self.client() as client:
            for item in await self._listing(prefix):
                await client.delete_object(Bucket=BUCKET, Key=item["Key"])

    def delete(self, prefix: str) -> None:
        asyncio.run(self._delete(prefix))

    async def _upload(self, prefix: str, files: list[Path]) -> None:
        async with self.client() as client:
            for file in files:
                data = file.read_bytes()
                key = f"{prefix}/{file.name}"
                if len(data) <= PART:
                    await client.put_object(Bucket=BUCKET, Key=key, Body=data)
                else:
                    await multipart_put(client, BUCKET, key, data, PART, UPLOAD_INFLIGHT)

    async def _download(self, prefix: str, into: Path, names: Callable[[str], bool]) -> None:
        items = [i for i in await self._listing(prefix) if names(i["Key"].rsplit("/", 1)[1])]
        async with self.client(DOWNLOAD_INFLIGHT + 4) as client:
            await asyncio.gather(
                *(
                    ranged_get_to_file(
                        client,
                        BUCKET,
                        item["Key"],
                        str(into / item["Key"].rsplit("/", 1)[1]),
                        int(item["Size"]),
                        PART,
                        DOWNLOAD_INFLIGHT,
                    )
                    for item in items
                )
            )

    def s3_save(self, kind: str, prefix: str) -> None:
        url = f"s3://{BUCKET}/{prefix}"
        staging = self.tmp / "s3-staging"
        self.clear(staging)
        self.settle()
        if kind == "plugin":
            writer = self.writer(kind, url)
            started = self.start()
            dcp_save(self.state, storage_writer=writer)
            self.note("s3 plugin save", time.perf_counter() - started)
        else:
            # Staged on local disk only to be uploaded: no fsync (the upload is what makes
            # the checkpoint durable), which spares the baseline that cost.
            writer = self.writer(kind, str(staging), sync_files=False)
            started = self.start()
            dcp_save(self.state, storage_writer=writer)
            written = time.perf_counter()
            own = sorted(staging.glob(f"__{self.rank}_*"))
            asyncio.run(self._upload(prefix, own))
            dist.barrier()  # every rank's data is in S3 before the metadata, the commit point
            if self.rank == 0:
                asyncio.run(self._upload(prefix, [staging / ".metadata"]))
            dist.barrier()
            ended = time.perf_counter()
            self.note("s3 fs save", ended - started)
            self.note("s3 fs save write", written - started)
            self.note("s3 fs save upload", ended - written)
            self.clear(staging)
        if self.rank == 0:
            listing = asyncio.run(self._listing(prefix))
            self.note(f"s3 {kind} bytes", sum(int(item["Size"]) for item in listing))

    def s3_load(self, kind: str, prefix: str) -> None:
        url = f"s3://{BUCKET}/{prefix}"
        into = self.tmp / "s3-download"
        self.clear(into)
        self.settle()
        if kind == "plugin":
            reader = self.reader(kind, url)
            started = self.start()
            dcp_load(self.target, storage_reader=reader)
            self.note("s3 plugin load", time.perf_counter() - started)
        else:
            # One node: the ranks share a local directory, each downloads its own files
            # (the coordinator also the metadata), then DCP reads them from there.
            mine = f"__{self.rank}_"
            started = self.start()
            if self.rank == 0:
                into.mkdir(parents=True)
            dist.barrier()
            asyncio.run(
                self._download(
                    prefix,
                    into,
                    lambda name: name.startswith(mine) or (self.rank == 0 and name == ".metadata"),
                )
            )
            dist.barrier()
            downloaded = time.perf_counter()
            dcp_load(self.target, storage_reader=self.reader(kind, str(into)))
            ended = time.perf_counter()
            self.note("s3 fs load", ended - started)
            self.note("s3 fs load download", downloaded - started)
            self.clear(into)
        self.check_and_reset_target()

    # -- the rounds --------------------------------------------------------------------

    def run_round(self, number: int) -> None:
        # The two take turns going first: this machine's speed drifts from minute to minute.
        local = KINDS + ((RAW,) if self.config["uncompressed"] else ())
        local = local if number % 2 == 0 else local[::-1]
        kinds = KINDS if number % 2 == 0 else KINDS[::-1]
        for kind in local:
            self.local_save(kind)
        for warm in (False, True):
            for kind in local:
                self.local_load(kind, warm)
        for kind in local:
            self.local_async_save(kind)
        if self.s3 is not None:
            prefixes = {kind: f"round-{number}/{kind}" for kind in kinds}
            for kind in kinds:
                self.s3_save(kind, prefixes[kind])
            for kind in kinds:
                self.s3_load(kind, prefixes[kind])
            for prefix in prefixes.values():
                self.on_zero(functools.partial(self.delete, prefix))

    def profile(self) -> None:
        """Rank 0's threads sampled in the plugin's local save, async_save and load."""
        path = self.tmp / "plugin"

        def sampled(name: str, action: Callable[[], object]) -> None:
            self.settle()
            with ThreadSampler() as sampler:
                started = self.start()
                action()
                seconds = time.perf_counter() - started
            self.profiles[name] = {"seconds": seconds, **sampler.summary()}

        def save() -> None:
            dcp_save(self.state, storage_writer=self.writer("plugin", str(path)))

        def async_save() -> None:
            response = dcp_async_save(
                self.state,
                storage_writer=self.writer("plugin", str(path)),
                process_group=self.save_group,
            )
            future = (
                response.upload_completion if isinstance(response, AsyncSaveResponse) else response
            )
            assert isinstance(future, Future)
            future.result()

        def load() -> None:
            dcp_load(self.target, storage_reader=self.reader("plugin", str(path)))

        self.clear(path)
        sampled("save", save)
        self.clear(path)
        sampled("async_save", async_save)
        self.on_zero(lambda: drop_from_page_cache(path))
        sampled("load (cold)", load)
        self.check_and_reset_target()


def rank_main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo")
    rank = Rank(config)
    rounds = config["rounds"]
    for number in range(rounds + 1):
        rank.log(f"round {number} of {rounds}{' (warm-up, not counted)' if not number else ''}")
        rank.run_round(number)
    if config["profile"]:
        rank.log("profiling the plugin")
        rank.profile()
    out = {"results": rank.results, "profiles": rank.profiles}
    Path(config["tmp"], f"rank-{rank.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, as the test suite's rank processes do: a
    # background C++ thread destroyed while running has aborted it there.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- in the parent ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(config: dict[str, Any], tmp: Path, timeout: float) -> list[dict[str, Any]]:
    """Start the two ranks, wait for them, and return what each measured."""
    config_path = tmp / "config.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD),  # as torchrun sets them
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank-config", str(config_path)],
                env=env,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        # A rank that fails leaves the other waiting in a collective: stop it then.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        raise RuntimeError(f"the rank processes ended with {codes} (killed: -9)")
    return [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def verdict(ratio: float, goal: float) -> str:
    return "PASS" if ratio <= goal else "MISS"


class Report:
    """The rounds' figures: the slower rank in each round, then the median of the rounds
    after the warm-up."""

    def __init__(self, ranks: list[dict[str, Any]], say: Say) -> None:
        self.say = say
        self.rounds: dict[str, list[float]] = {}
        zero = ranks[0]["results"]
        for name in zero:
            per_rank = [r["results"][name] for r in ranks if name in r["results"]]
            self.rounds[name] = [max(values) for values in zip(*per_rank, strict=True)]

    def counted(self, name: str) -> list[float]:
        return self.rounds[name][1:]

    def med(self, name: str) -> float:
        return statistics.median(self.counted(name))

    def cell(self, name: str) -> str:
        values = self.counted(name)
        text = f"{statistics.median(values):.2f} s"
        if len(values) > 1:
            text += f" ({min(values):.2f}-{max(values):.2f})"
        return text

    def ratio(self, ours: str, base: str) -> float:
        return self.med(ours) / self.med(base)

    def tables(self, size: int, tensors: int, s3: bool) -> None:
        say = self.say
        rounds = len(self.counted("local plugin save"))
        say(
            f"### Two ranks (gloo, CPU) saving {size / MiB:,.0f} MiB: {tensors} fp32 DTensors "
            "sharded by rows, a replicated vector and a step count"
        )
        say()
        say(
            f"Medians of {rounds} rounds after a warm-up round (the range in parentheses); each "
            "figure is the slower rank's, timed inside the ranks from a `dist.barrier()` to "
            "the end of the call. Baseline: DCP's `FileSystemWriter`/`FileSystemReader` with "
            "their defaults (one writer thread; `sync_files=True`: every file fsynced, as "
            "asyncstore's local writes are). Before each save the page cache is written back; "
            "cold loads first evict the checkpoint's files (`POSIX_FADV_DONTNEED`), warm loads "
            "first read them once, for both alike."
        )
        say()
        raw = f"local {RAW} save" in self.rounds
        if raw:
            say(
                "| figure | asyncstore plugin (defaults) | DCP FileSystemWriter/Reader "
                "| plugin / baseline | plugin, `compression=None` | that / baseline |"
            )
            say("|---|---:|---:|---:|---:|---:|")
        else:
            say("| figure | asyncstore plugin | DCP FileSystemWriter/Reader | plugin / baseline |")
            say("|---|---:|---:|---:|")

        def row(title: str, what: str) -> None:
            ours, base, other = (f"local {kind} {what}" for kind in ("plugin", "fs", RAW))
            line = (
                f"| {title} | {self.cell(ours)} | {self.cell(base)} | "
                f"{self.ratio(ours, base):.2f}x |"
            )
            if raw:
                line += f" {self.cell(other)} | {self.ratio(other, base):.2f}x |"
            say(line)

        row("local `dcp.save`", "save")
        row("local `dcp.async_save`, blocking", "async blocking")
        row("local `dcp.async_save`, total", "async total")
        row("local `dcp.load`, cold page cache", "load cold")
        row("local `dcp.load`, warm page cache", "load warm")
        sizes = {
            kind: self.med(f"local {kind} bytes") for kind in (*KINDS, RAW) if kind != RAW or raw
        }
        line = (
            f"| bytes stored locally | {sizes['plugin'] / MiB:,.1f} MiB | {sizes['fs'] / MiB:,.1f} "
            f"MiB | {sizes['plugin'] / sizes['fs']:.3f}x |"
        )
        if raw:
            line += f" {sizes[RAW] / MiB:,.1f} MiB | {sizes[RAW] / sizes['fs']:.3f}x |"
        say(line)
        say()
        if s3:
            say("### The same state to S3 (SeaweedFS on loopback, the same two cores)")
            say()
            say(
                "Baseline save: `FileSystemWriter` to a local directory (`sync_files=False`: "
                "the upload, not the local copy, makes it durable), then each rank uploads its "
                f"own files with aiobotocore ({PART // MiB} MiB parts, {UPLOAD_INFLIGHT} in "
                "flight, as the plugin's defaults), and the coordinator `.metadata` last. "
                "Baseline load: each rank downloads its own files (the coordinator also "
                f"`.metadata`) with ranged GETs ({PART // MiB} MiB, {DOWNLOAD_INFLIGHT} in "
                "flight) into a directory the ranks share, then `FileSystemReader`."
            )
            say()
            say(
                "| figure | asyncstore plugin | FileSystemWriter/Reader + aiobotocore "
                "| plugin / baseline |"
            )
            say("|---|---:|---:|---:|")
            for title, what in (("`dcp.save` to S3", "save"), ("`dcp.load` from S3", "load")):
                ours, base = f"s3 plugin {what}", f"s3 fs {what}"
                say(
                    f"| {title} | {self.cell(ours)} | {self.cell(base)} | "
                    f"{self.ratio(ours, base):.2f}x |"
                )
            ours_bytes, base_bytes = self.med("s3 plugin bytes"), self.med("s3 fs bytes")
            say(
                f"| bytes stored in S3 | {ours_bytes / MiB:,.1f} MiB | {base_bytes / MiB:,.1f} "
                f"MiB | {ours_bytes / base_bytes:.3f}x |"
            )
            say()
            say(
                f"The baseline's save: {self.cell('s3 fs save write')} writing locally, "
                f"{self.cell('s3 fs save upload')} uploading; its load: "
                f"{self.cell('s3 fs load download')} downloading, the rest reading."
            )
            say()
        say(
            "Warm-up round (not counted): local `dcp.save` "
            f"{self.rounds['local plugin save'][0]:.2f} s with the plugin, "
            f"{self.rounds['local fs save'][0]:.2f} s with `FileSystemWriter`; `async_save` "
            f"blocking {self.rounds['local plugin async blocking'][0]:.2f} s and "
            f"{self.rounds['local fs async blocking'][0]:.2f} s."
        )
        say()

    def goals(self) -> None:
        say = self.say
        say("### Against the goals")
        say()
        say("| goal | measured | reading |")
        say("|---|---:|---|")
        checks = [
            (
                "local `dcp.save` total <= 1.0x `FileSystemWriter`'s",
                self.ratio("local plugin save", "local fs save"),
                1.0,
            ),
            (
                "local `dcp.async_save` total <= 1.0x `FileSystemWriter`'s",
                self.ratio("local plugin async total", "local fs async total"),
                1.0,
            ),
            (
                "`async_save` blocking <= 0.5x `FileSystemWriter`'s blocking `dcp.save`",
                self.ratio("local plugin async blocking", "local fs save"),
                0.5,
            ),
            (
                "`async_save` blocking <= 0.5x `FileSystemWriter`'s `async_save` blocking",
                self.ratio("local plugin async blocking", "local fs async blocking"),
                0.5,
            ),
            (
                "local `dcp.load`, cold, <= 1.0x `FileSystemReader`'s",
                self.ratio("local plugin load cold", "local fs load cold"),
                1.0,
            ),
            (
                "local `dcp.load`, warm, <= 1.0x `FileSystemReader`'s",
                self.ratio("local plugin load warm", "local fs load warm"),
                1.0,
            ),
        ]
        for title, ratio, goal in checks:
            say(f"| {title} | {ratio:.2f}x | {verdict(ratio, goal)} |")
        say()


def print_profiles(ranks: list[dict[str, Any]]) -> None:
    """What rank 0's threads did in the sampled plugin calls (on stderr: not recorded)."""
    for name, profile in ranks[0]["profiles"].items():
        out = sys.stderr
        print(f"\n## profile of rank 0, plugin {name}: {profile['seconds']:.2f} s", file=out)
        cpu = sorted(profile["cpu"].items(), key=lambda kv: -kv[1])
        print("CPU seconds by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu if v), file=out)
        samples = ", ".join(
            f"{k} {v} ({profile['idle'].get(k, 0)} idle)" for k, v in profile["samples"].items()
        )
        print(f"samples by thread: {samples}", file=out)
        print("where busy threads were (innermost Python frame):", file=out)
        for where, count in profile["leaf"]:
            print(f"  {count:6d}  {where}", file=out)
        print("busy samples with an asyncstore or DCP frame on the stack:", file=out)
        for where, count in profile["inclusive"]:
            print(f"  {count:6d}  {where}", file=out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--gib", type=float, help="state size in GiB, all ranks together (1)")
    sizes.add_argument("--mib", type=int, help="state size in MiB, for quick runs")
    parser.add_argument("--tensors", type=int, default=8, help="sharded matrices (8)")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds (3)")
    parser.add_argument("--no-s3", action="store_true", help="only the local directory")
    parser.add_argument(
        "--uncompressed",
        action="store_true",
        help="also the plugin with compression=None, to local disk",
    )
    parser.add_argument("--profile", action="store_true", help="sample the plugin's calls")
    parser.add_argument("--write", action="store_true", help="record in docs/benchmarks.md")
    args = parser.parse_args()
    if args.rank_config:
        rank_main(args.rank_config)
        return 0
    size = args.mib * MiB if args.mib is not None else int((args.gib or 1.0) * 1024) * MiB
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"Machine: {machine()}; torch {torch.__version__}")
    say()
    with tempfile.TemporaryDirectory(
        prefix="bench-distributed-", dir=os.environ.get("BENCH_DIR")
    ) as name:
        tmp = Path(name)
        config: dict[str, Any] = {
            "tmp": str(tmp),
            "bytes": size,
            "tensors": args.tensors,
            "rounds": args.rounds,
            "profile": args.profile,
            "uncompressed": args.uncompressed,
            "s3": None,
        }
        server: SeaweedFS | None = None
        if not args.no_s3:
            server = bench_seaweedfs(tmp / "seaweedfs")
            server.start()
        try:
            if server is not None:
                server.create_bucket(BUCKET)
                config["s3"] = {
                    "endpoint_url": server.endpoint_url,
                    "access_key": server.access_key,
                    "secret_key": server.secret_key,
                    "store_options": server.store_options(),
                }
            timeout = 600 + 60 * (args.rounds + 1) * max(1.0, size / (256 * MiB))
            ranks = run_ranks(config, tmp, timeout)
        finally:
            if server is not None:
                server.stop(timeout=1.0)
    report = Report(ranks, say)
    report.tables(size, args.tensors, not args.no_s3)
    report.goals()
    if args.profile:
        print_profiles(ranks)
    if args.write:
        record("bench_distributed", "Distributed checkpoints (DCP, two ranks)", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
