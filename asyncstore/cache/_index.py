"""The disk tier's SQLite index (``DIR/index.sqlite``): its tables, its settings, the size of
its files, the bound on its write-ahead log, and the writers' lock (``DIR/index.lock``).

Two tables: ``entries`` (name → segment, offset, size) and ``segments`` (id → recorded
bytes, last access, owning writer), and a count of removed entries (``removals``, kept by
a trigger). The tier opens and locks it; the transactions that change it are the tier's
(see :mod:`asyncstore.cache._disk`).

An entry's row never changes once committed: entries are inserted and deleted, never
updated (a replaced entry is deleted, then inserted anew), and a recorded byte is never
rewritten. A row a reader found therefore stays true for as long as no entry was removed,
which :func:`removals` tells in one cheap query: readers keep the rows they found while
it stays the same.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import time
from pathlib import Path

from .._flock import try_lock
from ..errors import IntegrityError

INDEX_VERSION = 3
"""The index's layout (``PRAGMA user_version``). 3: entries packed in segment files. An index
of another layout (format 2 kept one file per entry) is emptied and set up anew on open: the
cache refills itself."""

# How long a commit waits for readers to truncate an oversized write-ahead log: readers
# hold it for one query, so this is ample; when it is not, the next commit tries again.
_CHECKPOINT_WAIT_MS = 200


def configure(db: sqlite3.Connection, wal_reserve: int) -> int:
    """Set the writing connection up; returns the layout version the index holds."""
    # WAL lets readers and one writer proceed together; NORMAL sync is enough for a cache
    # (a lost index update after power loss only forgets or over-counts an entry, and the
    # checksum protects every read).
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(f"PRAGMA journal_size_limit={wal_reserve}")
    # Checkpoint before the log outgrows that reserve (SQLite's default waits for 4 MB).
    db.execute(f"PRAGMA wal_autocheckpoint={max(16, wal_reserve // 4096)}")
    (version,) = db.execute("PRAGMA user_version").fetchone()
    return int(version)


def create_tables(db: sqlite3.Connection) -> None:
    """Replace whatever tables the index holds by empty ones of :data:`INDEX_VERSION`
    (inside the caller's transaction)."""
    for table in ("entries", "segments", "total", "removals"):
        db.execute(f"DROP TABLE IF EXISTS {table}")  # names from the line above
    db.execute(
        "CREATE TABLE entries (name TEXT PRIMARY KEY, segment INTEGER NOT NULL, "
        "offset INTEGER NOT NULL, size INTEGER NOT NULL) WITHOUT ROWID"
    )
    db.execute("CREATE INDEX entries_segment ON entries(segment)")
    # AUTOINCREMENT: an id is never given twice, so a row never points into a file that a
    # later segment of the same name replaced.
    db.execute(
        "CREATE TABLE segments (id INTEGER PRIMARY KEY AUTOINCREMENT, "
        "bytes INTEGER NOT NULL, atime REAL NOT NULL, owner TEXT NOT NULL)"
    )
    db.execute("CREATE INDEX segments_atime ON segments(atime)")
    create_removals(db)
    db.execute(f"PRAGMA user_version={INDEX_VERSION}")


def has_removals(db: sqlite3.Connection) -> bool:
    """Whether the index counts removed entries (indexes made before the count do not)."""
    found = db.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE name IN ('removals', 'entries_removed')"
    ).fetchone()
    return bool(found[0] == 2)


def create_removals(db: sqlite3.Connection) -> None:
    """Count every entry removed from now on (inside the caller's transaction).

    A trigger counts them, so that every writer counts, whatever deletes (eviction,
    replacement, removal, clearing) and whichever release of this library it runs: one
    that knows nothing of the count still fires the trigger the index holds. The token,
    drawn anew with the table, tells an index made anew from the one a reader knew, whose
    count may have been the same.
    """
    db.execute("DROP TRIGGER IF EXISTS entries_removed")
    db.execute("DROP TABLE IF EXISTS removals")
    db.execute("CREATE TABLE removals (token INTEGER NOT NULL, count INTEGER NOT NULL)")
    db.execute("INSERT INTO removals VALUES (?, 0)", (secrets.randbits(62),))
    db.execute(_COUNT_REMOVALS)


_COUNT_REMOVALS = (
    "CREATE TRIGGER entries_removed AFTER DELETE ON entries "
    "BEGIN UPDATE removals SET count = count + 1; END"
)


def remove_all(db: sqlite3.Connection) -> None:
    """Delete every entry, counted as one removal (inside the caller's transaction).

    With a trigger on the table, SQLite deletes its rows one by one instead of dropping
    them at once: measured, 1.9 s instead of 0.38 s for a million entries, with every
    process's writers waiting. So the trigger is set aside for the statement; the
    transaction makes it one change to every other connection.
    """
    counted = has_removals(db)
    if counted:
        db.execute("DROP TRIGGER entries_removed")
    db.execute("DELETE FROM entries")
    if counted:
        db.execute("UPDATE removals SET count = count + 1")
        db.execute(_COUNT_REMOVALS)


def removals(db: sqlite3.Connection) -> tuple[int, int] | None:
    """The index's token and count of removed entries; None if it keeps none (damaged)."""
    rows = db.execute("SELECT token, count FROM removals").fetchall()
    return (rows[0][0], rows[0][1]) if len(rows) == 1 else None


def forget(db: sqlite3.Connection, segments: list[int]) -> int:
    """Delete the rows of ``segments`` and of their entries; returns how many entries."""
    entries = 0
    for segment in segments:
        cursor = db.execute("DELETE FROM entries WHERE segment = ?", (segment,))
        entries += max(0, cursor.rowcount)
        db.execute("DELETE FROM segments WHERE id = ?", (segment,))
    return entries


def file_bytes(db_path: Path) -> int:
    """Bytes in the index's files: the database, its write-ahead log and shared memory."""
    size = 0
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            size += os.stat(f"{db_path}{suffix}").st_size
    return size


def bound_log(db: sqlite3.Connection, db_path: Path, reserve: int, busy_timeout_ms: int) -> None:
    """Keep the write-ahead log within ``reserve`` bytes; the caller holds the writers' lock.

    ``busy_timeout_ms`` is the connection's usual wait for a lock, restored after the short
    wait here.

    SQLite's automatic checkpoint is passive: while other processes keep reading, it never
    finishes, the log is never restarted and it grows without bound (measured: 0.5 MB over a
    600 KiB budget with six processes), shrinking the room left for entries to nothing. Past
    the reserve, wait briefly for the readers and truncate it.
    """
    try:
        size = os.stat(f"{db_path}-wal").st_size
    except FileNotFoundError:
        return
    if size <= reserve:
        return
    db.execute(f"PRAGMA busy_timeout={_CHECKPOINT_WAIT_MS}")
    try:
        # Busy is not an error here: another writer holds the log; the next commit retries.
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        db.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")


def lock_writers(fd: int, root: str, timeout_ms: int) -> None:
    """Take the lock that every process's writers share (the open ``index.lock`` of the tier
    in ``root``), or raise :class:`sqlite3.OperationalError` after ``timeout_ms``.

    Writers take it before SQLite's own lock, so that the log can be truncated with no
    writer between two commits (see :func:`bound_log`), and so that whoever holds it knows
    no other process is appending. It is polled at most every 5 ms (SQLite polls its lock
    with sleeps of up to 100 ms). A killed holder's lock is released by the kernel; a
    stopped one makes the others fail after the timeout, as SQLite's lock would, which turns
    the tier off rather than hanging the job. ``fd`` is -1 in a forked child (the parent's
    lock is not the child's to take) and once the tier is closed.
    """
    if fd < 0:
        raise sqlite3.OperationalError(
            f"the disk cache at {root} was opened before this process forked, or "
            "was closed; open it again here"
        )
    deadline = time.monotonic() + timeout_ms / 1000
    pause = 0.0001
    while not try_lock(fd):
        if time.monotonic() > deadline:
            raise sqlite3.OperationalError(
                f"the cache index in {root} stayed locked by another process "
                f"for {timeout_ms // 1000} s"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


Row = tuple[int, int, int]
"""Where an entry lies: its segment, offset and size."""

_FIND = "SELECT segment, offset, size FROM entries WHERE name = ?"


def find(db: sqlite3.Connection, name: str, least: int, most: int) -> Row | None:
    """The row of entry ``name``, or None. A record is ``least`` to ``most`` bytes.

    Raises:
        IntegrityError: the row cannot describe a record (a damaged or crafted index).
    """
    # fetchall, not fetchone: an unfinished statement would keep its read transaction
    # open and stop the write-ahead log from being truncated.
    rows = db.execute(_FIND, (name,)).fetchall()
    if not rows:
        return None
    segment, offset, size = rows[0]
    return _checked(name, segment, offset, size, least, most)


def find_many(db: sqlite3.Connection, names: list[str], least: int, most: int) -> dict[str, Row]:
    """The rows of the entries among ``names`` that exist, in one query (``names`` at most
    SQLite's bound on a statement's parameters, 32,766).

    Raises:
        IntegrityError: a row cannot describe a record.
    """
    marks = ",".join("?" * len(names))
    query = f"SELECT name, segment, offset, size FROM entries WHERE name IN ({marks})"
    rows = db.execute(query, names).fetchall()
    return {name: _checked(name, seg, at, size, least, most) for name, seg, at, size in rows}


def _checked(
    name: str, segment: object, offset: object, size: object, least: int, most: int
) -> Row:
    if not (
        type(segment) is int
        and type(offset) is int
        and type(size) is int
        and segment > 0
        and offset >= 0
        and least <= size <= most
    ):
        raise IntegrityError(
            f"cache index row for {name} is damaged (segment {segment!r}, offset "
            f"{offset!r}, size {size!r})"
        )
    return segment, offset, size
