"""Where a DCP checkpoint of the plugin lies: its directory's URL checked, whether the
plugin can open a ``checkpoint_id`` (DCP asks each plugin in turn), and a writer's or
reader's store options."""

from __future__ import annotations

import os
from typing import Any

from torch.futures import Future

from ..errors import AsyncStoreError, InvalidArgument
from ..stores import is_local, local_path

__all__ = ["checked_url", "done", "openable", "place"]


def checked_url(checkpoint_id: Any, what: str) -> str:
    """``checkpoint_id`` (a path, PathLike or URL) as a URL without a trailing ``/``.

    Raises:
        InvalidArgument: naming ``what`` and the id, for one that names no directory.
    """
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    url = checkpoint_id.rstrip("/") if isinstance(checkpoint_id, str) else ""
    if not url or url.endswith(":/"):
        raise InvalidArgument(
            f"{what}: checkpoint_id={checkpoint_id!r}: pass a directory URL or path, such as "
            "'s3://bucket/run1/step-1000' or '/ckpt/step-1000'"
        )
    return url


def openable(checkpoint_id: object) -> bool:
    """Whether asyncstore can open ``checkpoint_id``: a plain path, ``file://``,
    ``memory://NAME`` or ``s3://BUCKET`` (the plugin's ``validate_checkpoint_id``)."""
    # DCP asks
    # each plugin in turn and takes the first that says yes, so a yes here for a URL we
    # cannot open would take it from a plugin that can (and fail later, further from the
    # cause).
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or "\x00" in checkpoint_id:
        return False
    if not is_local(checkpoint_id):
        scheme, _, rest = checkpoint_id.partition("://")
        return scheme.lower() in ("memory", "s3") and bool(rest.split("/", 1)[0])
    try:
        local_path(checked_url(checkpoint_id, "validate_checkpoint_id"))
    except AsyncStoreError:
        return False
    return True


def place(
    url: str | os.PathLike[str] | None, store_options: object, what: str
) -> tuple[str | None, dict[str, Any]]:
    """The checked URL (if any) and store options of a writer or reader."""
    if store_options is not None and not isinstance(store_options, dict):
        raise InvalidArgument(f"{what}: store_options={store_options!r}: pass a dict or None")
    return (None if url is None else checked_url(url, what)), dict(store_options or {})


def done(value: Any) -> Future[Any]:
    """A future already holding ``value`` (what DCP's storage calls return)."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future
