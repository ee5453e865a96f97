"""The save options of a command that saves (``import``): flags named as
:func:`asyncstore.save`'s options, read into one ``SaveConfig`` handed down unchanged."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._config import SaveConfig

__all__ = ["add_save_options", "save_config"]


def add_save_options(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the flags of :func:`asyncstore.save`'s options (defaults: its)."""
    group = parser.add_argument_group("save options (as for asyncstore.save)")
    group.add_argument(
        "--compression",
        choices=("auto", "zstd", "none"),
        help="auto (the default): where it pays; zstd: always; none: never",
    )
    group.add_argument("--level", type=int, help="zstd level, -7 to 22 (default 1)")
    group.add_argument(
        "--chunk-bytes", type=int, help="the unit of compression and checksums (default 32 MiB)"
    )
    group.add_argument(
        "--staging-bytes", type=int, help="the staging pool's budget (default 2 GiB)"
    )
    group.add_argument(
        "--exclude",
        action="append",
        metavar="PATTERN",
        help="store entries matching this fnmatch pattern raw (repeatable)",
    )
    group.add_argument("--priority", choices=("low", "normal"), help="default low")


def save_config(args: argparse.Namespace, command: str) -> SaveConfig:
    """The ``SaveConfig`` the flags of :func:`add_save_options` give (a flag left out keeps
    its default).

    Raises:
        InvalidArgument: a value out of bounds, named with ``command``.
    """
    from ..checkpoint.engine import build_save_config

    given = {
        "compression": args.compression,
        "level": args.level,
        "chunk_bytes": args.chunk_bytes,
        "staging_bytes": args.staging_bytes,
        "exclude": args.exclude,
        "priority": args.priority,
    }
    values = {name: value for name, value in given.items() if value is not None}
    if values.get("compression") == "none":
        values["compression"] = None
    return build_save_config(command, None, values)
