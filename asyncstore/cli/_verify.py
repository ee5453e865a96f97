"""``asyncstore verify URL``: check every checksum of a checkpoint, of every version of a
run, or of one version (``--step``); exit status 1 when any fails."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec

from ..errors import IntegrityError
from ._common import add_json, emit, progress
from ._runs import add_step, add_store_options, locate, store_options

__all__ = ["register"]


class Checked(msgspec.Struct, frozen=True):
    """One checkpoint verified: a version of a run (``step``) or an object."""

    url: str
    ok: bool
    step: int | None = None
    error: str | None = None


async def _verify(url: str, options: dict[str, Any], step: int | None) -> list[Checked]:
    from ..checkpoint import Checkpointer, verify

    located = await locate(url, options, step)
    if located.kind == "object":
        with progress(1, "verifying", unit="checkpoint") as bar:
            try:
                await verify(url, store_options=options)
            except IntegrityError as exc:
                return [Checked(url, False, error=str(exc))]
            bar.update(1)
        return [Checked(url, True)]
    checked = []
    async with Checkpointer(url, store_options=options) as checkpointer:
        with progress(len(located.versions), "verifying", unit="version") as bar:
            for version in located.versions:
                report = await checkpointer.verify(version.step)
                where = f"{checkpointer.url}/{version.key}"
                checked.append(Checked(where, report.ok, version.step, report.error))
                bar.update(1)
    return checked


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``verify`` to the command line."""
    verify = commands.add_parser(
        "verify",
        help="check every checksum of a checkpoint or of a run's versions",
        description="Check every checksum of a checkpoint object (footer, manifest, "
        "structure, every chunk, in its packs too), of every version of a run, or of one "
        "version with --step. Exit status 0 when all pass, 1 when any fails (each failure "
        "named on its own line).",
    )
    verify.add_argument("url", help="a checkpoint, or a run (a URL holding step-* versions)")
    add_step(verify, "only the version of this step of the run at URL")
    add_store_options(verify)
    add_json(verify)
    verify.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Verify; returns the exit status."""
    checked = asyncio.run(_verify(args.url, store_options(args, args.url), args.step))
    failed = [c for c in checked if not c.ok]
    lines = []
    for item in checked:
        name = item.url if item.step is None else f"step {item.step} ({item.url})"
        error = " ".join((item.error or "").split())
        lines.append(f"ok      {name}" if item.ok else f"FAILED  {name}: {error}")
    lines.append(f"{len(checked) - len(failed)} of {len(checked)} verified")
    emit(args, {"ok": not failed, "checked": checked}, "\n".join(lines))
    return 1 if failed else 0
