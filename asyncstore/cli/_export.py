"""``asyncstore export SRC DST``: write an asyncstore checkpoint as a plain ``torch.save``
file, for code that reads checkpoints with ``torch.load``: a checkpoint object, a version of
a run (``--step``), or a distributed (DCP) checkpoint, whole (see :mod:`._dcpexport`)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ._common import add_json, emit
from ._dcplocate import holds_dcp, need_step, version_url
from ._runs import add_step, add_store_options, locate, store_options

__all__ = ["register"]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` to the command line."""
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a plain torch.save file that torch.load reads",
        description="Load the asyncstore checkpoint at SRC (every chunk verified, tensors on "
        "the CPU) and write it as a plain torch.save file at DST, a local path or a URL, "
        "atomically: DST holds what it held before until the whole file is there. SRC is a "
        "checkpoint object, a run with --step, or a distributed checkpoint's directory "
        "(step-*.dcp/, or any directory asyncstore.torch.dcp.StorageWriter wrote): a "
        "distributed checkpoint is written whole, un-sharded, in the format of "
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save. torch.load cannot read "
        "asyncstore checkpoints; it reads the exported file. The same is available in "
        "Python as asyncstore.torch.export(src, dst).",
    )
    export.add_argument(
        "src", help="an asyncstore checkpoint, a distributed checkpoint's directory, or a run"
    )
    export.add_argument("dst", help="where the torch.save file goes (a path or URL)")
    add_step(export, "the version of this step of the run at SRC")
    add_store_options(export, what="the stores of SRC and DST")
    add_json(export)
    export.set_defaults(handler=run)


async def _source(src: str, options: dict[str, Any], step: int | None) -> tuple[str, bool]:
    # What to export: a URL, and whether it is a distributed checkpoint's directory.
    if step is None:
        if await holds_dcp(src, options):
            return src.rstrip("/"), True
        located = await locate(src, options, None)
        if located.kind == "run":
            raise need_step(src, located.versions)
        return src, False
    located = await locate(src, options, step)
    version = located.versions[0]
    return version_url(src, version), version.kind == "dcp"


def run(args: argparse.Namespace) -> int:
    """Export; returns the exit status."""
    options = store_options(args, args.src, args.dst)
    source, distributed = asyncio.run(_source(args.src, options, args.step))
    if distributed:
        from ._dcpexport import export_dcp

        url = export_dcp(source, args.dst, options)
        kind = "torch.save of the whole state, as dcp_to_torch_save writes it"
    else:
        from ..torch._checkpoint import _export

        url = asyncio.run(_export(source, args.dst, options))
        kind = "torch.save"
    emit(args, {"src": source, "dst": url}, f"exported {source} to {url} ({kind})")
    return 0
