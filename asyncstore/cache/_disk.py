"""The disk tier: one directory shared by every process of a node, under one byte budget.

Layout::

    DIR/index.sqlite        the shared index: where each entry lives, and each segment's size
    DIR/index.lock          the writers' lock (empty; only its ``flock`` matters)
    DIR/segments/ID.seg     segment files: entries appended back to back

Entries are packed into segment files, each process appending to one of its own (see
:mod:`~asyncstore.cache._segments`). An entry's name is the xxh3-128 of its source (the
store's :attr:`~asyncstore.Store.identity`) and its cache key: stores sharing a directory
never share names. Its record carries both and a checksum, checked on every read (see
:mod:`~asyncstore.cache._record`): a damaged record is dropped and counted, and the caller
refetches.

Why SQLite for the index: several processes insert and evict at once, and the budget is one
number for all of them. A transaction (``BEGIN IMMEDIATE``, under the writers' lock) makes
"make room, append, record" atomic across processes:

1. Room is made first: whole segments are evicted, least recently read first, until the
   batch fits the budget (the index and its log count against it too). Their rows are
   deleted and their files unlinked before any new byte is written, so the directory
   never holds both.
2. The batch's records are appended to the writer's segment past its recorded end, with one
   ``pwritev``.
3. The rows go in and the transaction commits; only then can a reader find the records.

Recorded bytes are never rewritten, and a committed segment id is never given again, so a
row read from the index points at bytes that stay as they were for as long as the file
exists. A writer killed in step 2 leaves bytes past its segment's recorded end, or a new
segment file the index never knew; killed before the commit, rows of evicted segments
whose files are gone (read as misses, evicted in time). The leftovers are found by the next
writer to hold the lock (at most every ``RECLAIM_INTERVAL`` seconds) and given back:
truncated to the recorded end, or unlinked. No writer is ever mid-append while another
holds the lock, so this needs no guesswork about who is alive.

Hits do not write the index on the read path: they look their entry up (one query on a
connection of their own, never waiting for a writer), and the segments' last-access times
are batched and written with the next insert or when ``TOUCH_BATCH`` reads are pending.
Eviction is least recently used at the granularity of segments: a segment's last access is
that of its most recently read entry.

Every method here blocks, except :meth:`DiskTier.read_cached`, which is safe on an event
loop; the cache calls the others in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import sqlite3
import threading
import time
import weakref
from collections.abc import Container, Iterator, Sequence
from pathlib import Path

import xxhash

from .._concurrency import after_fork_in_child
from ..errors import IntegrityError
from . import _index, _segments
from ._index import INDEX_VERSION
from ._record import HEADER, decode, decode_parts, encode_head
from ._segments import SEGMENT_MAX, SEGMENTS, SegmentReader, open_record

TOUCH_BATCH = 256
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)

SPLIT_FROM = 16 << 10
"""Records from this size on are read in two parts by :meth:`DiskTier.read_nowait` when
asked to: one system call more, one copy of the payload less. Measured on the benchmark
machine, a bare loop of each way's reads and checksum over 2,000 records in the page cache:
16 KB 4.1 us a record against 4.8 read whole, 50 KB 8.8 against 9.2, 1 MB 189 against 228;
4 KB 2.0 against 1.7."""


class WouldBlock:
    """The type of :data:`WOULD_BLOCK`."""


WOULD_BLOCK = WouldBlock()
"""Returned by :meth:`DiskTier.read_cached` when serving the entry would wait for the disk."""

RECLAIM_INTERVAL = 1.0
"""Seconds between two looks, by one writing process, for what killed writers left: bytes
past a segment's recorded end, and segment files the index does not know."""
# How long expect() takes a key it found without an entry as still without one.
_ABSENT_SECONDS = 1.0
# Rows kept at most, a process: about 165 bytes each besides the keys, which the plan holds
# anyway (measured: 83 MiB for 2**19). Keys past it are asked for at every stretch.
_KEPT_ROWS = 1 << 19
# Index lock waits: other processes hold it only for one batch's transaction.
_BUSY_TIMEOUT_MS = 60_000


class DiskRow:
    """Where a warm disk-tier entry lies: what :class:`RowPrefetcher` hands on instead of
    the entry's bytes, for a :class:`RowReader` on the consumer's thread to read.

    Its length is the record's (the payload's and a few hundred bytes of header), which the
    prefetcher's byte budget counts in place of the payload's.

    The disk tier keeps the rows it found and hands the same object on at each later find
    of its key, for as long as no entry of the index is removed: never change one.
    """

    __slots__ = ("generation", "key", "offset", "segment", "size")

    def __init__(self, key: str, segment: int, offset: int, size: int) -> None:
        self.key, self.segment, self.offset, self.size = key, segment, offset, size
        # What the cache knew of the key when the row was first found, set by the cache
        # then: TieredCache.settle keeps the bytes only if nothing forgot the key since.
        self.generation: object = None

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"DiskRow({self.key!r}, segment {self.segment}, {self.size} bytes at {self.offset})"


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
        # Three locks: _db_lock serialises this process's use of the writing connection (and
        # may be held while SQLite waits for another process); _read_lock guards the readers'
        # connection for one query at a time; _touch_lock only guards the batch of access
        # times. The inline read path on the event loop never waits on a writer.
        self._db_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touched: dict[int, float] = {}  # segment -> last read
        self._touches = 0  # reads since the last flush
        self.evictions = 0
        self._nowait = bool(_RWF_NOWAIT) and hasattr(os, "preadv")
        self._reader = SegmentReader()  # read_cached's: on the event loop only
        self._expected: dict[str, DiskRow | None] = {}  # expect()'s, by key
        # Rows found, by key, each handed on as itself at every later find: true while the
        # index's count of removals is _kept_as_of (None: keep none).
        self._kept: dict[str, DiskRow] = {}
        self._kept_as_of: tuple[int, int] | None = None
        # Keys expect() found without an entry lately: not asked again for a while (a cold
        # epoch's prefetcher looks ahead over the same keys at every fill: 16% of its CPU).
        self._absent: set[str] = set()
        self._absent_until = 0.0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._root = str(self.directory)
        self._segment_dir = f"{self._root}/{SEGMENTS}"
        os.makedirs(self._segment_dir, exist_ok=True)
        self._segment_bytes = min(SEGMENT_MAX, max(4096, budget // 16))
        self._next_reclaim = 0.0
        # The segment this process appends to, valid while the index names this process
        # (pid and a tag told apart from an earlier process of the same pid) as its owner.
        self._tag = secrets.token_hex(4)
        self._active: int | None = None
        self._db_path = self.directory / "index.sqlite"
        # Empty: only its lock matters (see _index.lock_writers).
        self._lock_fd = os.open(
            f"{self._root}/index.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        # Keep the write-ahead log small and bounded: it counts against the budget.
        self._wal_reserve = min(4 << 20, budget // 8)
        connections: list[sqlite3.Connection] = []
        try:
            self._db = sqlite3.connect(
                self._db_path,
                timeout=_BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,
                check_same_thread=False,
            )
            connections.append(self._db)
            # Under the writers' lock: switching a new index to WAL fails at once ("database
            # is locked", no busy wait) while another process is opening it too, which
            # switched the tier off in one of two DataLoader workers started together.
            with self._writers_locked():
                self._set_up()
                self._reclaim()
            # Readers never wait: a busy index (rare in WAL mode) sends the read to a thread.
            self._rdb = sqlite3.connect(
                self._db_path, timeout=0, isolation_level=None, check_same_thread=False
            )
            connections.append(self._rdb)
        except BaseException:
            for db in connections:
                db.close()
            os.close(self._lock_fd)
            raise
        _OPEN_TIERS.add(self)

    def _set_up(self) -> None:
        if _index.configure(self._db, self._wal_reserve) == INDEX_VERSION:
            if not _index.has_removals(self._db):  # made by a release before the count
                # Where it cannot be added (a full disk, an index this process may read but
                # not write), the tier works as before, keeping no rows (see expect).
                with contextlib.suppress(sqlite3.Error), self._sql() as db:
                    _index.create_removals(db)
            return
        # New, or written by another format: start empty.
        with self._sql() as db:
            _index.create_tables(db)
        _segments.remove_all(self.directory, self._segment_dir)

    # -- names and files ---------------------------------------------------------------------

    def name_for(self, key: str) -> str:
        """The entry name of a cache key of this tier's source.

        A block of an object (cache key ``"key\\x00index"``) is named after the object's
        hash plus ``-index``: all blocks of one object then sort together in the index, so
        :meth:`remove` finds them without a scan.
        """
        base, sep, index = key.partition("\x00")
        digest = xxhash.xxh3_128_hexdigest((self._name_prefix + base).encode())
        return f"{digest}-{index}" if sep else digest

    def segment_path(self, segment: int) -> str:
        """The file of segment ``segment``."""
        return f"{self._segment_dir}/{segment}.seg"

    def locate(self, key: str) -> tuple[str, int, int] | None:
        """Where the entry for ``key`` lies: its segment file, offset and length, or None."""
        found = self._locate_key(key)
        if found is None:
            return None
        segment, offset, size = found
        return self.segment_path(segment), offset, size

    def _locate_key(self, key: str) -> tuple[int, int, int] | None:
        return self._locate(self.name_for(key))

    def _locate(
        self, name: str, db: sqlite3.Connection | None = None
    ) -> tuple[int, int, int] | None:
        """The segment, offset and length the index holds for ``name``.

        Raises:
            IntegrityError: the row cannot describe a record (a damaged or crafted index).
        """
        if db is not None:
            return _index.find(db, name, HEADER.size, self.budget)
        with self._read_lock:
            return _index.find(self._rdb, name, HEADER.size, self.budget)

    def expect(self, keys: Sequence[str], start: int, stop: int, skip: Container[str]) -> int:
        """Look up where the entries of ``keys[start:stop]`` (cache keys; those in ``skip``
        left out) lie, for the :meth:`read_cached` and :meth:`row_now` calls that follow;
        returns ``stop``. ``start == stop`` forgets what was looked up.

        For a run of reads from the page cache on the event loop: a query per key cost a
        third of such a read, and a query per stretch of keys a third of the event loop's
        busy time in a warm epoch served from this tier. So the rows found are kept, as long
        as the index's count of removed entries stays the same (one cheap query a stretch):
        a row never changes while its entry stays (see :mod:`~asyncstore.cache._index`).
        Only keys not kept are asked for, in one query. What this call looked up goes stale
        once the loop moves on: the caller forgets it before it gives the loop up.

        A failed query looks up nothing. A key found without an entry is taken as absent,
        unasked, until this process writes it or ``_ABSENT_SECONDS`` pass (a hint: the
        regular read path asks the index itself).
        """
        wanted = [k for k in keys[start:stop] if type(k) is str and k not in skip]
        self._expected = self._lookup(wanted)
        return stop

    def _lookup(self, wanted: list[str]) -> dict[str, DiskRow | None]:
        # expect()'s lookup of ``wanted``: each key's row, None where it has no entry; empty
        # when the query failed (each read then asks on its own, and reports a damaged row).
        if not wanted:
            return {}
        try:
            return dict(zip(wanted, self._rows(wanted), strict=True))
        except (sqlite3.Error, IntegrityError):
            return {}

    def _rows(self, keys: list[str]) -> list[DiskRow | None]:
        # Each key's row: the one kept, else asked for (all such keys in one query).
        #
        # Raises: sqlite3.Error, IntegrityError (a damaged row).
        with self._read_lock:
            kept = self._kept_rows()
            rows: list[DiskRow | None] = list(map(kept.get, keys))
            if None in rows:  # not all kept: the rest asked for, in one query
                pairs = list(zip(keys, rows, strict=True))
                found: dict[str, DiskRow | None] = {}
                self._find(found, [key for key, row in pairs if row is None], kept)
                rows = [found.get(key) if row is None else row for key, row in pairs]
        return rows

    def _find(
        self, found: dict[str, DiskRow | None], keys: list[str], kept: dict[str, DiskRow]
    ) -> None:
        # Ask the index where the entries of ``keys`` lie (those found without one lately
        # left out), into ``found``, and keep the rows in ``kept``. The caller holds
        # _read_lock.
        #
        # Raises: sqlite3.Error, IntegrityError (a damaged row).
        if (now := time.monotonic()) >= self._absent_until:  # others' writes show in time
            self._absent, self._absent_until = set(), now + _ABSENT_SECONDS
        names: dict[str, str] = {}  # name -> key, of the keys to ask for
        absent = self._absent
        for key in keys:
            if key not in absent:
                # A lone surrogate is no key, and has no entry. (A try costs nothing here
                # until it raises; suppress() would enter a context per key.)
                try:  # noqa: SIM105
                    names[self.name_for(key)] = key
                except UnicodeEncodeError:
                    pass
        if not names:
            return
        rows = _index.find_many(self._rdb, list(names), HEADER.size, self.budget)
        keep = self._kept_as_of is not None and len(kept) < _KEPT_ROWS
        for name, (segment, offset, size) in rows.items():
            key = names[name]
            row = found[key] = DiskRow(key, segment, offset, size)
            if keep:
                kept[key] = row
        absent.update(names[name] for name in names.keys() - rows.keys())

    def rows_now(self, keys: list[str]) -> list[DiskRow | None]:
        """:meth:`row_now` for each of ``keys`` (valid keys), found as :meth:`expect` finds
        them, in one lookup: None for a key without an entry, and for every key when the
        index is busy or damaged there, or this file system cannot read without waiting
        (the regular read path handles each of those).

        A row kept from an earlier lookup is handed on as the same object, unasked: a warm
        epoch costs a dictionary lookup a key here. A new row for each key of each stretch,
        unpacked from a kept int, had the staging of a warm epoch served from this tier
        take 2.82-3.02 CPU-us a sample, against 2.52-2.59 so (no DataLoader workers,
        alternating processes, benchmark machine). A row is never changed once made, but
        for :attr:`DiskRow.generation`, which its first finder sets.
        """
        if not self._nowait:
            return [None] * len(keys)
        try:
            return self._rows(keys)
        except (sqlite3.Error, IntegrityError):
            return [None] * len(keys)

    def _kept_rows(self) -> dict[str, DiskRow]:
        # The rows kept from earlier lookups, if no entry was removed since; else none (and
        # rows kept from now on are counted from now). The caller holds _read_lock.
        try:
            as_of = _index.removals(self._rdb)
        except sqlite3.Error:
            as_of = None  # no count to go by (an index damaged there): keep nothing
        if as_of is None or as_of != self._kept_as_of:
            self._kept = {}
            self._kept_as_of = as_of
        return self._kept

    def row_now(self, key: str) -> DiskRow | None:
        """Where the entry for ``key`` lies (a row :meth:`expect` looked up, else the
        index's), for a :class:`RowReader` on another thread; None if it has no entry, the
        index is busy or damaged there, or this file system cannot read without waiting
        (the regular read path handles each of those). Reads nothing."""
        if not self._nowait:
            return None
        if key in self._expected:
            return self._expected.pop(key)
        try:
            found = self._locate_key(key)
        except (sqlite3.Error, IntegrityError):
            return None
        return None if found is None else DiskRow(key, *found)

    # -- read --------------------------------------------------------------------------------

    def read(self, key: str) -> tuple[bytes, str | None] | None:
        """The payload and ETag stored for ``key``, or ``None`` if there is no entry.

        Raises:
            IntegrityError: the entry exists but is damaged; it has been removed.
            OSError: the directory cannot be read.
        """
        name = self.name_for(key)
        try:
            try:
                found = self._locate(name)
            except sqlite3.OperationalError:  # busy: ask through the writers' connection
                with self._db_lock:
                    found = self._locate(name, self._db)
            if found is None:
                return None
            segment, offset, size = found
            fd = open_record(self.segment_path(segment), offset, size, key)
            if fd is None:
                return None  # evicted since the lookup
            try:
                raw = os.pread(fd, size, offset)
            finally:
                os.close(fd)
            return self.accept(segment, raw, key)
        except IntegrityError:
            self._remove(name)
            raise

    def read_cached(self, key: str) -> tuple[bytes, str | None] | WouldBlock | None:
        """Like :meth:`read`, but only from the page cache, never waiting for the disk.

        Safe to call on the event loop: it returns :data:`WOULD_BLOCK` instead of waiting
        for a read (Linux ``preadv2(RWF_NOWAIT)``) or for the index, so the caller can
        retry in a thread. A damaged entry raises :class:`IntegrityError` without being
        removed (removal writes the index): call :meth:`remove` from a thread.
        """
        if not self._nowait:
            return WOULD_BLOCK
        try:  # a key expect() looked up is not hashed and asked for again
            if key in self._expected:
                row = self._expected.pop(key)
                found = None if row is None else (row.segment, row.offset, row.size)
            else:
                found = self._locate_key(key)
        except sqlite3.OperationalError:
            return WOULD_BLOCK
        if found is None:
            return None
        try:
            return self.read_nowait(self._reader, key, *found)
        except BlockingIOError:
            return WOULD_BLOCK  # not all of it is in the page cache
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._nowait = False  # this file system or kernel cannot: use threads
                return WOULD_BLOCK
            raise

    def read_nowait(
        self,
        reader: SegmentReader,
        key: str,
        segment: int,
        offset: int,
        size: int,
        etag_len: int | None = None,
    ) -> tuple[bytes, str | None] | None:
        """The payload and ETag of ``key``'s record at ``offset`` in ``segment``, read
        through ``reader`` from the page cache only and checked (:meth:`accept`); None if
        the segment is gone. A record that fails its checks is read once more through fresh
        descriptors: one kept from before the index was made anew reads another record
        (see :class:`SegmentReader`).

        With ``etag_len`` (the length of the ETag the record is expected to hold, in
        bytes), a record of :data:`SPLIT_FROM` bytes or more is read in two parts, its
        payload straight into the bytes object it is returned in: a copy less, and a read
        of the payload that may wait for the disk when only the record's head is in the
        page cache (see :meth:`SegmentReader.read_parts`). A record whose ETag is of
        another length is then read whole.

        Raises:
            IntegrityError: the record fails its checks through fresh descriptors too.
            BlockingIOError: not all of it is in the page cache.
            OSError: the read failed.
        """
        path = self.segment_path(segment)
        head = 0
        if etag_len is not None and size >= SPLIT_FROM:
            head = HEADER.size + len(self._identity_bytes) + len(key.encode()) + etag_len
        try:
            return self._read_record(reader, path, key, segment, offset, size, head)
        except IntegrityError:
            reader.forget()
        return self._read_record(reader, path, key, segment, offset, size, head)

    def _read_record(
        self,
        reader: SegmentReader,
        path: str,
        key: str,
        segment: int,
        offset: int,
        size: int,
        head: int,
    ) -> tuple[bytes, str | None] | None:
        if 0 < head < size:
            parts = reader.read_parts(path, segment, offset, size, key, head, _RWF_NOWAIT)
            if parts is None:
                return None
            first, rest = parts
            hit = None if rest is None else decode_parts(first, rest, self._identity_bytes, key)
            if hit is not None:
                self._touch(segment)
                return hit
        raw = reader.read(path, segment, offset, size, key, _RWF_NOWAIT)
        return None if raw is None else self.accept(segment, raw, key)

    def accept(
        self, segment: int, raw: bytes | bytearray | memoryview, key: str
    ) -> tuple[bytes, str | None]:
        """The payload and ETag of the record ``raw``, read for ``key`` from ``segment``,
        checked (:func:`~asyncstore.cache._record.decode`), and the segment's access noted
        (thread-safe).

        Raises:
            IntegrityError: the record is damaged, or of another source or key.
        """
        payload, etag = decode(raw, self._identity_bytes, key)
        self._touch(segment)
        return payload, etag

    def _touch(self, segment: int) -> None:
        # Note a read of the segment, for its access time in the index (thread-safe).
        with self._touch_lock:
            self._touched[segment] = time.time()
            self._touches += 1

    @property
    def touches_pending(self) -> int:
        """Reads whose access time is not yet in the index (see :meth:`flush_touches`)."""
        return self._touches

    # -- write -------------------------------------------------------------------------------

    def write(self, key: str, payload: bytes, etag: str | None) -> bool:
        """Store ``payload`` for ``key``, evicting least recently used segments as needed.

        Returns False when the entry cannot fit the budget at all.
        """
        return self.write_many([(key, payload, etag)])[0]

    def write_many(self, items: list[tuple[str, bytes, str | None]]) -> list[bool]:
        """Store several entries with one index transaction; one result per item.

        Batching matters: the transaction and the thread hop that carries this call cost
        more than appending a small entry. Room is made before bytes are written (see the
        module's numbered steps), so the directory never holds more than the budget however
        many writers burst at once. Writers of other processes wait for the lock meanwhile:
        the appends go to the page cache (no fsync), so a batch holds it for about as long
        as copying its bytes.
        """
        results = [False] * len(items)
        self.flush_touches()
        # Asked each time, not kept: a forked child is another owner.
        owner = f"{os.getpid()}-{self._tag}"
        victims: list[int] = []
        with self._db_lock, self._writers_locked():
            if time.monotonic() >= self._next_reclaim:
                self._reclaim()
            started: dict[int, int] = {}  # segment -> its recorded end before this batch
            try:
                with self._sql() as db:
                    self._write_batch(db, items, results, victims, started, owner)
            except BaseException:
                # Rolled back: what this batch appended lies past the recorded ends again,
                # and the rows of the segments it evicted are back, without their files.
                self._active = None
                for segment, end in started.items():
                    _segments.cut_back(self.segment_path(segment), end)
                if victims:
                    with contextlib.suppress(sqlite3.Error), self._sql() as db:
                        _index.forget(db, victims)
                raise
            self._bound_log()
        self._absent.difference_update(key for key, _, _ in items)
        return results

    def _write_batch(
        self,
        db: sqlite3.Connection,
        items: list[tuple[str, bytes, str | None]],
        results: list[bool],
        victims: list[int],
        started: dict[int, int],
        owner: str,
    ) -> None:
        # write_many's transaction: room made, records appended, rows in.
        limit = self._limit()
        owners: dict[int, str] = {}
        sizes: dict[int, int] = {}
        for segment, size, segment_owner in db.execute("SELECT id, bytes, owner FROM segments"):
            sizes[segment], owners[segment] = size, segment_owner
        total = sum(sizes.values())
        active = self._active
        if active is not None and (
            owners.get(active) != owner or not os.path.exists(self.segment_path(active))
        ):
            # Evicted by another process, not ours (a forked child), or unlinked by a writer
            # killed before its commit (the row came back, the file did not).
            active = None
        now = time.time()
        names = [self.name_for(key) for key, _, _ in items]
        # Replaced entries: their rows go, their bytes stay in their segments until those are
        # evicted (recorded bytes are never rewritten).
        db.executemany("DELETE FROM entries WHERE name = ?", [(name,) for name in set(names)])
        order: list[int] | None = None  # eviction candidates, least recently read first
        rows: dict[str, tuple[int, int, int, int]] = {}  # name -> segment, offset, size, item
        parts: dict[int, list[bytes]] = {}  # segment -> buffers to append
        for position, ((key, payload, etag), name) in enumerate(zip(items, names, strict=True)):
            if name in rows:  # the same key twice in one batch: the later one wins, kept or not
                results[rows.pop(name)[3]] = False
            head = encode_head(self._identity_bytes, key, payload, etag)
            size = len(head) + len(payload)
            if size > limit:
                continue
            while total + size > limit:
                if order is None:
                    order = [row[0] for row in db.execute("SELECT id FROM segments ORDER BY atime")]
                # Never a segment this batch appends to: its records are not yet written.
                victim = next((s for s in order if s not in started), None)
                if victim is None:
                    break
                order.remove(victim)
                self.evictions += _index.forget(db, [victim])
                total -= sizes.pop(victim)
                victims.append(victim)
                # Gone before any byte of the batch is written: the directory never holds
                # the victims and the new records at once. (A kill before the commit leaves
                # their rows without files: read as misses, evicted in time.)
                _segments.remove(self.segment_path(victim))
                if victim == active:
                    active = None
            if total + size > limit:
                continue  # only this batch's own segments are left: not kept
            if active is None or (sizes[active] and sizes[active] + size > self._segment_bytes):
                if active is not None:
                    db.execute("UPDATE segments SET owner = '' WHERE id = ?", (active,))
                cursor = db.execute(
                    "INSERT INTO segments (bytes, atime, owner) VALUES (0, ?, ?)", (now, owner)
                )
                active = cursor.lastrowid
                assert active is not None
                sizes[active] = 0
                started[active] = 0
                _segments.create(self.segment_path(active))
            started.setdefault(active, sizes[active])
            rows[name] = (active, sizes[active], size, position)
            parts.setdefault(active, []).extend((head, payload))
            sizes[active] += size
            total += size
            results[position] = True
        for segment, buffers in parts.items():
            _segments.append(self.segment_path(segment), started[segment], buffers)
        db.executemany(
            "INSERT INTO entries VALUES (?, ?, ?, ?)",
            [(name, segment, offset, size) for name, (segment, offset, size, _) in rows.items()],
        )
        db.executemany(
            "UPDATE segments SET bytes = ?, atime = ? WHERE id = ?",
            [(sizes[segment], now, segment) for segment in started],
        )
        self._active = active

    def _reclaim(self) -> None:
        """Give back what killed writers left (the caller holds the writers' lock, so no
        writer is mid-append): bytes past a segment's recorded end are truncated, and
        segment files the index does not know are unlinked."""
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL
        sizes = dict(self._db.execute("SELECT id, bytes FROM segments").fetchall())
        names = _segments.listing(self._segment_dir)
        if names is None:
            return
        # Rows whose files a writer killed before its commit had already unlinked.
        missing = set(sizes) - _segments.segment_ids(names)
        if missing:
            with self._sql() as db:
                _index.forget(db, sorted(missing))
        _segments.give_back(self._segment_dir, names, sizes)

    def reclaim_dead_writers(self) -> None:
        """Give back now what killed writers left (writers do it themselves at most every
        :data:`RECLAIM_INTERVAL` seconds)."""
        with self._db_lock, self._writers_locked():
            self._reclaim()

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
        _index.lock_writers(self._lock_fd, self._root, _BUSY_TIMEOUT_MS)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _forget_lock(self) -> None:
        # In a forked child: the lock's open file is shared with the parent, so holding it
        # here would keep the parent's lock held after the parent died. Closed; the tier
        # must be opened again in the child. So are the kept segments' descriptors, which
        # would hold evicted segments' space for the child's life.
        self._reader.forget()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _bound_log(self) -> None:
        # Truncated with no writer between two commits: see _index.bound_log.
        _index.bound_log(self._db, self._db_path, self._wal_reserve, _BUSY_TIMEOUT_MS)

    def _limit(self) -> int:
        # The index counts against the budget, and its write-ahead log grows after this
        # measurement, up to journal_size_limit: reserve that much.
        return self.budget - self._db_bytes() - self._wal_reserve

    # -- remove ------------------------------------------------------------------------------

    def remove(self, key: str) -> None:
        """Drop the entry for ``key``, and every cached block of it, if there are any.

        Their bytes stay in their segments, counted, until those are evicted: recorded bytes
        are never rewritten, which is what lets readers go without locks.
        """
        name = self.name_for(key)
        with self._transaction() as db:
            # Block names are "<name>-<index>": '-' < '.' makes this a range on the key.
            db.execute(
                "DELETE FROM entries WHERE name = ? OR (name > ? AND name < ?)",
                (name, name + "-", name + "."),
            )

    def _remove(self, name: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM entries WHERE name = ?", (name,))

    def clear(self) -> None:
        """Remove every entry (of every process)."""
        with self._transaction() as db:
            segments = [row[0] for row in db.execute("SELECT id FROM segments").fetchall()]
            _index.remove_all(db)
            db.execute("DELETE FROM segments")
            for segment in segments:  # as evictions do: gone before the commit
                _segments.remove(self.segment_path(segment))
        self._active = None
        with self._touch_lock:
            self._touched.clear()
            self._touches = 0

    # -- bookkeeping -------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes the tier accounts for: its segments plus its index."""
        with self._db_lock:
            (total,) = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM segments").fetchone()
            return int(total) + self._db_bytes()

    def entry_count(self) -> int:
        """How many entries the index holds."""
        with self._db_lock:
            (count,) = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()
            return int(count)

    def _db_bytes(self) -> int:
        return _index.file_bytes(self._db_path)

    def flush_touches(self) -> None:
        """Write batched access times to the index (blocks)."""
        with self._touch_lock:
            touched, self._touched, self._touches = self._touched, {}, 0
        if not touched:
            return
        # One transaction for the batch: in autocommit each UPDATE would be its own commit,
        # a WAL append apiece.
        with self._transaction("BEGIN") as db:
            db.executemany(
                "UPDATE segments SET atime = MAX(atime, ?) WHERE id = ?",
                [(atime, segment) for segment, atime in touched.items()],
            )

    def close(self) -> None:
        """Write pending access times and close the index."""
        with contextlib.suppress(sqlite3.Error):
            self.flush_touches()
        self._reader.forget()
        with self._read_lock:
            self._rdb.close()
        with self._db_lock:  # after any call still running in another thread
            self._db.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


_OPEN_TIERS: weakref.WeakSet[DiskTier] = weakref.WeakSet()
_OPEN_READERS: weakref.WeakSet[RowReader] = weakref.WeakSet()


def _forget_locks() -> None:
    for tier in list(_OPEN_TIERS):
        tier._forget_lock()
    for reader in list(_OPEN_READERS):
        reader.close()  # a child holding them would keep evicted segments' space


after_fork_in_child(_forget_locks)


class RowReader:
    """Reads :class:`DiskRow` entries on one thread (a consumer's, not the event loop's),
    through descriptors of its own, from the page cache only.

    Each record is checked as :meth:`DiskTier.read` checks it, and its segment's access is
    noted. A row that cannot be served so gives None, and the caller gets that key the
    regular way, which reports and drops a damaged entry: its segment gone (evicted since
    the row was found), a record that fails its checks or is of another key (read through
    a descriptor from before the index was made anew: tried once more through a fresh
    one), bytes not all in the page cache, a read that fails. :attr:`cold` counts the rows
    not read for want of the page cache (or of reads that do not wait, on this file
    system).

    A record of :data:`SPLIT_FROM` bytes or more whose ETag is as long as the last one
    read is read in two parts, its payload straight into the bytes object returned: a copy
    less. Only its head's read is from the page cache only; its payload's may wait for the
    disk when the page cache holds the head and not all the rest, as a plain read would.
    """

    def __init__(self, disk: DiskTier) -> None:
        self._disk = disk
        self._reader = SegmentReader()
        self.cold = 0
        self._etag_len: int | None = None  # the last record's (see read)
        _OPEN_READERS.add(self)

    def read(self, row: DiskRow) -> bytes | None:
        """The payload of ``row``'s entry, or None (see the class)."""
        try:
            hit = self._disk.read_nowait(
                self._reader, row.key, row.segment, row.offset, row.size, self._etag_len
            )
        except BlockingIOError:
            self.cold += 1
            return None
        except IntegrityError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self.cold += 1  # no reads that do not wait here
            return None
        if hit is None:
            return None
        payload, etag = hit
        # The next record is read in two parts if its ETag is as long as this one's: a
        # source's ETags mostly are (32 hex digits and quotes, S3's).
        self._etag_len = 0 if etag is None else len(etag.encode())
        return payload

    def close(self) -> None:
        """Close the descriptors kept."""
        self._reader.forget()
