"""What a disk tier's directory holds, read from its index without opening the tier; and
clearing it through the tier's own locked removal (for ``asyncstore cache``).

The tier records no budget on disk (each process passes its own ``disk_bytes``), nor its
hit and miss counters (they live in each process's :class:`CacheStats`): what the directory
tells is its entries, segments, their bytes and when they were last read.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import msgspec

from ..errors import IntegrityError, NotFound, StoreError
from . import _index, _segments
from ._disk import DiskTier

__all__ = ["DiskUsage", "clear_disk", "disk_usage"]

_INDEX = "index.sqlite"


class DiskUsage(msgspec.Struct, frozen=True):
    """A disk tier's directory, as its index describes it.

    Attributes:
        directory: the tier's directory.
        entries: entries the index holds.
        entry_bytes: their records' bytes (payload plus header).
        segments: segment files the index records.
        segment_bytes: bytes recorded in them (replaced entries' bytes included, until
            their segment is evicted).
        index_bytes: the index's files (database, write-ahead log, shared memory).
        used_bytes: ``segment_bytes + index_bytes``, what counts against a budget.
        file_bytes: bytes of the files in ``segments/`` (what killed writers left
            included, until the next writer gives it back).
        budget: the byte budget, when recorded (this release records none: each process
            passes its own ``disk_bytes``).
        oldest_read, newest_read: the least and most recent last read of a segment (Unix
            seconds; ``None`` when there is none). Eviction starts with the oldest.
        index_version: the index's layout; one of another version is emptied by the next
            process that opens the tier.
    """

    directory: str
    entries: int
    entry_bytes: int
    segments: int
    segment_bytes: int
    index_bytes: int
    used_bytes: int
    file_bytes: int
    budget: int | None
    oldest_read: float | None
    newest_read: float | None
    index_version: int


def _index_of(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory).absolute() / _INDEX  # a URI needs an absolute path
    if not path.is_file():
        raise NotFound(f"{os.fspath(directory)} does not exist or holds no disk cache ({_INDEX})")
    return path


def disk_usage(directory: str | os.PathLike[str]) -> DiskUsage:
    """Describe the disk tier in ``directory`` (blocks; reads the index only, never writes).

    Raises:
        NotFound: ``directory`` holds no disk tier.
        IntegrityError: its index cannot be read.
    """
    path = _index_of(directory)
    try:
        db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as exc:
        raise IntegrityError(f"the cache index {path} cannot be opened ({exc})") from None
    try:
        (version,) = db.execute("PRAGMA user_version").fetchone()
        if version != _index.INDEX_VERSION:
            entries = entry_bytes = segments = segment_bytes = 0
            oldest = newest = None
        else:
            entries, entry_bytes = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries"
            ).fetchone()
            segments, segment_bytes, oldest, newest = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0), MIN(atime), MAX(atime) FROM segments"
            ).fetchone()
    except sqlite3.Error as exc:
        raise IntegrityError(f"the cache index {path} cannot be read ({exc})") from None
    finally:
        db.close()
    segment_dir = path.parent / _segments.SEGMENTS
    file_bytes = 0
    for name in _segments.listing(str(segment_dir)) or []:
        with contextlib.suppress(OSError):
            file_bytes += (segment_dir / name).stat().st_size
    index_bytes = _index.file_bytes(path)
    return DiskUsage(
        directory=str(path.parent),
        entries=int(entries),
        entry_bytes=int(entry_bytes),
        segments=int(segments),
        segment_bytes=int(segment_bytes),
        index_bytes=index_bytes,
        used_bytes=int(segment_bytes) + index_bytes,
        file_bytes=file_bytes,
        budget=None,
        oldest_read=oldest,
        newest_read=newest,
        index_version=int(version),
    )


# clear_disk opens the tier with this budget: removal never looks at it.
_ANY_BUDGET = 1 << 40


def clear_disk(directory: str | os.PathLike[str]) -> int:
    """Remove every entry of the disk tier in ``directory``, as :meth:`DiskTier.clear` does
    (under the writers' lock, in one transaction: processes using the tier meanwhile see
    misses, never a torn entry); returns how many entries there were. Blocks.

    Raises:
        NotFound: ``directory`` holds no disk tier.
        StoreError: the index stayed locked, or the directory cannot be written.
    """
    path = _index_of(directory)
    try:
        tier = DiskTier(directory, _ANY_BUDGET, identity="asyncstore-cli")
        try:
            count = tier.entry_count()
            tier.clear()
            tier.reclaim_dead_writers()
            return count
        finally:
            tier.close()
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(f"the disk cache in {path.parent} cannot be cleared ({exc})") from None
