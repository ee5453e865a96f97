"""``asyncstore prune URL --keep-last N``: retention on an existing run, then the packs no
version points into any more."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ._common import add_json, emit
from ._runs import add_store_options, locate, store_options

__all__ = ["register"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return value


async def _prune(
    url: str, options: dict[str, Any], keep_last: int, keep_every: int | None, dry_run: bool
) -> list[int]:
    from ..checkpoint import Checkpointer

    await locate(url, options, None)  # NotFound, naming it, when there is no run there
    async with Checkpointer(url, store_options=options) as checkpointer:
        return await checkpointer.prune(keep_last, keep_every, dry_run=dry_run)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``prune`` to the command line."""
    prune = commands.add_parser(
        "prune",
        help="delete the versions of a run that a retention policy does not keep",
        description="Keep the newest versions of the run at URL back to the --keep-last-th "
        "one that verifies, and every version whose step is a multiple of --keep-every; "
        "delete the others, then the packs no version points into any more. Nothing is "
        "deleted when no version verifies.",
    )
    prune.add_argument("url", help="a run (a URL holding step-* versions)")
    prune.add_argument(
        "--keep-last", type=_positive, required=True, metavar="N", help="newest versions kept"
    )
    prune.add_argument(
        "--keep-every",
        type=_positive,
        default=None,
        metavar="M",
        help="also keep every version whose step is a multiple of M",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="print what would be deleted; delete nothing"
    )
    add_store_options(prune)
    add_json(prune)
    prune.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Prune; returns the exit status."""
    options = store_options(args, args.url)
    steps = asyncio.run(_prune(args.url, options, args.keep_last, args.keep_every, args.dry_run))
    verb = "would delete" if args.dry_run else "deleted"
    lines = [f"{verb} step {step}" for step in steps]
    text = "\n".join(lines) if lines else "nothing to delete"
    emit(args, {"dry_run": args.dry_run, "deleted": steps}, text)
    return 0
