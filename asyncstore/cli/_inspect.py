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
from ._dcplocate import holds_dcp, version_url
from ._runs import add_step, add_store_options, human_bytes, locate, store_options

__all__ = ["register"]


async def _inspect(url: str, options: dict[str, Any], step: int | None) -> Any:
    # A CheckpointInfo; for a distributed checkpoint, a DistributedInfo.
    from ..checkpoint import inspect

    if step is None and await holds_dcp(url, options):
        return await _distributed(url.rstrip("/"), options)
    located = await locate(url, options, step)
    if located.kind == "object":
        return await inspect(url, store_options=options)
    version = located.versions[-1]  # the step asked for, or the newest
    if version.kind == "checkpoint":
        return await inspect(version_url(url, version), store_options=options)
    return await _distributed(version_url(url, version), options)


async def _distributed(url: str, options: dict[str, Any]) -> Any:
    from ._dcpinspect import inspect_dcp

    return await inspect_dcp(url, options)


def _when(created: float | None) -> str:
    if created is None:
        return "-"
    return datetime.datetime.fromtimestamp(created).isoformat(sep=" ", timespec="seconds")


def _shape(shape: list[int] | None) -> str:
    return "?" if shape is None else "x".join(str(n) for n in shape) or "scalar"


def _distributed_text(info: Any) -> str:
    ratio = info.raw_bytes / info.stored_bytes if info.stored_bytes else 1.0
    head = [
        f"checkpoint  {info.url}",
        f"format      dcp (distributed: {len(info.objects)} rank objects and .metadata)",
        f"created     {_when(info.created)}",
        f"size        {human_bytes(info.size)} ({info.size} bytes, every file)",
        f"raw bytes   {human_bytes(info.raw_bytes)} ({info.raw_bytes})",
        f"stored      {human_bytes(info.stored_bytes)} ({info.stored_bytes}), ratio {ratio:.2f}",
        "",
    ]
    rank_of = {o.name: o.rank for o in info.objects}
    items = [
        [
            item.name,
            item.kind,
            item.dtype or "-",
            "-" if item.kind == "value" else _shape(item.shape),
            str(item.nbytes),
            str(item.chunks),
            " ".join(f"{rank_of.get(name, name)}:{n}" for name, n in sorted(item.ranks.items())),
        ]
        for item in info.items
    ]
    objects = [
        [str(o.rank), o.name, str(o.size), str(o.raw_bytes), str(o.stored_bytes), str(o.items)]
        for o in info.objects
    ]
    return "\n".join(
        [
            *head,
            table(items, ["NAME", "KIND", "DTYPE", "SHAPE", "BYTES", "CHUNKS", "RANK:BYTES"]),
            "",
            table(objects, ["RANK", "OBJECT", "SIZE", "RAW", "STORED", "ITEMS"]),
        ]
    )


def _text(info: Any) -> str:
    if getattr(info, "format", None) == "dcp":
        return _distributed_text(info)
    created = _when(info.created)
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
            _shape(t.shape),
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
        "(default: the newest). Of a distributed (DCP) checkpoint, a version of a run or a "
        "directory holding .metadata: each name of the saved state (fully qualified) with "
        "its shape, dtype and bytes, and the bytes of it each rank object holds; then each "
        "rank object's size, from .metadata and the objects' manifests.",
    )
    inspect.add_argument(
        "url",
        help="a checkpoint, a distributed checkpoint's directory, or a run (a URL holding "
        "step-* versions)",
    )
    add_step(inspect, "the version of this step of the run at URL (default: the newest)")
    add_store_options(inspect)
    add_json(inspect)
    inspect.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Inspect; returns the exit status."""
    value = asyncio.run(_inspect(args.url, store_options(args, args.url), args.step))
    emit(args, value, _text(value))
    return 0
