"""``asyncstore cp SRC DST``: copy a checkpoint, or one version of a run with the packs it
points into, to another store (local to S3, S3 to local, …), then verify it there."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import msgspec

from ..stores import Store, open_store
from ..stores._open import is_local, local_path
from ._common import add_json, emit, progress
from ._runs import (
    add_step,
    add_store_options,
    human_bytes,
    locate,
    parse_option,
    store_options,
)

__all__ = ["register"]


class Copied(msgspec.Struct, frozen=True):
    """What ``cp`` copied: the checkpoint's URL at the destination and the bytes sent."""

    source: str
    destination: str
    bytes: int
    objects: int
    verified: bool


def _split(url: str) -> tuple[str, str]:
    # A checkpoint URL -> its directory (a store URL) and its name there.
    if is_local(url):
        directory, name = os.path.split(local_path(url))
        return directory, name
    head, _, name = url.rstrip("/").rpartition("/")
    return head, name


async def _copy(source: Store, target: Store, keys: list[str], packs: list[str]) -> tuple[int, int]:
    from ..checkpoint._mirror import copy_object, copy_version

    sizes = [(await source.stat(key)).size for key in [*packs, *keys]]
    copied = 0
    with progress(sum(sizes), "copying") as bar:
        if packs:
            # Packs first (those the destination lacks), the version last: the
            # destination never holds a version whose packs are not all there.
            copied += await copy_version(source, target, keys[0], packs)
            bar.update(sum(sizes[: len(packs) + 1]))
            keys = keys[1:]
        for key in keys:
            size = await copy_object(source, target, key)
            copied += size
            bar.update(size)
    return copied, len(sizes)


async def _cp(
    src: str, dst: str, options: dict[str, Any], dst_options: dict[str, Any], step: int | None
) -> Copied:
    from ..checkpoint import Checkpointer, read_manifest, verify
    from ..checkpoint._distributed import METADATA

    located = await locate(src, options, step)
    if located.kind == "object":
        source_dir, key = _split(src)
        async with open_store(source_dir, **options) as source:
            manifest = await read_manifest((source, key))
            async with open_store(dst, **dst_options) as target:
                copied, count = await _copy(source, target, [key], manifest.packs)
                await verify((target, key))
                return Copied(src, f"{target.url}/{key}", copied, count, True)
    if step is None:
        raise _need_step(src, located.versions)
    version = located.versions[0]
    async with open_store(src, **options) as source, open_store(dst, **dst_options) as target:
        if version.kind == "checkpoint":
            manifest = await read_manifest((source, version.key))
            copied, count = await _copy(source, target, [version.key], manifest.packs)
            await verify((target, version.key))
        else:
            keys = sorted([i.key async for i in source.list(version.key)])
            keys.sort(key=lambda k: k.endswith(METADATA))  # .metadata last: the commit
            copied, count = await _copy(source, target, keys, [])
        url = target.url
    if version.kind == "dcp":
        async with Checkpointer(dst, store_options=dst_options) as checkpointer:
            await checkpointer.verify(version.step, raise_on_error=True)
    return Copied(src, f"{url}/{version.key}", copied, count, True)


def _need_step(src: str, versions: list[Any]) -> Exception:
    from ..errors import InvalidArgument

    steps = ", ".join(str(v.step) for v in versions[-8:])
    return InvalidArgument(f"{src} is a run of versions: pass --step N (its newest: {steps})")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cp`` to the command line."""
    cp = commands.add_parser(
        "cp",
        help="copy a checkpoint, or a version of a run, to another store and verify it there",
        description="Copy a checkpoint object, or the version --step of the run at SRC "
        "(with the packs a differential version points into, or every rank object of a "
        "distributed one) into DST, a store URL or directory, then verify every checksum "
        "there. The copy keeps its name: a version goes into DST as a version of the run "
        "there.",
    )
    cp.add_argument("src", help="a checkpoint, or a run with --step")
    cp.add_argument("dst", help="the store URL or directory the copy goes into")
    add_step(cp, "the version of this step of the run at SRC")
    add_store_options(cp, what="the source store")
    cp.add_argument(
        "--dst-option",
        dest="dst_options",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="an option of the destination store (repeatable), as --option is of the source",
    )
    add_json(cp)
    cp.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Copy; returns the exit status."""
    options = store_options(args)
    dst_options = store_options(args, "dst_options")
    copied = asyncio.run(_cp(args.src, args.dst, options, dst_options, args.step))
    text = (
        f"copied {copied.source} -> {copied.destination}: {copied.objects} object(s), "
        f"{human_bytes(copied.bytes)}; verified"
    )
    emit(args, copied, text)
    return 0
