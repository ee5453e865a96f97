"""The disk tier: one directory shared by every process of a node, under one byte budget.

Layout::

    DIR/index.sqlite        the shared index: one row per entry (name, size, last access)
    DIR/ab/abcdef….entry    entries, sharded by the first byte of their name
    DIR/tmp/PID-RAND        an entry being written (invisible until renamed into its shard)

An entry's name is the xxh3-128 of its source (the store's :attr:`~asyncstore.Store.identity`)
and its cache key: stores sharing a directory never share names. Its file holds a header
(magic, format version, an xxh3-64 checksum, the lengths) followed by the source, the key,
the source's ETag and the payload; the checksum covers everything after itself. Readers check
all of it, so a torn, truncated, foreign, older-format or bit-flipped file is never served:
it is dropped and counted, and the caller refetches.

Temp files live in one directory, named by their writer's pid, so finding those of killed
writers costs one small listing: writers do it as they go (at most every
``RECLAIM_INTERVAL`` seconds), not only when a process opens the directory, and the bytes
a killed writer left stop escaping the budget while the survivors run.

Why SQLite for the index: several processes insert and evict at once, and the budget is one
number for all of them. A transaction (``BEGIN IMMEDIATE``) makes "account for the new entry,
pick victims oldest-first, delete their rows" atomic across processes, and files are renamed
into place and unlinked inside that transaction, under SQLite's write lock, so the index and
the files change together. Hits do not touch the index on the read path: last-access times
are batched and written with the next insert or when ``TOUCH_BATCH`` are pending.

Every method here blocks, except :meth:`DiskTier.read_cached`, which is safe on an event
loop; the cache calls the others in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import secrets
import sqlite3
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash

from .._flock import try_lock
from ..errors import IntegrityError

_MAGIC = b"ASCE"
# 2: the source's identity in the name and the header, and the checksum over the whole
# header. Entries of version 1 fail the version check: dropped as damaged, then refetched.
_VERSION = 2
# magic, version, xxh3-64 of everything after it; then payload, source, key and ETag lengths
_HEADER = struct.Struct("<4sHQQIII")
_CHECKED_FROM = struct.calcsize("<4sHQ")  # where the checksummed part begins
TOUCH_BATCH = 256
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class WouldBlock:
    """The type of :data:`WOULD_BLOCK`."""


WOULD_BLOCK = WouldBlock()
"""Returned by :meth:`DiskTier.read_cached` when serving the entry would wait for the disk."""
_STALE_TMP_SECONDS = 3600.0
_TMP = "tmp"

RECLAIM_INTERVAL = 1.0
# Index lock waits: other processes hold it only for one batch's transaction.
_BUSY_TIMEOUT_MS = 60_000
# How long a commit waits for readers to truncate an oversized write-ahead log: readers
# hold it for one query, so this is ample; when it is not, the next commit tries again.
_CHECKPOINT_WAIT_MS = 200
"""Seconds between two looks, by one writing process, for temp files of dead writers: a
listing of the temp directory (a few names per live writer) and a liveness check per pid."""


class DiskTier:
    """A cache directory with a hard byte budget, safe to share between processes."""

    def __init__(self, directory: str | os.PathLike[str], budget: int, identity: str) -> None:
        """Open (or create) the tier in ``directory``.

        ``identity`` is the source's :attr:`~asyncstore.Store.identity`: entries are named
        and checked by it plus their key, so sources sharing the directory stay apart.
        """
        self.directory = Path(directory)
        self.budget = budget
        self.identity = identity
        self._identity_bytes = identity.encode()
        # Length first: no (identity, key) pair can be spelled by another pair.
        self._name_prefix = f"{len(self._identity_bytes)}:{identity}\x00"
        # Two locks: _db_lock serialises this process's use of the SQLite connection (and may
        # be held while SQLite waits for another process); _touch_lock only guards the batch
        # of access times, so the inline read path on the event loop never waits on SQLite.
        self._db_lock = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self.evictions = 0
        self._nowait = bool(_RWF_NOWAIT) and hasattr(os, "preadv")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._root = str(self.directory)
        self._shards: set[str] = set()  # shard directories known to exist
        self._tmp_dir = f"{self._root}/{_TMP}"
        os.makedirs(self._tmp_dir, exist_ok=True)
        self._next_reclaim = 0.0
        # Temp file names: "<pid>-<tag><serial>", the tag told apart from an earlier process
        # of the same pid.
        self._tmp_tag = secrets.token_hex(4)
        self._tmp_serial = itertools.count()
        self._db_path = self.directory / "index.sqlite"
        # Empty: only its lock matters (see _transaction).
        self._lock_fd = os.open(
            f"{self._root}/index.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        # Keep the write-ahead log small and bounded: it counts against the budget.
        self._wal_reserve = min(4 << 20, budget // 8)
        try:
            self._db = sqlite3.connect(
                self._db_path,
                timeout=_BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,
                check_same_thread=False,
            )
        except BaseException:
            os.close(self._lock_fd)
            raise
        try:
            # Under the writers' lock: switching a new index to WAL fails at once ("database
            # is locked", no busy wait) while another process is opening it too, which
            # switched the tier off in one of two DataLoader workers started together.
            with self._writers_locked():
                self._set_up()
        except BaseException:
            self._db.close()
            os.close(self._lock_fd)
            raise
        _OPEN_TIERS.add(self)
        self.clean_leftovers()

    def _set_up(self) -> None:
        db = self._db
        # WAL lets readers and one writer proceed together; NORMAL sync is enough for a cache
        # (a lost index update after power loss only forgets or over-counts an entry, and the
        # checksum protects every read).
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA journal_size_limit={self._wal_reserve}")
        # Checkpoint before the log outgrows that reserve (SQLite's default waits for 4 MB).
        db.execute(f"PRAGMA wal_autocheckpoint={max(16, self._wal_reserve // 4096)}")
        db.executescript(
            """
            CREATE TABLE IF NOT EXISTS entries (
                name TEXT PRIMARY KEY, size INTEGER NOT NULL, atime REAL NOT NULL);
            CREATE INDEX IF NOT EXISTS entries_atime ON entries(atime);
            CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY CHECK (id = 0),
                bytes INTEGER NOT NULL);
            INSERT OR IGNORE INTO total VALUES (0, 0);
            """
        )

    # -- names and files ---------------------------------------------------------------------

    def name_for(self, key: str) -> str:
        """The entry name of a cache key of this tier's source.

        A block of an object (cache key ``"key\\x00index"``) is named after the object's
        hash plus ``-index``: all blocks of one object then sort together in the index (and
        share its shard), so :meth:`remove` finds them without a scan.
        """
        base, sep, index = key.partition("\x00")
        digest = xxhash.xxh3_128_hexdigest((self._name_prefix + base).encode())
        return f"{digest}-{index}" if sep else digest

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
        payload, etag = _decode(raw, self._identity_bytes, key)
        with self._touch_lock:
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

        Room is made before bytes are written: inside the transaction, which holds SQLite's
        write lock across processes, each entry evicts what it needs before its temp file is
        written, so the directory never holds more than the budget however many writers
        burst at once. The temp files are renamed into place once the transaction commits,
        still under the writers' lock: no other process can evict, remove or re-admit an
        entry between its row changing and its file changing, and a writer killed on the
        way leaves temp files (named after its pid, reclaimed by the survivors) or rows
        without files (misses, evicted in time), never entries the index does not count.
        Writers of other processes wait for the lock meanwhile: the writes go to the page
        cache (no fsync), so a batch holds it for about as long as copying its bytes.
        """
        results = [False] * len(items)
        # Asked each time, not kept: a forked child must name its temp files after itself.
        pid = os.getpid()
        if time.monotonic() >= self._next_reclaim:
            self.reclaim_dead_writers()
        self.flush_touches()
        kept: dict[str, int] = {}  # name -> position of the item written for it
        staged: dict[str, str] = {}  # name -> its temp file, renamed at the end
        renamed: list[str] = []

        def drop(name: str) -> None:
            # Its row is gone: its file goes too, a temp file of this batch or an entry.
            if name in kept:
                results[kept.pop(name)] = False
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staged.pop(name))
            else:
                self._unlink(name)

        try:
            with self._db_lock, self._writers_locked():
                self._write_batch(items, results, kept, staged, drop, pid)
                # Committed: the files go into place now, still under the writers' lock, so
                # no other process evicts, removes or re-admits them in between. A kill
                # here leaves rows whose files are missing (read as misses, evicted in
                # time), never files the index does not count.
                for name, staged_tmp in staged.items():
                    shard = name[:2]
                    if shard not in self._shards:
                        os.makedirs(f"{self._root}/{shard}", exist_ok=True)
                        self._shards.add(shard)
                    final = self.path_for(name)
                    os.rename(staged_tmp, final)
                    renamed.append(final)
                self._bound_log()
        except BaseException:
            # Rolled back, or not all in place: the temp files still there go.
            for path in staged.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        return results

    def _write_batch(
        self,
        items: list[tuple[str, bytes, str | None]],
        results: list[bool],
        kept: dict[str, int],
        staged: dict[str, str],
        drop: Callable[[str], None],
        pid: int,
    ) -> None:
        # write_many's transaction: room made, temp files written, rows in, committed.
        tmp = ""
        try:
            with self._sql() as db:
                limit = self._limit()
                (total,) = db.execute("SELECT bytes FROM total").fetchone()
                names = [self.name_for(key) for key, _, _ in items]
                # One query for the batch, not one per entry: rows are inserted at the end,
                # so SQLite runs a handful of statements per batch (each also hands the GIL
                # over twice, which costs most when the process's other threads are busy).
                indexed = self._sizes(db, names)  # entries of these names already there
                sizes: dict[str, int] = {}
                for position, ((key, payload, etag), name) in enumerate(
                    zip(items, names, strict=True)
                ):
                    head = _encode_head(self._identity_bytes, key, payload, etag)
                    size = len(head) + len(payload)
                    if name in kept:  # the same key twice in one batch: the later one wins
                        total -= sizes.pop(name)
                        drop(name)
                    elif name in indexed:
                        # Replaced, or stale if the new bytes cannot be kept: goes either way.
                        total -= indexed.pop(name)
                        db.execute("DELETE FROM entries WHERE name = ?", (name,))
                        drop(name)
                    if size > limit:
                        continue
                    if total + size > limit:
                        victims, total = self._evict(db, total, size, limit)
                        for victim in victims:
                            indexed.pop(victim, None)
                            drop(victim)
                        if total + size > limit:
                            continue  # only this batch's own entries are left: not kept
                    tmp = f"{self._tmp_dir}/{pid}-{self._tmp_tag}{next(self._tmp_serial)}"
                    _write_new(tmp, head, payload)
                    staged[name], tmp = tmp, ""
                    total += size
                    sizes[name] = size
                    kept[name] = position
                    results[position] = True
                now = time.time()
                db.executemany(
                    "INSERT INTO entries VALUES (?, ?, ?)",
                    [(name, size, now) for name, size in sizes.items()],
                )
                db.execute("UPDATE total SET bytes = ?", (total,))
        except BaseException:
            if tmp:  # the temp file being written when it failed
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise

    @staticmethod
    def _sizes(db: sqlite3.Connection, names: list[str]) -> dict[str, int]:
        """The sizes the index holds for those of ``names`` it has."""
        found: dict[str, int] = {}
        for start in range(0, len(names), 500):  # under SQLite's limit on parameters
            part = names[start : start + 500]
            marks = ",".join("?" * len(part))
            query = f"SELECT name, size FROM entries WHERE name IN ({marks})"  # only "?"s
            found.update(db.execute(query, part).fetchall())
        return found

    def _evict(
        self, db: sqlite3.Connection, total: int, size: int, limit: int
    ) -> tuple[list[str], int]:
        """Delete the rows of the oldest entries until ``size`` more bytes fit; returns them
        and the new total (the caller removes their files). Lazily: only as many rows as
        needed are read."""
        chosen = []
        for victim, victim_size in db.execute("SELECT name, size FROM entries ORDER BY atime"):
            chosen.append(victim)
            total -= victim_size
            if total + size <= limit:
                break
        db.executemany("DELETE FROM entries WHERE name = ?", [(v,) for v in chosen])
        self.evictions += len(chosen)
        return chosen, total

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(name))

    @contextlib.contextmanager
    def _transaction(self, begin: str = "BEGIN IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """Hold this process's index lock and one SQLite transaction: commit on success,
        roll back on any error."""
        with self._db_lock, self._writers_locked():
            with self._sql(begin) as db:
                yield db
            self._bound_log()

    @contextlib.contextmanager
    def _sql(self, begin: str = "BEGIN IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """One SQLite transaction (the caller holds the locks): commit on success, roll back
        on any error."""
        db = self._db
        db.execute(begin)
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _writers_locked(self) -> Iterator[None]:
        self._lock_writers()
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _forget_lock(self) -> None:
        # In a forked child: the lock's open file is shared with the parent, so holding it
        # here would keep the parent's lock held after the parent died. Closed; the tier
        # must be opened again in the child.
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _lock_writers(self) -> None:
        """Take the lock that every process's writers share, or raise after
        :data:`_BUSY_TIMEOUT_MS`.

        Writers take it before SQLite's own lock, so that the log can be truncated with no
        writer between two commits (see :meth:`_bound_log`). It is polled at most every
        5 ms (SQLite polls its lock with sleeps of up to 100 ms). A killed holder's lock is
        released by the kernel; a stopped one makes the others fail after the timeout, as
        SQLite's lock would, which turns the tier off rather than hanging the job.
        """
        fd = self._lock_fd
        if fd < 0:
            raise sqlite3.OperationalError(
                f"the disk cache at {self._root} was opened before this process forked, or "
                "was closed; open it again here"
            )
        deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
        pause = 0.0001
        while not try_lock(fd):
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(
                    f"the cache index in {self._root} stayed locked by another process "
                    f"for {_BUSY_TIMEOUT_MS // 1000} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def _bound_log(self) -> None:
        """Keep the write-ahead log within its reserve.

        SQLite's automatic checkpoint is passive: while other processes keep reading, it
        never finishes, the log is never restarted and it grows without bound (measured:
        0.5 MB over a 600 KiB budget with six processes), shrinking the room left for entries
        to nothing. Past the reserve, wait briefly for the readers and truncate it.
        """
        try:
            size = os.stat(f"{self._db_path}-wal").st_size
        except FileNotFoundError:
            return
        if size <= self._wal_reserve:
            return
        db = self._db
        db.execute(f"PRAGMA busy_timeout={_CHECKPOINT_WAIT_MS}")
        try:
            # Busy is not an error here: another writer holds the log; the next commit retries.
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")

    def _limit(self) -> int:
        # The index counts against the budget, and its write-ahead log grows after this
        # measurement, up to journal_size_limit: reserve that much.
        return self.budget - self._db_bytes() - self._wal_reserve

    # -- remove ------------------------------------------------------------------------------

    def remove(self, key: str) -> None:
        """Drop the entry for ``key``, and every cached block of it, if there are any."""
        name = self.name_for(key)
        with self._db_lock:
            # Block names are "<name>-<index>": '-' < '.' makes this a range on the key.
            blocks = [
                row[0]
                for row in self._db.execute(
                    "SELECT name FROM entries WHERE name > ? AND name < ?", (name + "-", name + ".")
                )
            ]
        for each in [name, *blocks]:
            self._remove(each)

    def _remove(self, name: str) -> None:
        with self._transaction() as db:
            row = db.execute("SELECT size FROM entries WHERE name = ?", (name,)).fetchone()
            if row:
                db.execute("DELETE FROM entries WHERE name = ?", (name,))
                db.execute("UPDATE total SET bytes = bytes - ?", (row[0],))
            self._unlink(name)  # inside the transaction, like publishing: see write_many
        with self._touch_lock:
            self._touched.pop(name, None)

    def clear(self) -> None:
        """Remove every entry (of every process)."""
        with self._transaction() as db:
            for (name,) in db.execute("SELECT name FROM entries").fetchall():
                self._unlink(name)
            db.execute("DELETE FROM entries")
            db.execute("UPDATE total SET bytes = 0")
        with self._touch_lock:
            self._touched.clear()

    # -- bookkeeping -------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes the tier accounts for: entries plus its index."""
        with self._db_lock:
            (total,) = self._db.execute("SELECT bytes FROM total").fetchone()
            return int(total) + self._db_bytes()

    def entry_count(self) -> int:
        """How many entries the index holds."""
        with self._db_lock:
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
        with self._touch_lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return
        # One transaction for the batch: in autocommit each UPDATE would be its own commit,
        # a WAL append apiece.
        with self._transaction("BEGIN") as db:
            db.executemany(
                "UPDATE entries SET atime = ? WHERE name = ?",
                [(atime, name) for name, atime in touched.items()],
            )

    def reclaim_dead_writers(self) -> int:
        """Remove the temp files of writers that died mid-write (or very old ones); returns
        how many. Cheap: the temp directory holds only entries being written.

        Writers call it themselves at most every :data:`RECLAIM_INTERVAL` seconds, so a
        SIGKILLed writer's bytes are given back while the others run.
        """
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL
        try:
            names = os.listdir(self._tmp_dir)
        except FileNotFoundError:
            return 0
        now = time.time()
        verdicts: dict[str, bool] = {}  # pid -> alive, checked once per pass
        removed = 0
        mine = str(os.getpid())
        for name in names:
            pid = name.split("-", 1)[0]
            if pid == mine:
                continue  # ours: in use by a write of this process
            alive = verdicts.get(pid)
            if alive is None:
                alive = verdicts[pid] = pid.isdigit() and _alive(int(pid))
            path = f"{self._tmp_dir}/{name}"
            if not alive or now - _mtime(Path(path)) > _STALE_TMP_SECONDS:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed += 1
        return removed

    def clean_leftovers(self) -> None:
        """Remove what crashed writers left: temp files of dead processes (or very old ones),
        and entry files the index does not know (their bytes would escape the budget)."""
        self.reclaim_dead_writers()
        now = time.time()
        with self._db_lock:
            known = {row[0] for row in self._db.execute("SELECT name FROM entries")}
        for shard in self.directory.iterdir():
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for path in shard.iterdir():
                name = path.name
                if name.startswith(".tmp-"):
                    # Where format 1 wrote its temp files ("PID-RAND" after the prefix).
                    pid = name.split("-")[1]
                    alive = pid.isdigit() and _alive(int(pid))
                    if not alive or now - _mtime(path) > _STALE_TMP_SECONDS:
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
        with self._db_lock:  # after any call still running in another thread
            self._db.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


_OPEN_TIERS: weakref.WeakSet[DiskTier] = weakref.WeakSet()


def _forget_locks() -> None:
    for tier in list(_OPEN_TIERS):
        tier._forget_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)


def _encode_head(identity: bytes, key: str, payload: bytes, etag: str | None) -> bytes:
    # What precedes the payload in an entry file: header, source, key, ETag.
    key_bytes = key.encode()
    etag_bytes = (etag or "").encode()
    lengths = _HEADER.pack(
        _MAGIC, _VERSION, 0, len(payload), len(identity), len(key_bytes), len(etag_bytes)
    )[_CHECKED_FROM:]
    checksum = xxhash.xxh3_64()
    for part in (lengths, identity, key_bytes, etag_bytes, payload):
        checksum.update(part)
    start = _HEADER.pack(_MAGIC, _VERSION, checksum.intdigest(), 0, 0, 0, 0)[:_CHECKED_FROM]
    return start + lengths + identity + key_bytes + etag_bytes


def _write_new(path: str, head: bytes, payload: bytes) -> None:
    # One writev of the head and the payload: no joined copy of the payload, no file object.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        views = [memoryview(head), memoryview(payload)]
        while views:
            done = os.writev(fd, views)
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]
    finally:
        os.close(fd)


def _decode(raw: bytes | bytearray, identity: bytes, key: str) -> tuple[bytes, str | None]:
    # Anything unexpected in a file is damage: whatever fails while reading it (a length that
    # runs past the end, bytes that do not decode) must be dropped and refetched, not raised.
    try:
        return _decode_checked(raw, identity, key)
    except IntegrityError:
        raise
    except Exception as exc:
        raise IntegrityError(f"cache entry for {key!r} cannot be decoded ({exc})") from exc


def _decode_checked(raw: bytes | bytearray, identity: bytes, key: str) -> tuple[bytes, str | None]:
    if len(raw) < _HEADER.size:
        raise IntegrityError(f"cache entry for {key!r} is truncated ({len(raw)} bytes)")
    magic, version, digest, length, id_len, key_len, etag_len = _HEADER.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        raise IntegrityError(f"cache entry for {key!r} has an unknown format")
    start = _HEADER.size + id_len + key_len + etag_len
    if len(raw) != start + length:
        raise IntegrityError(
            f"cache entry for {key!r} holds {len(raw) - start} payload bytes, expected {length}"
        )
    view = memoryview(raw)
    if xxhash.xxh3_64_intdigest(view[_CHECKED_FROM:]) != digest:
        raise IntegrityError(f"cache entry for {key!r} does not match its checksum")
    at = _HEADER.size
    if view[at : at + id_len] != identity:
        raise IntegrityError(f"cache entry for {key!r} belongs to another store")
    at += id_len
    if view[at : at + key_len] != key.encode():
        raise IntegrityError(f"cache entry for {key!r} belongs to another key")
    at += key_len
    etag = bytes(view[at:start]).decode() or None
    return bytes(view[start:]), etag


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
