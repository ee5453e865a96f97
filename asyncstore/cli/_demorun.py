"""``asyncstore demo``'s conductor: uploads the dataset, runs the training job twice (the
first run is killed with SIGKILL, the second resumes), and sums up what both did.

The summary is computed from the runs' journals (see ``_demojob``) and from the checkpoints
left at the end; ``--json`` prints it as it is built here.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from ..checkpoint import Checkpointer
from ..stores import open_store
from ._demodata import DatasetInfo, upload
from ._demojob import JobSpec

__all__ = ["DemoConfig", "DemoFailed", "run_demo"]

MiB = 1 << 20
# Where the mirror of the checkpoints lies in the demo's store (beside the dataset).
MIRROR_PREFIX = "checkpoints/"


class DemoFailed(Exception):
    """A training run ended otherwise than the demo planned (its error is on stderr)."""


class DemoConfig(msgspec.Struct, frozen=True):
    """What ``asyncstore demo`` was asked for (checked by the command line)."""

    directory: str
    url: str
    store_options: dict[str, Any]
    samples: int
    epochs: int
    batch_size: int
    checkpoint_every: int
    keep_last: int
    kill_at_step: int
    workers: int
    memory_bytes: int
    seed: int = 0


def _join(url: str, sub: str) -> str:
    return f"{url.rstrip('/')}/{sub}"


async def _prepare(config: DemoConfig) -> tuple[DatasetInfo, str]:
    """Upload the dataset unless it is there; remove the previous demo run's mirror copies
    (each demo starts a new training run). Returns the dataset and the store's URL."""
    async with open_store(config.url, **config.store_options) as store:
        dataset = await upload(store, config.samples)
        old = [info.key async for info in store.list(MIRROR_PREFIX)]
        for key in old:
            await store.delete(key)
        return dataset, store.url


async def _versions(
    config: DemoConfig, local: str, mirror: str
) -> tuple[list[dict[str, Any]], list[int]]:
    async with Checkpointer(
        local, mirror=mirror, mirror_options=config.store_options or None
    ) as ckpt:
        versions = [
            {"step": v.step, "where": v.where, "state": v.state, "stored_bytes": v.stored_bytes}
            for v in await ckpt.versions()
        ]
    async with open_store(mirror, **config.store_options) as store:
        in_mirror = sorted(
            [
                int(info.key.removeprefix("step-").removesuffix(".ckpt"))
                async for info in store.list("step-")
                if info.key.endswith(".ckpt")
            ]
        )
    return versions, in_mirror


def _train(spec: JobSpec, path: Path) -> int:
    """Run one training run in a process of its own; returns its exit status."""
    path.write_bytes(msgspec.json.encode(spec))
    path.chmod(0o600)  # it may hold the store's credentials
    command = [sys.executable, "-m", "asyncstore", "demo", "--worker", str(path)]
    # Its own process group: the run kills itself and its DataLoader workers together.
    child = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        return child.wait()
    except BaseException:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise


def _say(line: str) -> None:
    # On a terminal only, beside the progress bars: what happens between the two runs.
    if sys.stderr.isatty():
        print(f"\r\033[K{line}", file=sys.stderr)


def _read(journal: Path) -> list[dict[str, Any]]:
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; returns its summary (see ``docs``: the keys are stable)."""
    began = time.perf_counter()
    root = Path(config.directory).absolute()
    root.mkdir(parents=True, exist_ok=True)
    dataset, store_url = asyncio.run(_prepare(config))
    mirror = _join(store_url, MIRROR_PREFIX)
    cache_dir, local = root / "cache", root / "checkpoints"
    # A new training run each time: a cold cache (the first epoch reads the store) and no
    # checkpoints of an earlier demo to resume from.
    for path in (cache_dir, local):
        shutil.rmtree(path, ignore_errors=True)
    runs: list[list[dict[str, Any]]] = []
    for run in (1, 2):
        journal = root / f"run-{run}.jsonl"
        journal.unlink(missing_ok=True)
        spec = JobSpec(
            run=run,
            journal=str(journal),
            dataset_url=dataset.url,
            store_options=config.store_options,
            cache_dir=str(cache_dir),
            memory_bytes=config.memory_bytes,
            checkpoints=str(local),
            mirror=mirror,
            mirror_options=config.store_options,
            epochs=config.epochs,
            batch_size=config.batch_size,
            workers=config.workers,
            seed=config.seed,
            checkpoint_every=config.checkpoint_every,
            keep_last=config.keep_last,
            kill_at_step=config.kill_at_step if run == 1 else None,
        )
        status = _train(spec, root / f"run-{run}.json")
        expected = -signal.SIGKILL if run == 1 else 0
        if status != expected:
            how = f"was killed by signal {-status}" if status < 0 else f"exited with {status}"
            raise DemoFailed(f"training run {run} {how}; its error is above")
        runs.append(_read(journal))
        if run == 1:
            _say("training run 1 was killed with SIGKILL; starting run 2, which resumes")
    versions, in_mirror = asyncio.run(_versions(config, str(local), mirror))
    summary = _summarize(config, dataset, runs, versions, in_mirror)
    summary["store"] = store_url
    summary["checkpoints"]["local"] = local.as_uri()
    summary["checkpoints"]["mirror"] = mirror
    summary["seconds"] = time.perf_counter() - began
    return summary


def _segment(event: dict[str, Any]) -> dict[str, Any]:
    """One run's part of one epoch: throughput, prefetch and cache figures."""
    samples, seconds = event["samples"], event["seconds"]
    row: dict[str, Any] = {
        "run": event["run"],
        "epoch": event["epoch"],
        "first_step": event["first_step"],
        "last_step": event["last_step"],
        "samples": samples,
        "seconds": seconds,
        "samples_per_second": samples / seconds if seconds else 0.0,
        "wait_seconds": event["wait_seconds"],
        "killed": event["killed"],
        "loss": event.get("loss"),
        "accuracy": event.get("accuracy"),
        "stall_fraction": None,
        "prefetch_accuracy": None,
        "hits": None,
        "hit_rate": None,
    }
    if event.get("reports"):  # the workers report at the end of an epoch: not when killed
        gets = event["gets"]
        row["stall_fraction"] = event["stalls"] / event["items"] if event["items"] else 0.0
        row["prefetch_accuracy"] = (
            event["consumed_fetched"] / event["fetched"] if event["fetched"] else 1.0
        )
        row["hits"] = {
            "memory": event["memory_hits"],
            "disk": event["disk_hits"],
            "store": event["store_fetches"],
            "gets": gets,
        }
        row["hit_rate"] = (event["memory_hits"] + event["disk_hits"]) / gets if gets else 0.0
    return row


def _summarize(
    config: DemoConfig,
    dataset: DatasetInfo,
    runs: list[list[dict[str, Any]]],
    versions: list[dict[str, Any]],
    in_mirror: list[int],
) -> dict[str, Any]:
    first, second = runs
    kill = next(e for e in first if e["event"] == "kill")
    start = next(e for e in second if e["event"] == "start")
    resumed = start["resumed_from"] or 0
    committed_at_kill = [e["step"] for e in first if e["event"] == "saved"]
    # What the model learnt from: the killed run's steps up to the checkpoint resumed from
    # (later ones were lost with it), then every step of the resumed run.
    steps = [e for e in first if e["event"] == "step" and e["step"] <= resumed]
    steps += [e for e in second if e["event"] == "step"]
    redone = sum(len(e["ids"]) for e in first if e["event"] == "step" and e["step"] > resumed)
    epochs = []
    for epoch in range(config.epochs):
        counts = Counter(i for e in steps if e["epoch"] == epoch for i in e["ids"])
        epochs.append(
            {
                "epoch": epoch,
                "samples": sum(counts.values()),
                "unique": len(counts),
                "expected": start["samples"],
                "duplicates": sum(counts.values()) - len(counts),
                "missing": start["samples"] - len(counts),
            }
        )
    numbers = [e["step"] for e in steps]
    segments = [_segment(e) for run in runs for e in run if e["event"] == "epoch"]
    saves = [e for run in runs for e in run if e["event"] == "save"]
    saved = [e for run in runs for e in run if e["event"] == "saved"]
    done = next(e for e in second if e["event"] == "done")
    return {
        "dataset": msgspec.to_builtins(dataset),
        "config": {
            "samples": config.samples,
            "epochs": config.epochs,
            "batch_size": config.batch_size,
            "workers": config.workers,
            "memory_bytes": config.memory_bytes,
            "checkpoint_every": config.checkpoint_every,
            "keep_last": config.keep_last,
        },
        "kill": {
            "signal": "SIGKILL",
            "at_step": kill["step"],
            "saves_in_flight": kill["in_flight"],
            "newest_committed": max(committed_at_kill, default=None),
        },
        "resume": {
            "newest_version": start["newest_version"],
            "resumed_from_step": start["resumed_from"],
            "epoch": start["epoch"],
            "samples_skipped_in_epoch": start["skip"],
            "samples_redone": redone,
        },
        "steps": {
            "total": len(numbers),
            "expected": config.epochs * start["steps_per_epoch"],
            "in_order": numbers == list(range(1, len(numbers) + 1)),
        },
        "epochs": epochs,
        "exactly_once": all(e["samples"] == e["unique"] == e["expected"] for e in epochs),
        "segments": segments,
        "checkpoints": {
            "saves": len(saves),
            "committed": len(saved),
            "killed_in_flight": len(saves) - len(saved),
            "blocking_seconds": sum(e["blocking"] for e in saves),
            "waited_for_previous_seconds": sum(e["queued"] for e in saves),
            "total_seconds": sum(e["total_seconds"] for e in saved),
            "bytes_raw": sum(e["raw_bytes"] for e in saved),
            "bytes_written": sum(e["stored_bytes"] for e in saved),
            "bytes_skipped": sum(e["skipped_bytes"] for e in saved),
            "keep_last": config.keep_last,
            "versions": versions,
            "in_mirror": in_mirror,
            # The resumed run's Checkpointer.stats() (the killed run could not report its own).
            "resumed_run_stats": done["stats"],
        },
    }
