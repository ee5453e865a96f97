"""What the store-taking verbs share: ``--option key=value`` store options, and telling a
checkpoint object from a run of versions (a URL holding ``step-*.ckpt`` or ``step-*.dcp/``).
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Literal

import msgspec

from ..errors import IntegrityError, InvalidArgument, NotFound
from ..stores import Store, is_local, local_path, open_store, options_from_text

__all__ = [
    "Located",
    "add_step",
    "add_store_options",
    "human_bytes",
    "locate",
    "parse_option",
    "read_manifest",
    "store_options",
    "versions_of",
]


def parse_option(text: str) -> tuple[str, str]:
    """``key=value`` as a pair of texts (an argparse type).

    The value stays text here: :func:`store_options` converts it by the type of the option
    it is for, once the store's URL says which options those are.
    """
    # A bad one is a usage error (exit 2), not a failure of the store.
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not key=value (for example endpoint_url=http://127.0.0.1:8333)"
        )
    return key.strip(), value


def add_store_options(parser: argparse.ArgumentParser, *, what: str = "the store") -> None:
    """Give a verb repeated ``--option key=value``: options for ``open_store``."""
    parser.add_argument(
        "--option",
        "-o",
        dest="options",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help=f"an option of {what} (repeatable), such as endpoint_url=http://127.0.0.1:8333; "
        "each value is read as the type of its option (part_bytes=8388608 a number, "
        "create=true a bool, a secret key as text); credentials also come from AWS_* "
        "variables",
    )


def store_options(
    args: argparse.Namespace, url: str, *others: str, name: str = "options"
) -> dict[str, Any]:
    """The ``--option`` values given (a later key wins), each converted by the type its
    option declares for the store at ``url``; ``others``, further URLs the same options go
    to, are checked too.

    Raises:
        InvalidArgument: an option is unknown to one of these stores, or its value is not
            one of its type (one line, naming the option and what it takes).
        InvalidURL: a ``file:`` URL that cannot name a local path.
    """
    given: dict[str, str] = dict(getattr(args, name))
    options = options_from_text(url, given)
    for other in others:
        options_from_text(other, given)
    return options


def add_step(parser: argparse.ArgumentParser, help: str) -> None:
    """Give a verb ``--step N`` (a version of a run)."""
    parser.add_argument("--step", type=_step, default=None, metavar="N", help=help)


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (an int >= 0)")
    return step


def human_bytes(size: int) -> str:
    """``size`` with a binary prefix: ``1.5 MiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class Located(msgspec.Struct, frozen=True):
    """What a URL names: one checkpoint object, or a run (its versions, oldest first)."""

    kind: Literal["object", "run"]
    url: str
    versions: list[Any] = msgspec.field(default_factory=list)


async def versions_of(url: str, options: dict[str, Any]) -> list[Any]:
    """The versions of the run at ``url`` (``Version``s, oldest first; empty when none):
    what ``Checkpointer(url).versions()`` gives, read from the listing and each version's
    footer and manifest alone, without importing torch (which takes seconds) and without
    creating the run's directory."""
    from ..checkpoint.engine import in_save_order, saved_of, scan

    described = []
    async with open_store(url, **options) as store:
        listed, _ = await scan(store)
        for version in listed:
            if version.kind == "dcp":  # its ranks' manifests are not read for a listing
                described.append(msgspec.structs.replace(version, stored_bytes=version.size))
                continue
            try:
                manifest = await read_manifest(store, version.key, version.size)
            except NotFound:
                continue  # deleted since it was listed
            except IntegrityError:
                described.append(msgspec.structs.replace(version, state="damaged"))
                continue
            described.append(
                msgspec.structs.replace(
                    version,
                    raw_bytes=manifest.raw_bytes,
                    stored_bytes=manifest.stored_bytes,
                    saved=saved_of(manifest),
                )
            )
    return in_save_order(described)


async def read_manifest(store: Store, key: str, size: int) -> Any:
    """The verified manifest (a ``Manifest``) of the checkpoint object ``key`` of ``size``
    bytes: two ranged reads, its footer and its manifest, and no torch.

    Raises:
        IntegrityError: it is not an asyncstore checkpoint, or it is damaged.
        NotFound: it is not there.
    """
    from ..checkpoint.engine import read_manifest_of

    where = f"{store.url}/{key}"
    manifest = await read_manifest_of(functools.partial(store.get, key), size, where)
    if manifest is None:
        raise IntegrityError(f"{where} is not an asyncstore checkpoint")
    return manifest


async def locate(url: str, options: dict[str, Any], step: int | None) -> Located:
    """Whether ``url`` names a checkpoint object or a run; with ``step``, the run's version
    of that step (``Located.versions`` holds it alone).

    Raises:
        NotFound: there is neither (or no version of ``step``).
    """
    if step is None:
        if is_local(url):
            kind = _local_kind(url)
            if kind == "file":
                return Located("object", url)
            if kind is None:
                raise NotFound(f"{url} does not exist")
        elif await _object_exists(url, options):
            return Located("object", url)
    versions = await versions_of(url, options) if _may_hold_run(url) else []
    if step is not None:
        chosen = [v for v in versions if v.step == step]
        if not chosen:
            raise NotFound(f"{url.rstrip('/')}: version of step {step} does not exist")
        return Located("run", url, chosen)
    if not versions:
        raise NotFound(f"{url} does not exist (neither a checkpoint nor a run of step-* versions)")
    return Located("run", url, versions)


def _local_kind(url: str) -> Literal["file", "directory"] | None:
    # A stat of a local path: the command line waits for it either way.
    path = local_path(url)
    if os.path.isfile(path):
        return "file"
    return "directory" if os.path.isdir(path) else None


def _may_hold_run(url: str) -> bool:
    return not (is_local(url) and _local_kind(url) == "file")


async def _object_exists(url: str, options: dict[str, Any]) -> bool:
    head, _, key = url.rstrip("/").rpartition("/")
    if not key or head.endswith((":/", "://", "/")):
        return False  # a bucket alone, or no object name: not an object
    async with open_store(head, **options) as store:
        try:
            await store.stat(key)
        except NotFound:
            return False
        except InvalidArgument:
            return False
    return True
