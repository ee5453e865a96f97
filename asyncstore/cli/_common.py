"""What every verb of the command line shares: errors as one line, ``--json`` output,
progress bars only on a terminal."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["add_json", "emit", "fail", "progress", "table"]


def fail(error: BaseException | str) -> int:
    """Print ``asyncstore: <error>`` on stderr (one line, no traceback); returns 1."""
    text = " ".join(str(error).split())
    print(f"asyncstore: {text}", file=sys.stderr)
    return 1


def add_json(parser: argparse.ArgumentParser) -> None:
    """Give a reporting verb ``--json``: machine-readable output on stdout instead of text."""
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of text"
    )


def emit(args: argparse.Namespace, value: Any, text: str) -> None:
    """Print ``value`` as JSON with ``--json`` (msgspec Structs included), else ``text``."""
    if getattr(args, "json", False):
        print(json.dumps(msgspec.to_builtins(value), indent=2, sort_keys=True))
    else:
        print(text)


def table(rows: list[list[str]], header: list[str]) -> str:
    """``rows`` under ``header`` as aligned columns (numbers right-aligned)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = []
        for i, cell in enumerate(row):
            text = str(cell)
            numeric = text.replace(".", "", 1).replace(",", "").lstrip("-").isdigit()
            cells.append(text.rjust(widths[i]) if numeric else text.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


@contextlib.contextmanager
def progress(total: int | None, description: str, unit: str = "B") -> Iterator[tqdm[Any]]:
    """A progress bar on stderr when it is a terminal; silent otherwise (pipes, CI, logs).

    ``unit="B"`` shows bytes with binary prefixes; call ``bar.update(n)`` as work is done.
    """
    from tqdm import tqdm  # imported by the verbs that show progress, not at start-up

    bar = tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
        dynamic_ncols=True,
    )
    try:
        yield bar
    finally:
        bar.close()
