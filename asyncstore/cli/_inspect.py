"""``asyncstore inspect URL``: a checkpoint's tensors (dtype, shape, bytes, codec,
compression, chunks, chunks shared with earlier versions), metadata and sizes, read from its
manifest alone."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from typing import Any

from ._common import add_json, emit, table
from ._runs import add_step, add_store_options, human_bytes, locate, store_options

__all__ = ["register"]


async def _inspect(url: str, options: dict[str, Any], step: int | None) -> Any:
    # One CheckpointInfo; for a distributed version, a list of them (one per rank object).
    from ..checkpoint import inspect
    from ..checkpoint._distributed import objects_named, read_metadata
    from ..stores import open_store

    located = await locate(url, options, step)
    if located.kind == "object":
        return await inspect(url, store_options=options)
    version = located.versions[-1]  # the step asked for, or the newest
    base = url.rstrip("/")
    if version.kind == "checkpoint":
        return await inspect(f"{base}/{version.key}", store_options=options)
    # A distributed version: one checkpoint object per rank, named by its .metadata.
    async with open_store(url, **options) as store:
        names = sorted(objects_named(await read_metadata(store, version.key)))
    return [await inspect(f"{base}/{version.key}{name}", store_options=options) for name in names]


def _text(info: Any) -> str:
    created = datetime.datetime.fromtimestamp(info.created).isoformat(sep=" ", timespec="seconds")
    ratio = info.raw_bytes / info.stored_bytes if info.stored_bytes else 1.0
    head = [
        f"checkpoint  {info.url}",
        f"format      {info.format}",
        f"created     {created}",
        f"size        {human_bytes(info.size)} ({info.size} bytes, the object itself)",
        f"raw bytes   {human_bytes(info.raw_bytes)} ({info.raw_bytes})",
        f"stored      {human_bytes(info.stored_bytes)} ({info.stored_bytes}), ratio {ratio:.2f}",
        f"packs       {len(info.packs)}",
        f"digest      {info.digest}",
        f"metadata    {json.dumps(info.metadata, sort_keys=True, default=str)}",
        "",
    ]
    rows = [
        [
            t.name,
            t.dtype,
            "?" if t.shape is None else "x".join(str(n) for n in t.shape) or "scalar",
            str(t.nbytes),
            t.codec,
            f"{t.ratio:.2f}",
            str(t.chunks),
            str(t.shared_chunks),
        ]
        for t in info.tensors
    ]
    header = ["TENSOR", "DTYPE", "SHAPE", "BYTES", "CODEC", "RATIO", "CHUNKS", "SHARED"]
    return "\n".join(head) + table(rows, header)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``inspect`` to the command line."""
    inspect = commands.add_parser(
        "inspect",
        help="describe a checkpoint's tensors, metadata and sizes from its manifest",
        description="Describe a checkpoint from its manifest and pickled structure (no "
        "tensor data is read): each tensor's dtype, shape, bytes, codec, compression ratio, "
        "chunks, and chunks shared with earlier versions (in a pack an earlier save wrote); "
        "its metadata, format version, raw and stored bytes. At a run, the version of --step "
        "(default: the newest); a distributed version is shown one rank object at a time.",
    )
    inspect.add_argument("url", help="a checkpoint, or a run (a URL holding step-* versions)")
    add_step(inspect, "the version of this step of the run at URL (default: the newest)")
    add_store_options(inspect)
    add_json(inspect)
    inspect.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Inspect; returns the exit status."""
    value = asyncio.run(_inspect(args.url, store_options(args, args.url), args.step))
    infos = value if isinstance(value, list) else [value]
    emit(args, value, "\n\n".join(_text(info) for info in infos))
    return 0
