"""The disk tier's segment files: creating, opening, trimming and removing them.

Entries are packed into segment files (``DIR/segments/ID.seg``) rather than kept one file
each. Creating a file costs far more than appending the same bytes to an open one: on the
benchmark machine a new inode cost 0.03-1.5 ms of kernel time, appending 50 KB 0.03 ms, and a
dataset of ten million samples would otherwise be ten million inodes. Each writing process
appends to a segment of its own until it reaches the segment size (``budget / 16``, at most
:data:`SEGMENT_MAX`), then starts a new one.

What lies in a segment, and up to where, is the index's to say: these helpers only touch the
files, and the tier calls them under its writers' lock (all but :func:`open_record`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .._iov import IOV_MAX, advance
from ..errors import IntegrityError

SEGMENTS = "segments"
"""The folder of the segment files, inside the tier's directory."""

SEGMENT_MAX = 64 << 20
"""Largest segment a writer fills before starting another: evicting one frees at most this
much, and a budget of 1 GiB holds 16 of them."""


def create(path: str) -> None:
    """Start the empty file of a new segment.

    Truncated if it exists: no row of the index names a new id yet, so whatever such a file
    holds is junk.
    """
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))


def remove(path: str) -> None:
    """Unlink a segment's file, if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def append(path: str, offset: int, buffers: list[bytes]) -> None:
    """Write ``buffers`` back to back into the segment at ``offset`` (its recorded end).

    As few ``pwritev`` calls as ``IOV_MAX`` allows: no joined copy of the payloads, no file
    object.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        views = [memoryview(b) for b in buffers]
        while views:
            done = os.pwritev(fd, views[:IOV_MAX], offset)
            offset += done
            advance(views, done)
    finally:
        os.close(fd)


def cut_back(path: str, end: int) -> None:
    """Give back what a failed batch appended to a segment past ``end``, its recorded end;
    a segment the batch started (``end`` 0: the index never knew it) is unlinked."""
    with contextlib.suppress(OSError):
        if end:
            os.truncate(path, end)
        else:
            os.unlink(path)


def open_record(path: str, offset: int, size: int, key: str) -> int | None:
    """An open descriptor on the segment holding a record, or None if the segment is gone
    (evicted since the lookup).

    Checked against the file before anything is allocated for it: a record past the end is
    damage, not a short read.

    Raises:
        IntegrityError: the record lies outside the segment (past its end, or at a
            negative offset or size: a damaged or crafted index).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        length = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise
    if offset < 0 or size < 0 or offset + size > length:
        os.close(fd)
        raise IntegrityError(
            f"cache entry for {key!r} lies outside its segment (bytes {offset}+{size} of {length})"
        )
    return fd


def listing(segment_dir: str) -> list[str] | None:
    """The names in the segments folder, or None if it is gone."""
    try:
        return os.listdir(segment_dir)
    except FileNotFoundError:
        return None


def segment_ids(names: list[str]) -> set[int]:
    """The ids of the segment files among ``names``."""
    return {int(n[:-4]) for n in names if n.endswith(".seg") and n[:-4].isdigit()}


def give_back(segment_dir: str, names: list[str], sizes: dict[int, int]) -> None:
    """Trim the files ``names`` of the segments folder to the index's ``sizes``: bytes past a
    segment's recorded end are truncated, files of no recorded segment unlinked.

    Only safe while no writer is mid-append: the caller holds the writers' lock.
    """
    for name in names:
        stem, dot, suffix = name.partition(".")
        path = f"{segment_dir}/{name}"
        segment = int(stem) if stem.isdigit() and dot and suffix == "seg" else None
        recorded = sizes.get(segment) if segment is not None else None
        try:
            if recorded is None:
                os.unlink(path)
            elif os.stat(path).st_size > recorded:
                os.truncate(path, recorded)
        except FileNotFoundError:
            pass


def remove_all(directory: Path, segment_dir: str) -> None:
    """Remove every segment file, and what format 2 left (one file per entry)."""
    for path in directory.iterdir():
        # Format 2's entry shards ("ab/") and temp files ("tmp/").
        if path.is_dir() and (len(path.name) == 2 or path.name == "tmp"):
            shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(segment_dir):
        remove(f"{segment_dir}/{name}")
