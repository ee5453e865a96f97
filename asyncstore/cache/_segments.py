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
from ._record import payload_start

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
    found = open_segment(path, offset, size, key)
    return None if found is None else found[0]


def open_segment(path: str, offset: int, size: int, key: str) -> tuple[int, int] | None:
    """:func:`open_record`, with the segment's length."""
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
    return fd, length


class SegmentReader:
    """Reads of records from the page cache, for one thread (the event loop's): the
    descriptors of the last segments read are kept open, and one buffer is reused.

    An open, fstat and close per read cost more than the read of a small record itself.
    A descriptor kept open stays valid for its segment: a committed segment id is never
    given again, and a file unlinked since (its segment evicted) still reads the bytes the
    index named. Only a directory whose index was made anew (another format) gives ids
    again: a record read through a descriptor kept from before then fails its checks, and
    :meth:`forget` lets the caller read it once more through a fresh one.
    """

    KEEP = 32
    """Descriptors kept open at most."""

    SWEEP = 256
    """Reads between two looks for kept segments deleted since (evicted): an open
    descriptor keeps a deleted file's space taken, which the tier's budget does not see, so
    none is kept for more than this many reads after its file is gone."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[int, int]] = {}  # segment -> (fd, its length), oldest first
        self._buffer = bytearray()
        self._reads = 0

    def read(
        self, path: str, segment: int, offset: int, size: int, key: str, flags: int
    ) -> memoryview | None:
        """The record's bytes (valid until the next call), or None if the segment is gone.

        Raises:
            IntegrityError: the record lies outside the segment.
            BlockingIOError: not all of it is in the page cache (``flags``: ``RWF_NOWAIT``).
            OSError: the read failed.
        """
        fd = self._descriptor(path, segment, offset, size, key)
        if fd is None:
            return None
        if len(self._buffer) < size:
            self._buffer = bytearray(size)  # a new one: a view of the old may still be out
        view = memoryview(self._buffer)[:size]
        if os.preadv(fd, [view], offset, flags) != size:
            raise BlockingIOError("only part of the record is in the page cache")
        return view

    def read_parts(
        self, path: str, segment: int, offset: int, size: int, key: str, head: int, flags: int
    ) -> tuple[memoryview, bytes | None] | None:
        """:meth:`read` in two parts: the record's first ``head`` bytes (valid until the next
        call), read with ``flags``, and the rest, read straight into the bytes object it
        comes in (no copy of it afterwards); the rest is None, and not read, when the
        record's header puts its payload elsewhere than after ``head`` bytes. Only the first
        part's read heeds ``flags``: with ``RWF_NOWAIT``, a record whose first bytes are in
        the page cache and the rest not waits for the disk, as a plain read would.

        Raises:
            IntegrityError: the record lies outside the segment, or its file ends before it.
            BlockingIOError: not all of the first part is in the page cache.
            OSError: a read failed.
        """
        fd = self._descriptor(path, segment, offset, size, key)
        if fd is None:
            return None
        if len(self._buffer) < head:
            self._buffer = bytearray(head)
        view = memoryview(self._buffer)[:head]
        if os.preadv(fd, [view], offset, flags) != head:
            raise BlockingIOError("only part of the record is in the page cache")
        if payload_start(view) != head:
            return view, None
        rest = os.pread(fd, size - head, offset + head)
        if len(rest) != size - head:
            raise IntegrityError(f"cache entry for {key!r} runs past the end of its segment")
        return view, rest

    def _descriptor(self, path: str, segment: int, offset: int, size: int, key: str) -> int | None:
        # An open descriptor on the segment holding the record (kept, or opened and kept),
        # or None if the segment is gone.
        self._reads += 1
        if self._reads % self.SWEEP == 0:
            self._sweep()
        kept = self._open.pop(segment, None)
        if kept is not None and offset + size > kept[1]:
            os.close(kept[0])  # appended to since: look again
            kept = None
        if kept is None:
            kept = open_segment(path, offset, size, key)
            if kept is None:
                return None
        self._open[segment] = kept  # the most recent last
        if len(self._open) > self.KEEP:
            os.close(self._open.pop(next(iter(self._open)))[0])
        return kept[0]

    def _sweep(self) -> None:
        # Close the descriptors of segments whose files are gone.
        for segment, (fd, _) in list(self._open.items()):
            try:
                gone = os.fstat(fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                del self._open[segment]
                os.close(fd)

    def forget(self) -> None:
        """Close every descriptor kept."""
        kept, self._open = self._open, {}
        for fd, _ in kept.values():
            os.close(fd)


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
