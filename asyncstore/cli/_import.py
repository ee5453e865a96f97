"""``asyncstore import SRC DST``: save the state dict in a ``torch.save`` file as a
distributed (DCP) checkpoint in asyncstore's layout, the reverse of ``export`` (see
:mod:`._dcpexport`)."""

from __future__ import annotations

import argparse

from ._common import add_json, emit
from ._export import add_src_dst_options, dst_options
from ._runs import add_step, store_options
from ._saveopts import add_save_options, save_config

__all__ = ["register"]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``import`` to the command line."""
    command = commands.add_parser(
        "import",
        help="save a torch.save file as a distributed (DCP) checkpoint",
        description="Load the state dict in the torch.save file at SRC (a local path or a "
        "URL; weights_only=True) and save it as a distributed checkpoint in asyncstore's "
        "layout at DST, a directory, or with --step the distributed version of that step of "
        "the run at DST (no version of the run is deleted), as "
        "torch.distributed.checkpoint.format_utils.torch_save_to_dcp does in DCP's own "
        "layout. The checkpoint appears whole or not at all. dcp.load with "
        "asyncstore.torch.dcp.StorageReader (or a Checkpointer's dcp_load) loads it at any "
        "world size. The same is available in Python as "
        "asyncstore.torch.torch_save_to_dcp(src, dst).",
    )
    command.add_argument("src", help="the torch.save file (a path or URL)")
    command.add_argument("dst", help="the checkpoint's directory, or a run with --step")
    add_step(command, "save the distributed version of this step of the run at DST")
    add_src_dst_options(command)
    add_save_options(command)
    add_json(command)
    command.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Import; returns the exit status."""
    from ._dcpexport import import_dcp

    config = save_config(args, "asyncstore import")
    options = store_options(args, args.src)
    chosen = dst_options(args, options)
    url = import_dcp(args.src, args.dst.rstrip("/"), options, chosen, args.step, config)
    emit(
        args,
        {"src": args.src, "dst": url},
        f"imported {args.src} to {url} (a distributed checkpoint)",
    )
    return 0
