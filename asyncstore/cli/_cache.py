"""``asyncstore cache stats DIR`` and ``asyncstore cache clear DIR``: the disk tier of a
``TieredCache`` (its entries, bytes and last reads; removing them while other processes may
be using it)."""

from __future__ import annotations

import argparse
import datetime

from ._common import add_json, emit, table
from ._runs import human_bytes

__all__ = ["register"]


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).isoformat(sep=" ", timespec="seconds")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cache`` (``stats``, ``clear``) to the command line."""
    cache = commands.add_parser(
        "cache",
        help="the disk tier of a TieredCache: its figures, or clear it",
        description="The disk tier of a TieredCache (the disk_dir every process of a node shares).",
    )
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    stats = actions.add_parser(
        "stats",
        help="entries, bytes and last reads of a disk cache directory",
        description="Entries, their bytes, segments, the index's size and when segments were "
        "last read, from the index alone (nothing is written). The budget is each "
        "process's disk_bytes: the directory does not record it.",
    )
    stats.add_argument("dir", help="the cache's disk_dir")
    add_json(stats)
    stats.set_defaults(handler=run_stats)
    clear = actions.add_parser(
        "clear",
        help="remove every entry of a disk cache directory",
        description="Remove every entry under the cache's own lock, in one transaction: "
        "processes using the cache meanwhile see misses and fetch again, never a torn "
        "entry.",
    )
    clear.add_argument("dir", help="the cache's disk_dir")
    clear.set_defaults(handler=run_clear)


def run_stats(args: argparse.Namespace) -> int:
    """Print the figures; returns the exit status."""
    from ..cache import disk_usage  # the cache is imported by the verb that uses it

    usage = disk_usage(args.dir)
    rows = [
        ["directory", usage.directory],
        ["entries", str(usage.entries)],
        ["entry bytes", f"{human_bytes(usage.entry_bytes)} ({usage.entry_bytes})"],
        ["segments", str(usage.segments)],
        ["segment bytes", f"{human_bytes(usage.segment_bytes)} ({usage.segment_bytes})"],
        ["index bytes", f"{human_bytes(usage.index_bytes)} ({usage.index_bytes})"],
        ["used bytes", f"{human_bytes(usage.used_bytes)} ({usage.used_bytes})"],
        ["files on disk", f"{human_bytes(usage.file_bytes)} ({usage.file_bytes})"],
        ["budget", "not recorded" if usage.budget is None else str(usage.budget)],
        ["oldest read", _when(usage.oldest_read)],
        ["newest read", _when(usage.newest_read)],
        ["index version", str(usage.index_version)],
    ]
    emit(args, usage, table(rows, ["DISK CACHE", ""]))
    return 0


def run_clear(args: argparse.Namespace) -> int:
    """Clear; returns the exit status."""
    from ..cache import clear_disk

    removed = clear_disk(args.dir)
    print(f"removed {removed} entries from {args.dir}")
    return 0
