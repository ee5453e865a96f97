"""Where a distributed (DCP) checkpoint is, for the verbs that read one (``inspect``,
``export``): a directory holding ``.metadata`` (``step-000000300.dcp/`` of a run, or any
directory ``asyncstore.torch.dcp.StorageWriter`` wrote), found without importing torch."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument, InvalidURL, NotFound
from ..stores import open_store

__all__ = ["METADATA", "holds_dcp", "need_step", "version_url"]

METADATA = ".metadata"
"""The object that makes a directory a complete distributed checkpoint (written last)."""


async def holds_dcp(url: str, options: dict[str, Any]) -> bool:
    """Whether ``url`` is a directory holding a distributed checkpoint's ``.metadata``."""
    try:
        async with open_store(url, **options) as store:
            await store.stat(METADATA)
    except (NotFound, InvalidArgument, InvalidURL):
        return False
    return True


def version_url(run: str, version: Any) -> str:
    """The URL of ``version`` (a ``Version``) of the run at ``run``, without a trailing
    ``/`` (a distributed version's directory, or a checkpoint object)."""
    return f"{run.rstrip('/')}/{version.key.rstrip('/')}"


def need_step(url: str, versions: list[Any]) -> InvalidArgument:
    """The error for a verb that needs ``--step`` and was given the run at ``url``."""
    steps = ", ".join(str(v.step) for v in versions[-8:])
    return InvalidArgument(f"{url} is a run of versions: pass --step N (its newest: {steps})")
