"""The disk tier: one directory shared by every process of a node, under one byte budget.

Layout::

    DIR/index.sqlite        the shared index: one row per entry (name, size, last access)
    DIR/ab/abcdef….entry    entries, sharded by the first byte of their name
    DIR/ab/.tmp-PID-RAND    an entry being written (invisible until renamed)

An entry's name is the xxh3-128 of its cache key. Its file holds a header (magic, format
version, payload length, xxh3-64 of the payload, the key and the source's ETag) and the
payload. Readers check all of it, so a torn, truncated, foreign or bit-flipped file is never
served: it is dropped and counted, and the caller refetches.

Why SQLite for the index: several processes insert and evict at once, and the budget is one
number for all of them. A transaction (``BEGIN IMMEDIATE``) makes "account for the new entry,
pick victims oldest-first, delete their rows" atomic across processes; the files themselves
are published by ``rename`` and removed after the commit. Hits do not touch the index on the
read path: last-access times are batched and written with the next insert or when
``TOUCH_BATCH`` are pending.

Every method here blocks; the cache calls them in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import sqlite3
import struct
import threading
import time
from pathlib import Path

import xxhash

from ..errors import IntegrityError

_MAGIC = b"ASCE"
_VERSION = 1
# magic, version, payload length, payload xxh3-64, key length, etag length
_HEADER = struct.Struct("<4sHQQHH")
TOUCH_BATCH = 256
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class WouldBlock:
    """The type of :data:`WOULD_BLOCK`."""


WOULD_BLOCK = WouldBlock()
"""Returned by :meth:`DiskTier.read_cached` when serving the entry would wait for the disk."""
_STALE_TMP_SECONDS = 3600.0


class DiskTier:
    """A cache directory with a hard byte budget, safe to share between processes."""

    def __init__(self, directory: str | os.PathLike[str], budget: int) -> None:
        self.directory = Path(directory)
        self.budget = budget
        self._lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self.evictions = 0
        self._nowait = bool(_RWF_NOWAIT) and hasattr(os, "preadv")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._root = str(self.directory)
        self._shards: set[str] = set()  # shard directories known to exist
        self._pid = os.getpid()
        self._db_path = self.directory / "index.sqlite"
        self._db = sqlite3.connect(
            self._db_path, timeout=60.0, isolation_level=None, check_same_thread=False
        )
        # WAL lets readers and one writer proceed together; NORMAL sync is enough for a cache
        # (a lost index update after power loss only forgets or over-counts an entry, and the
        # checksum protects every read).
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS entries (
                name TEXT PRIMARY KEY, size INTEGER NOT NULL, atime REAL NOT NULL);
            CREATE INDEX IF NOT EXISTS entries_atime ON entries(atime);
            CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY CHECK (id = 0),
                bytes INTEGER NOT NULL);
            INSERT OR IGNORE INTO total VALUES (0, 0);
            """
        )
        self.clean_leftovers()

    # -- names and files ---------------------------------------------------------------------

    @staticmethod
    def name_for(key: str) -> str:
        """The entry name of a cache key."""
        return xxhash.xxh3_128_hexdigest(key.encode())

    def path_for(self, name: str) -> str:
        """Where the entry ``name`` lives."""
        # Plain strings: this runs for every read and write, and pathlib costs microseconds.
        return f"{self._root}/{name[:2]}/{name}.entry"

    # -- read --------------------------------------------------------------------------------

    def read(self, key: str) -> tuple[bytes, str | None] | None:
        """The payload and ETag stored for ``key``, or ``None`` if there is no entry.

        Raises:
            IntegrityError: the entry exists but is damaged; it has been removed.
            OSError: the directory cannot be read.
        """
        name = self.name_for(key)
        try:
            with open(self.path_for(name), "rb", buffering=0) as f:
                raw = f.readall()
        except FileNotFoundError:
            return None
        try:
            return self._accept(name, raw, key)
        except IntegrityError:
            self._remove(name)
            raise

    def read_cached(self, key: str) -> tuple[bytes, str | None] | WouldBlock | None:
        """Like :meth:`read`, but only from the page cache, never waiting for the disk.

        Safe to call on the event loop: it returns :data:`WOULD_BLOCK` instead of waiting
        for a read (Linux ``preadv2(RWF_NOWAIT)``), so the caller can retry in a thread.
        Opening the file is done inline: a cached directory entry makes that microseconds.
        A damaged entry raises :class:`IntegrityError` without being removed (removal
        writes the index): call :meth:`remove` from a thread.
        """
        if not self._nowait:
            return WOULD_BLOCK
        name = self.name_for(key)
        try:
            fd = os.open(self.path_for(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            buffer = bytearray(size)
            try:
                got = os.preadv(fd, [buffer], 0, _RWF_NOWAIT)
            except BlockingIOError:
                return WOULD_BLOCK
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    self._nowait = False  # this file system or kernel cannot: use threads
                    return WOULD_BLOCK
                raise
        finally:
            os.close(fd)
        if got != size:
            return WOULD_BLOCK  # only part of it is in the page cache
        return self._accept(name, buffer, key)

    def _accept(self, name: str, raw: bytes | bytearray, key: str) -> tuple[bytes, str | None]:
        payload, etag = _decode(raw, key)
        with self._lock:
            self._touched[name] = time.time()
        return payload, etag

    @property
    def touches_pending(self) -> int:
        """Access times waiting to be written to the index (see :meth:`flush_touches`)."""
        return len(self._touched)

    # -- write -------------------------------------------------------------------------------

    def write(self, key: str, payload: bytes, etag: str | None) -> bool:
        """Store ``payload`` for ``key``, evicting least recently used entries as needed.

        Returns False when the entry cannot fit the budget at all.
        """
        return self.write_many([(key, payload, etag)])[0]

    def write_many(self, items: list[tuple[str, bytes, str | None]]) -> list[bool]:
        """Store several entries with one index transaction; one result per item.

        Batching matters: the transaction and the thread hop that carries this call cost
        more than writing a small entry's file.
        """
        staged: list[tuple[str, str, str, int] | None] = []
        results = [False] * len(items)
        try:
            for key, payload, etag in items:
                name = self.name_for(key)
                data = _encode(key, payload, etag)
                if len(data) > self.budget:
                    staged.append(None)
                    continue
                final = self.path_for(name)
                shard = name[:2]
                if shard not in self._shards:
                    os.makedirs(f"{self._root}/{shard}", exist_ok=True)
                    self._shards.add(shard)
                tmp = f"{self._root}/{shard}/.tmp-{self._pid}-{secrets.token_hex(6)}"
                staged.append((name, tmp, final, len(data)))
                with open(tmp, "xb", buffering=0) as f:
                    view = memoryview(data)
                    while view:
                        view = view[f.write(view) :]
            self.flush_touches()
            wanted = [(s[0], s[3]) for s in staged if s is not None]
            admitted, victims = self._admit(wanted)
            index = 0
            for position, stage in enumerate(staged):
                if stage is None:
                    continue
                if admitted[index]:
                    os.rename(stage[1], stage[2])
                    results[position] = True
                index += 1
        finally:
            for stage in staged:
                if stage is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(stage[1])
        for victim in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path_for(victim))
        return results

    def _admit(self, wanted: list[tuple[str, int]]) -> tuple[list[bool], list[str]]:
        """Account for entries in the index, oldest entries evicted to make room.

        One transaction for the batch; returns which entries fit and the evicted names.
        """
        admitted: list[bool] = []
        victims: list[str] = []
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                # The index file counts against the budget too.
                limit = self.budget - self._db_bytes()
                (total,) = db.execute("SELECT bytes FROM total").fetchone()
                for name, size in wanted:
                    old = db.execute("SELECT size FROM entries WHERE name = ?", (name,)).fetchone()
                    total -= old[0] if old else 0
                    if old:
                        db.execute("DELETE FROM entries WHERE name = ?", (name,))
                    if size > limit:
                        admitted.append(False)
                        continue
                    if total + size > limit:
                        # Lazily, oldest first: only as many rows as needed are read.
                        rows = db.execute("SELECT name, size FROM entries ORDER BY atime")
                        chosen = []
                        for victim, victim_size in rows:
                            chosen.append(victim)
                            total -= victim_size
                            if total + size <= limit:
                                break
                        db.executemany("DELETE FROM entries WHERE name = ?", [(v,) for v in chosen])
                        victims += chosen
                    db.execute("INSERT INTO entries VALUES (?, ?, ?)", (name, size, time.time()))
                    total += size
                    admitted.append(True)
                db.execute("UPDATE total SET bytes = ?", (total,))
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            self.evictions += len(victims)
        # An entry admitted early in the batch may have been evicted by a later one: it
        # must not be published, and its older file (if any) goes with the victims.
        gone = set(victims)
        fits = [ok and name not in gone for ok, (name, _) in zip(admitted, wanted, strict=True)]
        return fits, victims

    # -- remove ------------------------------------------------------------------------------

    def remove(self, key: str) -> None:
        """Drop the entry for ``key`` if there is one."""
        self._remove(self.name_for(key))

    def _remove(self, name: str) -> None:
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT size FROM entries WHERE name = ?", (name,)).fetchone()
                if row:
                    db.execute("DELETE FROM entries WHERE name = ?", (name,))
                    db.execute("UPDATE total SET bytes = bytes - ?", (row[0],))
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            self._touched.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(name))

    def clear(self) -> None:
        """Remove every entry (of every process)."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                names = [row[0] for row in db.execute("SELECT name FROM entries")]
                db.execute("DELETE FROM entries")
                db.execute("UPDATE total SET bytes = 0")
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            self._touched.clear()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path_for(name))

    # -- bookkeeping -------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes the tier accounts for: entries plus its index."""
        with self._lock:
            (total,) = self._db.execute("SELECT bytes FROM total").fetchone()
            return int(total) + self._db_bytes()

    def entry_count(self) -> int:
        """How many entries the index holds."""
        with self._lock:
            (count,) = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()
            return int(count)

    def _db_bytes(self) -> int:
        size = 0
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                size += os.stat(f"{self._db_path}{suffix}").st_size
        return size

    def flush_touches(self) -> None:
        """Write batched access times to the index (blocks)."""
        with self._lock:
            touched, self._touched = self._touched, {}
            if not touched:
                return
            # One transaction for the batch: in autocommit each UPDATE would be its own
            # commit, a WAL append apiece, with the lock that every reader needs held.
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "UPDATE entries SET atime = ? WHERE name = ?",
                    [(atime, name) for name, atime in touched.items()],
                )
                self._db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise

    def clean_leftovers(self) -> None:
        """Remove what crashed writers left: temp files of dead processes (or very old ones),
        and entry files the index does not know (their bytes would escape the budget)."""
        now = time.time()
        with self._lock:
            known = {row[0] for row in self._db.execute("SELECT name FROM entries")}
        for shard in self.directory.iterdir():
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for path in shard.iterdir():
                name = path.name
                if name.startswith(".tmp-"):
                    pid = name.split("-")[1]
                    alive = pid.isdigit() and _alive(int(pid))
                    stale = now - _mtime(path) > _STALE_TMP_SECONDS
                    if not alive or stale:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                elif (
                    name.endswith(".entry")
                    and name[: -len(".entry")] not in known
                    and now - _mtime(path) > 60.0
                ):
                    # Evicted by another process while being renamed into place: bytes the
                    # budget no longer counts. (Young ones may be mid-publish: left alone.)
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()

    def close(self) -> None:
        """Write pending access times and close the index."""
        with contextlib.suppress(sqlite3.Error):
            self.flush_touches()
        self._db.close()


def _encode(key: str, payload: bytes, etag: str | None) -> bytes:
    key_bytes = key.encode()
    etag_bytes = (etag or "").encode()
    header = _HEADER.pack(
        _MAGIC,
        _VERSION,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        len(key_bytes),
        len(etag_bytes),
    )
    return b"".join((header, key_bytes, etag_bytes, payload))


def _decode(raw: bytes | bytearray, key: str) -> tuple[bytes, str | None]:
    if len(raw) < _HEADER.size:
        raise IntegrityError(f"cache entry for {key!r} is truncated ({len(raw)} bytes)")
    magic, version, length, digest, key_len, etag_len = _HEADER.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        raise IntegrityError(f"cache entry for {key!r} has an unknown format")
    start = _HEADER.size + key_len + etag_len
    if len(raw) != start + length:
        raise IntegrityError(
            f"cache entry for {key!r} holds {len(raw) - start} payload bytes, expected {length}"
        )
    if raw[_HEADER.size : _HEADER.size + key_len] != key.encode():
        raise IntegrityError(f"cache entry for {key!r} belongs to another key")
    view = memoryview(raw)[start:]
    if xxhash.xxh3_64_intdigest(view) != digest:
        raise IntegrityError(f"cache entry for {key!r} does not match its checksum")
    etag = bytes(raw[_HEADER.size + key_len : start]).decode() or None
    return bytes(view), etag


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
