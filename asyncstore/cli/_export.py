"""``asyncstore export SRC DST``: write an asyncstore checkpoint as a plain ``torch.save``
file, for code that reads checkpoints with ``torch.load``: a checkpoint object, a version of
a run (``--step``), or a distributed (DCP) checkpoint, whole (see :mod:`._dcpexport`)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..stores import is_local
from ._common import add_json, emit
from ._dcplocate import holds_dcp, need_step, version_url
from ._runs import add_step, add_store_options, locate, parse_option, store_options

__all__ = ["add_src_dst_options", "dst_options", "register"]


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
    add_src_dst_options(export)
    add_json(export)
    export.set_defaults(handler=run)


def add_src_dst_options(parser: argparse.ArgumentParser) -> None:
    """Give a verb from SRC to DST ``--option key=value`` for SRC's store (and DST's of the
    same kind) and ``--dst-option key=value`` for DST's (see :func:`dst_options`)."""
    add_store_options(
        parser, what="the store of SRC, and of DST when DST is a store of the same kind"
    )
    parser.add_argument(
        "--dst-option",
        dest="dst_options",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="an option of the destination store (repeatable), as --option is of the "
        "source; when none is given, DST takes SRC's options if it is a store of the same "
        "kind (both S3, or both local), and none otherwise",
    )


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


def _kind(url: str) -> str:
    return "file" if is_local(url) else url.partition("://")[0].lower()


def dst_options(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """The options of DST's store: ``--dst-option``'s, else SRC's ``options`` where DST is a
    store of the same kind."""
    if args.dst_options:
        return store_options(args, args.dst, name="dst_options")
    # An S3 export to a local file (or back) takes no S3 options for the file.
    return options if _kind(args.src) == _kind(args.dst) else {}


def run(args: argparse.Namespace) -> int:
    """Export; returns the exit status."""
    options = store_options(args, args.src)
    chosen = dst_options(args, options)
    source, distributed = asyncio.run(_source(args.src, options, args.step))
    if distributed:
        from ._dcpexport import export_dcp

        url = export_dcp(source, args.dst, options, chosen)
        kind = "torch.save of the whole state, as dcp_to_torch_save writes it"
    else:
        from ..torch import export

        url = export(source, args.dst, store_options=options, dst_store_options=chosen)
        kind = "torch.save"
    emit(args, {"src": source, "dst": url}, f"exported {source} to {url} ({kind})")
    return 0
