"""``asyncstore export SRC DST``: write an asyncstore checkpoint as a plain ``torch.save``
file, for code that reads checkpoints with ``torch.load``."""

from __future__ import annotations

import argparse
import asyncio

from ._common import add_json, emit
from ._runs import add_store_options, store_options

__all__ = ["register"]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` to the command line."""
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a plain torch.save file that torch.load reads",
        description="Load the asyncstore checkpoint at SRC (every chunk verified, tensors on "
        "the CPU) and write it as a plain torch.save file at DST, a local path or a URL, "
        "atomically: DST holds what it held before until the whole file is there. "
        "torch.load cannot read asyncstore checkpoints; it reads the exported file. The same "
        "is available in Python as asyncstore.torch.export(src, dst).",
    )
    export.add_argument("src", help="an asyncstore checkpoint (a path or URL)")
    export.add_argument("dst", help="where the torch.save file goes (a path or URL)")
    add_store_options(export, what="the stores of SRC and DST")
    add_json(export)
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Export; returns the exit status."""
    from ..torch._checkpoint import _export

    url = asyncio.run(_export(args.src, args.dst, store_options(args, args.src, args.dst)))
    emit(args, {"src": args.src, "dst": url}, f"exported {args.src} to {url} (torch.save)")
    return 0
