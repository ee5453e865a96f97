"""A run's versions: how they are named, listed, told apart and ordered.

A version is one checkpoint object named by its step, zero-padded so that names sort as
steps do (``step-000001000.ckpt``), or a distributed version's directory
(``step-000001000.dcp/``). The set of versions is what the store holds: each save is atomic
(a version is there whole or not at all), so the list is right after any crash, and no
index can disagree with it.

With a mirror, a step may have a copy in each store. Two copies are the same version only
when their *identities* agree (:func:`identity`: the manifest's digest over every chunk and
its creation time, never the size alone: a step saved again with other bytes of the same
size is another version). :func:`merge` decides, step by step, which copies serve it.
"""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

import msgspec

from ..stores import ObjectInfo, Store
from . import _distributed as dist_layout
from . import _format as fmt

__all__ = [
    "CHAIN",
    "DCP_SUFFIX",
    "PREFIX",
    "SAVED",
    "SUFFIX",
    "Copy",
    "Version",
    "dcp_prefix",
    "identity",
    "in_save_order",
    "is_version_key",
    "merge",
    "saved_of",
    "scan",
    "version_key",
]

PREFIX = "step-"
SUFFIX = ".ckpt"
DIGITS = 9
# The metadata key of a differential version's place in its chain: 0 for a full save, then
# one more for each differential save that builds on it.
CHAIN = "chain"

# The metadata key of when save() was called (Unix seconds): what orders versions, so that
# after a rollback the version saved last is the newest, whatever its step.
SAVED = "saved"

DCP_SUFFIX = ".dcp/"

_NAME = re.compile(rf"^{PREFIX}(\d{{{DIGITS},}}){re.escape(SUFFIX)}$")
_DCP_NAME = re.compile(rf"^{PREFIX}(\d{{{DIGITS},}}){re.escape(DCP_SUFFIX)}(.+)$")


def version_key(step: int) -> str:
    """The key of the version of ``step``: ``step-000001000.ckpt``."""
    return f"{PREFIX}{step:0{DIGITS}d}{SUFFIX}"


def dcp_prefix(step: int) -> str:
    """The directory of the distributed version of ``step``: ``step-000001000.dcp/``."""
    return f"{PREFIX}{step:0{DIGITS}d}{DCP_SUFFIX}"


class Version(msgspec.Struct, frozen=True):
    """One committed version of a run's checkpoints.

    Attributes:
        step: the training step it was saved at.
        key: its key in the store (``step-000001000.ckpt``; for a distributed version, its
            directory ``step-000001000.dcp/``).
        size: the bytes of that object (for a differential version, only its structure
            and manifest: its chunks lie in packs; for a distributed version, of every
            object in its directory).
        mtime: when it was committed (Unix seconds, from the store; ``None`` if unknown).
        where: which store holds it: ``"local"`` (the checkpointer's own URL),
            ``"mirror"``, or ``"both"``.
        state: ``"committed"``; ``"uploading"`` while a mirror lacks a local version;
            ``"damaged"`` when its manifest does not verify, or when a load or
            :meth:`~Checkpointer.verify` of this checkpointer found it damaged.
        raw_bytes: the tensors' bytes plus the pickled structure (0 when damaged, and for
            a distributed version, whose ranks' manifests are not read for a listing).
        stored_bytes: what its save wrote, the chunks earlier versions held left out
            (0 when damaged).
        kind: ``"checkpoint"``, one object written by :meth:`Checkpointer.save`; or
            ``"dcp"``, a distributed version written by ``torch.distributed.checkpoint``
            through :meth:`asyncstore.torch.Checkpointer.dcp_writer`.
        etag: the store's version tag of the object (see :class:`asyncstore.ObjectInfo`).
        saved: when it was saved (Unix seconds): the time of the :meth:`Checkpointer.save`
            call (recorded in the version); for a version of an earlier release, when its
            manifest was made; for a distributed version, when its first object was
            written; ``None`` when unknown (its manifest does not read: it is then listed
            after the version of the step before it). Versions are ordered by it: the
            newest is the one saved last, also after a rollback to a lower step.
    """

    step: int
    key: str
    size: int
    mtime: float | None
    where: Literal["local", "mirror", "both"] = "local"
    state: Literal["committed", "uploading", "damaged"] = "committed"
    raw_bytes: int = 0
    stored_bytes: int = 0
    kind: Literal["checkpoint", "dcp"] = "checkpoint"
    saved: float | None = None
    etag: str | None = None

    @property
    def stamp(self) -> tuple[float | None, str | None]:
        """What tells this object from another written under its key: mtime and ETag
        (S3's mtime has one-second resolution; a key rewritten within the second with
        the same size differs by its ETag)."""
        return (self.mtime, self.etag)


async def scan(store: Store) -> tuple[list[Version], list[int]]:
    """The versions in ``store``, by step; and the steps of distributed saves with no
    ``.metadata`` (not complete: in flight, or killed). Listing only: no manifest read."""
    found: dict[int, Version] = {}
    directories: dict[int, list[ObjectInfo]] = {}
    async for info in store.list(PREFIX):
        match = _NAME.match(info.key)
        if match is not None:
            step = int(match.group(1))
            found[step] = Version(step, info.key, info.size, info.mtime, etag=info.etag)
        elif (match := _DCP_NAME.match(info.key)) is not None:
            directories.setdefault(int(match.group(1)), []).append(info)
        # else not a version: another file in the same place
    unfinished = []
    for step, infos in directories.items():
        key = dcp_prefix(step)
        marker = next((i for i in infos if i.key == key + dist_layout.METADATA), None)
        if marker is None:
            unfinished.append(step)
            continue
        size = sum(i.size for i in infos)
        other = found.get(step)
        # A step saved both ways: the newer save is the version.
        if other is None or (other.mtime or 0.0) <= (marker.mtime or 0.0):
            # Saved when its first object was written: a later change to one of its files
            # (a copy, damage) does not move it.
            times = [i.mtime for i in infos if i.mtime is not None]
            saved = min(times) if times else None
            found[step] = Version(step, key, size, marker.mtime, kind="dcp", saved=saved)
    return [found[step] for step in sorted(found)], sorted(unfinished)


def is_version_key(key: str) -> bool:
    """Whether ``key`` names a single-object version (``step-000001000.ckpt``)."""
    return _NAME.match(key) is not None


def in_save_order(versions: list[Version]) -> list[Version]:
    """``versions`` in the order they were saved, the newest last (ties: by step). One
    whose save time is unknown (its manifest does not read) keeps its place by step: it
    is taken as saved just after the version of the step before it."""
    keyed = []
    before = 0.0
    for version in sorted(versions, key=lambda v: v.step):
        if version.saved is not None:
            before = version.saved
        keyed.append((before if version.saved is None else version.saved, version.step, version))
    return [version for _, _, version in sorted(keyed, key=lambda item: item[:2])]


def saved_of(manifest: fmt.Manifest) -> float:
    """When the version was saved: the time of the ``save()`` call its metadata records,
    or for an earlier release's version, when its manifest was made."""
    saved: Any = manifest.metadata.get(SAVED)
    if isinstance(saved, bool) or not isinstance(saved, int | float):
        saved = manifest.created
    return float(saved)


def identity(manifest: fmt.Manifest) -> tuple[int, float]:
    """What makes two copies of a step the same version: the digest over every chunk's
    checksum (the structure's among them) and when the manifest was made."""
    return (manifest.digest, manifest.created)


class Copy(NamedTuple):
    """One store's copy of a version, as :func:`merge` weighs it."""

    version: Version
    identity: tuple[int, float] | None  # None: its manifest does not read (damaged)
    saved: float


def merge(local: dict[int, Copy], mirrored: dict[int, Copy]) -> tuple[list[Version], list[str]]:
    """The run's versions from each store's copies (by step), with ``where`` and ``state``
    set; and a line for each step where a copy was passed over, for a warning.

    - One copy: it serves the step (``"uploading"`` when only here: the mirror lacks it).
    - Two copies of one identity: ``"both"``, read here first.
    - A copy whose manifest does not read: the other serves the step.
    - Two different versions (a step saved again, one copy stale): the one saved later
      serves it (the local one on a tie); a local one is ``"uploading"`` until the mirror
      holds it too.
    Distributed versions are not uploaded by the checkpointer: copies agree when sizes do.
    """
    merged: list[Version] = []
    notes: list[str] = []
    for step in sorted(local.keys() | mirrored.keys()):
        here, there = local.get(step), mirrored.get(step)
        if there is None:
            assert here is not None
            version = here.version
            if version.kind == "checkpoint":
                version = msgspec.structs.replace(version, state="uploading")
            merged.append(version)
            continue
        if here is None:
            merged.append(msgspec.structs.replace(there.version, where="mirror"))
            continue
        if here.version.kind == "dcp" or there.version.kind == "dcp":
            same = (here.version.kind, here.version.size) == (
                there.version.kind,
                there.version.size,
            )
        else:
            same = here.identity is not None and here.identity == there.identity
        if same:
            merged.append(msgspec.structs.replace(here.version, where="both"))
        elif here.identity is None and there.identity is not None:
            notes.append(
                f"step {step}: the local copy does not load (its manifest does not read); "
                "the mirror's copy serves it"
            )
            merged.append(msgspec.structs.replace(there.version, where="mirror"))
        elif there.identity is None or here.saved >= there.saved:
            merged.append(msgspec.structs.replace(here.version, state="uploading"))
        else:
            notes.append(
                f"step {step}: the mirror holds a version saved later than the local copy; "
                "it serves the step"
            )
            merged.append(msgspec.structs.replace(there.version, where="mirror"))
    return merged, notes
