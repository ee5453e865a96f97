"""``asyncstore cp SRC DST``: copy a checkpoint, or one version of a run with the packs it
points into, to another store (local to S3, S3 to local, …), then verify it there."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from ..stores import Store, is_local, local_path, open_store
from ._common import add_json, emit, progress

if TYPE_CHECKING:
    from ..checkpoint import Manifest

from ._runs import (
    _local_kind,
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


async def _destination(dst: str, name: str, options: dict[str, Any]) -> tuple[str, str]:
    """Where ``cp`` puts the checkpoint object ``name``: the directory (a store URL) and its
    name there. As ``cp`` and ``aws s3 cp`` do, DST is the copy's own name unless it is a
    directory: it ends with ``/``, or it is an existing local directory, or (on S3 and other
    object stores, which have no directories) objects exist under ``DST/`` or DST is a
    bucket alone."""
    if dst.endswith(("/", os.sep)):
        return dst, name
    if is_local(dst):
        return (dst, name) if _local_kind(dst) == "directory" else _split(dst)
    if "/" not in dst.partition("://")[2] or await _holds_objects(dst, options):
        return dst, name
    return _split(dst)


async def _holds_objects(url: str, options: dict[str, Any]) -> bool:
    # One object listed under url/ is enough; a missing bucket holds none (the copy then
    # fails on it, naming it).
    from ..errors import NotFound

    async with open_store(url, **options) as store:
        listing = store.list()
        try:
            async for _ in listing:
                return True
        except NotFound:
            return False
        finally:
            close = getattr(listing, "aclose", None)
            if close is not None:
                await close()
    return False


async def _copy(
    source: Store,
    target: Store,
    keys: list[tuple[str, str]],
    manifest: Manifest | None,
    *,
    force: bool = False,
) -> tuple[int, int]:
    # ``keys``: (key in source, name in target). With ``manifest``, a differential
    # version's packs go first (those the destination lacks, by identity), the version
    # last: the destination never holds a version whose packs are not all there.
    from ..checkpoint.engine import copy_object, copy_version

    packs = [] if manifest is None else manifest.packs
    sizes = [(await source.stat(key)).size for key in [*packs, *(k for k, _ in keys)]]
    copied = 0
    with progress(sum(sizes), "copying") as bar:
        if manifest is not None and packs:
            (key, name), keys = keys[0], keys[1:]
            copied += await copy_version(
                source, target, key, packs, manifest.pack_ids, name=name, force=force
            )
            bar.update(sum(sizes[: len(packs) + 1]))
        for key, name in keys:
            size = await copy_object(source, target, key, name)
            copied += size
            bar.update(size)
    return copied, len(sizes)


async def _copy_verified(source: Store, key: str, target: Store, name: str) -> tuple[int, int]:
    # The source is verified before anything is written: a damaged source never replaces
    # a good destination. Each object then replaces its destination whole (the writers
    # commit atomically), and the copy is verified where it landed; a destination pack
    # that passed its identity check but fails further in is copied again, once.
    from ..checkpoint import read_manifest, verify
    from ..errors import IntegrityError

    try:
        await verify((source, key))
    except IntegrityError as exc:
        raise IntegrityError(
            f"{source.url}/{key} does not verify ({exc}): nothing was copied; copy another "
            "version, or repair the source first"
        ) from None
    manifest = await read_manifest((source, key))
    copied, count = await _copy(source, target, [(key, name)], manifest)
    try:
        await verify((target, name))
    except IntegrityError as exc:
        print(
            f"asyncstore: {target.url}/{name} does not verify after the copy ({exc}); "
            "copying every object again",
            file=sys.stderr,
        )
        copied, count = await _copy(source, target, [(key, name)], manifest, force=True)
        await verify((target, name))
    return copied, count


async def _cp(
    src: str, dst: str, options: dict[str, Any], dst_options: dict[str, Any], step: int | None
) -> Copied:
    from ..checkpoint import Checkpointer
    from ..checkpoint.engine import METADATA

    located = await locate(src, options, step)
    if located.kind == "object":
        source_dir, key = _split(src)
        target_dir, name = await _destination(dst, key, dst_options)
        async with (
            open_store(source_dir, **options) as source,
            open_store(target_dir, **dst_options) as target,
        ):
            copied, count = await _copy_verified(source, key, target, name)
            return Copied(src, f"{target.url}/{name}", copied, count, True)
    if step is None:
        raise _need_step(src, located.versions)
    version = located.versions[0]
    if version.kind == "dcp":  # verified before anything is written
        async with Checkpointer(src, store_options=options) as checkpointer:
            await checkpointer.verify(version.step, raise_on_error=True)
    async with open_store(src, **options) as source, open_store(dst, **dst_options) as target:
        if version.kind == "checkpoint":
            copied, count = await _copy_verified(source, version.key, target, version.key)
        else:
            keys = sorted([i.key async for i in source.list(version.key)])
            keys.sort(key=lambda k: k.endswith(METADATA))  # .metadata last: the commit
            copied, count = await _copy(source, target, [(k, k) for k in keys], None)
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
        "distributed one) to DST, then verify every checksum there. A checkpoint object is "
        "copied as DST, or into DST under its own name when DST is a directory: it ends "
        "with '/', is an existing local directory, or (on S3) has objects under DST/. A "
        "version goes into DST, a run, as a version of the run there.",
    )
    cp.add_argument("src", help="a checkpoint, or a run with --step")
    cp.add_argument(
        "dst", help="the copy's name, or the directory (the run, with --step) it goes into"
    )
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
    options = store_options(args, args.src)
    dst_options = store_options(args, args.dst, name="dst_options")
    copied = asyncio.run(_cp(args.src, args.dst, options, dst_options, args.step))
    text = (
        f"copied {copied.source} -> {copied.destination}: {copied.objects} object(s), "
        f"{human_bytes(copied.bytes)}; verified"
    )
    emit(args, copied, text)
    return 0
