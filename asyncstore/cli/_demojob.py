"""The training process of ``asyncstore demo``: one run of the demo's training job.

The demo starts it twice as ``python -m asyncstore demo --worker SPEC`` (see ``_demorun``):
the first run kills itself with SIGKILL at a chosen step, the second resumes from the newest
checkpoint and finishes. Each run appends what it does to a journal, one JSON object a line
(flushed line by line, so a run killed mid-way leaves every line it wrote whole), from
which the demo's summary is computed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import IO, Any, NamedTuple

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..checkpoint import SaveResult
from ..torch import Checkpointer, StreamingDataset
from ._common import progress
from ._demodata import CLASSES, SHAPE, decode

__all__ = ["JobSpec", "main"]

MiB = 1 << 20


class JobSpec(msgspec.Struct, frozen=True):
    """One run of the training job, as the demo hands it to the training process.

    Attributes:
        run: 1 for the run that is killed, 2 for the one that resumes.
        journal: the file the run appends its events to.
        dataset_url, store_options: where the samples are read from.
        cache_dir: the disk tier's directory (shared by the DataLoader workers).
        memory_bytes: each worker's memory tier.
        checkpoints: the local directory the checkpoints commit to first.
        mirror, mirror_options: where they are copied to in the background.
        epochs, batch_size, workers, seed: the training loop's shape.
        checkpoint_every, keep_last: a version every this many steps; how many are kept.
        kill_at_step: the step after which this run kills itself with SIGKILL (None: never).
    """

    run: int
    journal: str
    dataset_url: str
    store_options: dict[str, Any]
    cache_dir: str
    memory_bytes: int
    checkpoints: str
    mirror: str
    mirror_options: dict[str, Any]
    epochs: int
    batch_size: int
    workers: int
    seed: int
    checkpoint_every: int
    keep_last: int
    kill_at_step: int | None


class DemoNet(nn.Module):
    """A small classifier of the demo's 3x64x64 images.

    ``features`` is frozen (a random projection standing in for a pretrained backbone): its
    bytes never change, so differential checkpoints skip them after the first save. Only
    ``head`` is trained (and only it has optimizer state).
    """

    def __init__(self) -> None:
        super().__init__()
        pooled = SHAPE[0] * (SHAPE[1] // 4) * (SHAPE[2] // 4)
        self.features = nn.Linear(pooled, 2048)
        self.features.requires_grad_(False)
        self.head = nn.Sequential(
            nn.ReLU(), nn.Linear(2048, 128), nn.ReLU(), nn.Linear(128, CLASSES)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.avg_pool2d(images.float() / 255, 4).flatten(1)
        return self.head(self.features(x))  # type: ignore[no-any-return]


class _WorkerReport(NamedTuple):
    """Sent by a DataLoader worker after its last sample of an epoch: its dataset's
    figures (prefetch for the epoch; cache counters since the worker started)."""

    worker: int
    stats: dict[str, Any]


class _Reporting(IterableDataset[Any]):
    """The dataset's stream, then the worker's :class:`_WorkerReport`.

    The figures of a DataLoader worker's cache and prefetcher live in that worker; this is
    how they reach the training process, in the batch stream itself.
    """

    def __init__(self, dataset: StreamingDataset[Any]) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        yield from self.dataset
        info = get_worker_info()
        stats = self.dataset.stats()
        if stats is not None:
            yield _WorkerReport(0 if info is None else info.id, msgspec.to_builtins(stats))


class _Batch(NamedTuple):
    ids: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor
    reports: list[_WorkerReport]


def _collate(items: list[Any]) -> _Batch:
    reports = [item for item in items if isinstance(item, _WorkerReport)]
    samples = [item for item in items if not isinstance(item, _WorkerReport)]
    if not samples:
        empty = torch.empty(0, dtype=torch.int64)
        return _Batch(empty, empty, torch.empty((0, *SHAPE), dtype=torch.uint8), reports)
    return _Batch(
        torch.tensor([s[0] for s in samples]),
        torch.tensor([s[1] for s in samples]),
        torch.stack([s[2] for s in samples]),
        reports,
    )


class _EpochFigures:
    """What the workers reported for one epoch, summed (cache counters as differences)."""

    def __init__(self, previous: dict[int, dict[str, Any]]) -> None:
        self.previous = previous  # per worker, its cache counters at the last report
        self.figures = {
            "reports": 0,
            "gets": 0,
            "memory_hits": 0,
            "disk_hits": 0,
            "store_fetches": 0,
            "items": 0,
            "stalls": 0,
            "fetched": 0,
            "consumed_fetched": 0.0,
            "prefetch_wait_seconds": 0.0,
        }

    def add(self, report: _WorkerReport) -> None:
        figures, cache, prefetch = self.figures, report.stats["cache"], report.stats["prefetch"]
        figures["reports"] += 1
        if cache is not None:
            before = self.previous.get(report.worker)
            now = {
                "gets": cache["gets"],
                "memory_hits": cache["memory"]["hits"],
                "disk_hits": cache["disk"]["hits"],
                "store_fetches": cache["store"]["fetches"],
            }
            for name, value in now.items():
                figures[name] += value - (before[name] if before else 0)
            self.previous[report.worker] = now
        if prefetch is not None:
            figures["items"] += prefetch["items"]
            figures["stalls"] += prefetch["stalls"]
            figures["fetched"] += prefetch["fetched"]
            figures["consumed_fetched"] += prefetch["accuracy"] * prefetch["fetched"]
            figures["prefetch_wait_seconds"] += prefetch["wait_seconds"]


class _Journal:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._started = time.perf_counter()

    def note(self, event: str, **fields: Any) -> None:
        fields = {"event": event, "at": round(time.perf_counter() - self._started, 6), **fields}
        self._file.write(json.dumps(fields) + "\n")
        self._file.flush()  # in the kernel's hands before any SIGKILL

    def close(self) -> None:
        self._file.close()


def _note_saves(journal: _Journal, pending: list[tuple[int, Future[SaveResult]]]) -> None:
    """Journal the saves that committed; raise a failed one's error."""
    for item in [p for p in pending if p[1].done()]:
        pending.remove(item)
        step, future = item
        result = future.result()
        journal.note(
            "saved",
            step=step,
            total_seconds=result.total_seconds,
            snapshot_seconds=result.snapshot_seconds,
            raw_bytes=result.raw_bytes,
            stored_bytes=result.stored_bytes,
            skipped_bytes=result.skipped_bytes,
        )


def main(spec_path: str) -> int:
    """Run the job described by the JSON file ``spec_path``; returns the exit status."""
    with open(spec_path, "rb") as file:
        spec = msgspec.json.decode(file.read(), type=JobSpec)
    journal = _Journal(spec.journal)
    try:
        _train(spec, journal)
    finally:
        journal.close()
    return 0


def _train(spec: JobSpec, journal: _Journal) -> None:
    torch.manual_seed(spec.seed)
    batch = spec.batch_size
    dataset: StreamingDataset[tuple[int, int, torch.Tensor]] = StreamingDataset(
        spec.dataset_url,
        store_options=spec.store_options,
        cache_dir=spec.cache_dir,
        memory_bytes=spec.memory_bytes,
        disk_bytes=1 << 30,
        shuffle=True,
        seed=spec.seed,
        decode=decode,
        batch_size=batch,
    )
    samples = len(dataset)
    steps_per_epoch = -(-samples // batch)
    model = DemoNet()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with Checkpointer(
        spec.checkpoints,
        keep_last=spec.keep_last,
        mirror=spec.mirror,
        mirror_options=spec.mirror_options or None,
    ) as ckpt:
        newest = ckpt.latest()
        step, first_epoch, skip = 0, 0, 0
        if newest is not None:
            state = ckpt.load()  # the newest version that verifies
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
            dataset.load_state_dict(state["data"])
            first_epoch, skip = state["data"]["epoch"], state["data"]["consumed"]
        journal.note(
            "start",
            run=spec.run,
            pid=os.getpid(),
            newest_version=None if newest is None else newest.step,
            resumed_from=None if newest is None else step,
            epoch=first_epoch,
            skip=skip,
            samples=samples,
            steps_per_epoch=steps_per_epoch,
        )
        loader = DataLoader(
            _Reporting(dataset),
            batch_size=batch,
            num_workers=spec.workers,
            persistent_workers=True,  # each worker's memory tier stays warm across epochs
            collate_fn=_collate,
        )
        pending: list[tuple[int, Future[SaveResult]]] = []
        workers_seen: dict[int, dict[str, Any]] = {}
        batches: Iterator[Any] = iter(())
        total_steps = spec.epochs * steps_per_epoch
        with progress(total_steps - step, f"training (run {spec.run})", unit="step") as bar:
            for epoch in range(first_epoch, spec.epochs):
                dataset.set_epoch(epoch)  # keeps a loaded position in its epoch
                done, skip = skip, 0  # samples of this epoch already trained on
                figures = _EpochFigures(workers_seen)
                started, waited, seen, loss_sum, correct = time.perf_counter(), 0.0, 0, 0.0, 0
                first_step = step + 1
                batches = iter(loader)
                while True:
                    asked = time.perf_counter()
                    item: _Batch | None = next(batches, None)
                    waited += time.perf_counter() - asked
                    if item is None:
                        break
                    for report in item.reports:
                        figures.add(report)
                    if not len(item.ids):
                        continue
                    logits = model(item.images)
                    loss = F.cross_entropy(logits, item.labels)
                    optimizer.zero_grad()
                    loss.backward()  # type: ignore[no-untyped-call]
                    optimizer.step()
                    step += 1
                    done += len(item.ids)
                    seen += len(item.ids)
                    loss_sum += loss.item() * len(item.ids)
                    correct += int((logits.argmax(1) == item.labels).sum())
                    journal.note("step", step=step, epoch=epoch, ids=item.ids.tolist())
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
                    _note_saves(journal, pending)
                    if step % spec.checkpoint_every == 0 or step == total_steps:
                        # The end of an epoch resumes at the start of the next one.
                        data = (
                            dataset.state_dict(consumed=done)
                            if done < samples
                            else {"epoch": epoch + 1, "consumed": 0, "seed": spec.seed}
                        )
                        state = {
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "step": step,
                            "data": data,
                        }
                        # One save in flight at a time, so versions commit in step order:
                        # retention judges only versions older than the one that committed,
                        # and a newer version committing first would leave one extra.
                        asked = time.perf_counter()
                        for _, future in pending:
                            future.result()
                        queued = time.perf_counter() - asked
                        _note_saves(journal, pending)
                        asked = time.perf_counter()
                        pending.append((step, ckpt.save(state, step)))
                        blocking = time.perf_counter() - asked
                        journal.note("save", step=step, blocking=blocking, queued=queued)
                    if step == spec.kill_at_step:
                        _kill(
                            journal, pending, spec, step, epoch, first_step, seen, started, waited
                        )
                journal.note(
                    "epoch",
                    run=spec.run,
                    epoch=epoch,
                    first_step=first_step,
                    last_step=step,
                    samples=seen,
                    seconds=time.perf_counter() - started,
                    wait_seconds=waited,
                    loss=loss_sum / seen if seen else None,
                    accuracy=correct / seen if seen else None,
                    killed=False,
                    **figures.figures,
                )
        for _, future in pending:
            future.result()
        _note_saves(journal, pending)
        del batches, loader  # stops the workers
    # Closing waited for the uploads to the mirror and for retention.
    journal.note("done", stats=msgspec.to_builtins(ckpt.stats()))


def _kill(
    journal: _Journal,
    pending: list[tuple[int, Future[SaveResult]]],
    spec: JobSpec,
    step: int,
    epoch: int,
    first_step: int,
    seen: int,
    started: float,
    waited: float,
) -> None:
    # The saves of earlier steps commit first, so that the demo always has a checkpoint to
    # resume from; a save of this very step is killed in flight.
    for saved_step, future in list(pending):
        if saved_step < step:
            future.result()
    _note_saves(journal, pending)
    journal.note(
        "epoch",
        run=spec.run,
        epoch=epoch,
        first_step=first_step,
        last_step=step,
        samples=seen,
        seconds=time.perf_counter() - started,
        wait_seconds=waited,
        killed=True,
    )
    journal.note("kill", step=step, in_flight=[s for s, _ in pending])
    # The whole process group: the training process and its DataLoader workers at once,
    # as when a machine is lost or the job is killed for memory.
    os.killpg(os.getpgid(0), signal.SIGKILL)
