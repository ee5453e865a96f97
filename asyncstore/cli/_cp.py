"""``asyncstore cp SRC DST``: copy a checkpoint, or one version of a run with the packs it
points into, to another store (local to S3, S3 to local, …), then verify it there."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any, cast

import msgspec

from ..stores import Store, open_store
from ..stores._open import is_local, local_path
from ._common import add_json, emit, progress
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


class _Named:
    """The source store, with its checkpoint object ``key`` read under ``name``, the name
    it gets at the destination: the copy then writes ``name`` there. Packs keep their keys
    (``packs/...``, relative to the checkpoint's directory, whatever its name)."""

    def __init__(self, store: Store, key: str, name: str) -> None:
        self._store, self._key, self._name = store, key, name

    def _source_key(self, key: str) -> str:
        return self._key if key == self._name else key

    async def stat(self, key: str) -> Any:
        return await self._store.stat(self._source_key(key))

    def open_reader(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return self._store.open_reader(self._source_key(key), *args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)


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
        target_dir, name = await _destination(dst, key, dst_options)
        async with open_store(source_dir, **options) as source:
            manifest = await read_manifest((source, key))
            named = source if name == key else cast(Store, _Named(source, key, name))
            async with open_store(target_dir, **dst_options) as target:
                copied, count = await _copy(named, target, [name], manifest.packs)
                await verify((target, name))
                return Copied(src, f"{target.url}/{name}", copied, count, True)
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
