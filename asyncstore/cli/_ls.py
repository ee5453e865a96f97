"""``asyncstore ls URL``: a run's versions (step, kind, sizes, state, time), or the objects
under any other URL."""

from __future__ import annotations

import argparse
import asyncio
import datetime
from typing import Any

import msgspec

from ..errors import NotFound
from ..stores import ObjectInfo, open_store
from ._common import add_json, emit, table
from ._runs import add_store_options, human_bytes, store_options, versions_of

__all__ = ["register"]


def _when(mtime: float | None) -> str:
    if mtime is None:
        return "-"
    return datetime.datetime.fromtimestamp(mtime).isoformat(sep=" ", timespec="seconds")


async def _list(url: str, options: dict[str, Any]) -> tuple[str, list[Any]]:
    # A run when versions are there; objects otherwise (a run is listed from its names).
    async with open_store(url, **options) as store:
        objects: list[ObjectInfo] = [info async for info in store.list("")]
    if any(info.key.startswith("step-") for info in objects):
        versions = await versions_of(url, options)
        if versions:
            return "run", versions
    if not objects:
        raise NotFound(f"{url} does not exist (no objects under it)")
    return "objects", objects


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ls`` to the command line."""
    ls = commands.add_parser(
        "ls",
        help="list a run's checkpoint versions, or the objects under a URL",
        description="At a run (a URL holding step-*.ckpt files or step-*.dcp/ directories) "
        "list its versions: step, kind, size, stored bytes, state and time. Anywhere else "
        "list the objects under the URL: key, size and time.",
    )
    ls.add_argument("url", help="a store URL or local directory")
    add_store_options(ls)
    add_json(ls)
    ls.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """List; returns the exit status."""
    kind, rows = asyncio.run(_list(args.url, store_options(args, args.url)))
    if kind == "run":
        text = table(
            [
                [
                    str(v.step),
                    v.kind,
                    human_bytes(v.size),
                    human_bytes(v.stored_bytes),
                    v.state,
                    _when(v.mtime),
                ]
                for v in rows
            ],
            ["STEP", "KIND", "SIZE", "STORED", "STATE", "MODIFIED"],
        )
        value: Any = {"kind": "run", "url": args.url, "versions": rows}
    else:
        text = table(
            [[o.key, str(o.size), _when(o.mtime)] for o in rows], ["KEY", "SIZE", "MODIFIED"]
        )
        value = {
            "kind": "objects",
            "url": args.url,
            "objects": [msgspec.structs.asdict(o) for o in rows],
        }
    emit(args, value, text)
    return 0
