"""The ``asyncstore`` command line (also ``python -m asyncstore``).

Each verb lives in its own module with a ``register(commands)`` function that adds its
sub-parser and sets ``handler``: a function of the parsed arguments returning the exit
status. :func:`main` parses, runs the handler, and turns an asyncstore error into one line
on stderr and exit status 1 (a bad argument: argparse's usage line and status 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import AsyncStoreError as _AsyncStoreError
from . import (
    _bench,
    _cache,
    _cp,
    _demo,
    _export,
    _import,
    _inspect,
    _ls,
    _prune,
    _server,
    _verify,
)
from ._common import fail as _fail

__all__ = ["main", "parser"]

# The verbs, in the order ``asyncstore --help`` lists them.
_VERBS = (_ls, _inspect, _verify, _cp, _prune, _cache, _bench, _server, _export, _import, _demo)


def parser() -> argparse.ArgumentParser:
    """The command line's parser, every verb registered."""
    top = argparse.ArgumentParser(
        prog="asyncstore",
        description="Stores, a tiered cache and streaming checkpoints for ML training.",
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb in _VERBS:
        verb.register(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except _AsyncStoreError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
