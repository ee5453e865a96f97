"""DataLoader workers' figures in the main process's :func:`asyncstore.metrics.snapshot`.

A ``StreamingDataset`` read by a DataLoader with workers opens its store, cache and
prefetcher in each worker process, where the main process's registry cannot see them. So
each worker publishes its figures to a file of its own, in a directory the main process made
for the dataset (under ``/dev/shm`` where there is one: memory, not a disk):

- written by that worker only, whole: a temporary file renamed over the previous record, so
  no lock crosses processes and a reader never sees half a record;
- cumulative: everything the worker process counted since it started, the prefetch figures
  of its finished iterations included;
- at most every :data:`INTERVAL` seconds while the worker iterates (a clock read per trip to
  the background loop, never per sample), at the end of each iteration and when the worker
  process exits.

At each snapshot the main process reads every record. Checked before its record is read (so
that what is read is its last), a worker process that is gone has its record folded into the
figures kept for its worker id, and the file removed: what exited workers counted stays in
the counters. Records are folded too at each ``set_epoch`` of the dataset, so that the
directory holds about one file per live worker even when nothing scrapes. A worker killed
outright loses what it counted since its last record (at most :data:`INTERVAL` seconds).
The directory goes when the dataset is garbage-collected or the interpreter exits. A process
killed outright (SIGKILL, the OOM killer) cannot remove it: the next dataset made on the host
removes the directories of this user's processes that are gone, once untouched for
:data:`STALE_SECONDS`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from .._resource import track
from ..cache import CacheStats, PrefetchStats
from ..stores import StoreStats
from . import Component, _name
from ._merge import add_cache, add_prefetch, add_store

if TYPE_CHECKING:
    from ..torch import DatasetStats

__all__ = ["INTERVAL", "Publisher", "WorkerFigures"]

# A scrape comes every 15 s or so: twice a second keeps a worker's figures current at a cost
# that does not show (a record is a few kilobytes written to memory, about 0.1 ms).
INTERVAL = 0.5

_PREFIX = "asyncstore-metrics-"
_SUFFIX = ".rec"

STALE_SECONDS = 3600.0
"""A directory of records whose owner process is gone is removed once untouched this long:
its pid alone could belong to a process in another pid namespace sharing ``/dev/shm``,
whose live dataset rewrites a record at least every :data:`INTERVAL` seconds while its
workers iterate."""

_logger = logging.getLogger("asyncstore.metrics")


def _base() -> str | None:
    """Where records go: /dev/shm (memory) if this host has a writable one, else the
    temporary directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return None  # tempfile's default


class _Record(msgspec.Struct, frozen=True):
    """What one worker process counted since it started (the prefetcher's figures summed
    over its iterations), and the names of its components."""

    worker: int
    pid: int
    time: float
    samples: int
    store_name: str
    store: StoreStats
    cache_name: str
    cache: CacheStats
    prefetch_name: str
    prefetch: PrefetchStats | None


_decoder = msgspec.msgpack.Decoder(_Record)


def _add(a: _Record | None, b: _Record) -> _Record:
    """``a`` then ``b`` (a later record, or another process with the same worker id)."""
    if a is None:
        return b
    if a.prefetch is None or b.prefetch is None:
        prefetch = b.prefetch or a.prefetch
    else:
        prefetch = add_prefetch(a.prefetch, b.prefetch)
    return msgspec.structs.replace(
        b,
        time=max(a.time, b.time),
        samples=a.samples + b.samples,
        store=add_store(a.store, b.store),
        cache=add_cache(a.cache, b.cache),
        prefetch=prefetch,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process took the number: it exists
        return True
    return True


def _sweep(base: str | None) -> int:
    """Remove the record directories under ``base`` (tempfile's default for None) that
    this user's killed processes left: owner gone, untouched for :data:`STALE_SECONDS`.
    Returns how many went; never raises (figures never stop the training)."""
    removed = 0
    try:
        entries = list(os.scandir(base if base is not None else tempfile.gettempdir()))
    except OSError:
        return 0
    now, uid = time.time(), os.getuid()
    for entry in entries:
        if not entry.name.startswith(_PREFIX):
            continue
        try:
            owner = int(entry.name[len(_PREFIX) :].split("-")[0])
            info = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            continue
        if (
            not entry.is_dir(follow_symlinks=False)
            or info.st_uid != uid
            or owner == os.getpid()
            or now - info.st_mtime < STALE_SECONDS
            or _alive(owner)
        ):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += not os.path.exists(entry.path)
    if removed:
        _logger.info("removed %d record directories of killed processes", removed)
    return removed


def _remove(directory: str, owner: int) -> None:
    # A forked worker inherits the dataset and this finalizer: only the owner removes.
    if os.getpid() != owner:
        return
    for _ in range(3):  # a worker may be writing its last record as the owner exits
        shutil.rmtree(directory, ignore_errors=True)
        if not os.path.exists(directory):
            return


class Publisher:
    """One iteration's hooks into a worker's record; in the main process they do nothing
    (its components are in its own registry)."""

    def tick(self) -> None:
        """Called once per trip to the background loop: publish if :data:`INTERVAL` passed."""

    def end(self, stats: DatasetStats) -> None:
        """Called when the iteration ended, with its figures: publish them."""


class _Writer(Publisher):
    """A worker process's record of one dataset: its figures so far, written whole."""

    def __init__(self, directory: str, worker: int) -> None:
        self.pid = os.getpid()
        self.worker = worker
        # The token keeps a later process that reuses this pid from writing over this file
        # before the main process folded it.
        name = f"w{worker}-{self.pid}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, name + _SUFFIX)
        self.temp = os.path.join(directory, f".{name}.tmp")
        self.samples = 0  # of the finished iterations
        self.prefetch: PrefetchStats | None = None  # summed over the finished iterations
        self.store: Any = None
        self.cache: Any = None
        self.prefetcher: Any = None
        self.due = 0.0
        self.stopped = False
        # What the current iteration counted since the last record, when the worker exits.
        multiprocessing.util.Finalize(None, self.publish, exitpriority=0)

    def start(self, store: Any, cache: Any, prefetcher: Any) -> None:
        if self.prefetcher is not None:  # an iteration that ended without end()
            self._finish(self.prefetcher.stats())
        self.store, self.cache, self.prefetcher = store, cache, prefetcher
        self.due = time.monotonic() + INTERVAL

    def _finish(self, prefetch: PrefetchStats) -> None:
        self.samples += prefetch.items
        self.prefetch = prefetch if self.prefetch is None else add_prefetch(self.prefetch, prefetch)
        self.prefetcher = None

    def tick(self) -> None:
        if time.monotonic() >= self.due:
            self.publish()

    def end(self, stats: DatasetStats) -> None:
        if self.prefetcher is not None:
            self._finish(stats.prefetch if stats.prefetch is not None else self.prefetcher.stats())
        self.publish()

    def publish(self) -> None:
        """Write this process's figures so far over its previous record."""
        if self.stopped or self.store is None:
            return
        self.due = time.monotonic() + INTERVAL
        try:
            prefetch, samples = self.prefetch, self.samples
            if self.prefetcher is not None:
                current = self.prefetcher.stats()
                samples += current.items
                prefetch = current if prefetch is None else add_prefetch(prefetch, current)
            record = _Record(
                worker=self.worker,
                pid=self.pid,
                time=time.time(),
                samples=samples,
                store_name=_name(self.store),
                store=self.store.stats(),
                cache_name=_name(self.cache),
                cache=self.cache.stats(),
                prefetch_name=_name(self.cache),  # as a prefetcher is named: by its source
                prefetch=prefetch,
            )
            with open(self.temp, "wb") as file:
                file.write(msgspec.msgpack.encode(record))
            os.replace(self.temp, self.path)
        except FileNotFoundError:
            self.stopped = True  # the directory is gone: so is the dataset in the main process
        except Exception as exc:  # figures never stop the training
            self.stopped = True
            _logger.warning(
                "DataLoader worker %d stops publishing its figures to %s: %s: %s",
                self.worker,
                self.path,
                type(exc).__name__,
                exc,
            )


class WorkerFigures:
    """The records of a dataset's DataLoader workers, read by the main process's snapshots.

    Made by the dataset in the process that builds it (which owns the directory); copied
    into each worker with the dataset (pickled into a spawned one), where
    :meth:`iteration` writes that worker's record. ``summary`` makes the owner's figures of
    one worker id from its ``samples``, ``prefetch`` and ``cache`` figures (passed by keyword):
    the owner's stats type, which this layer does not import.
    """

    def __init__(self, owner: object, summary: Callable[..., object]) -> None:
        self.name = _name(owner)
        self.summary = summary
        self.owner = os.getpid()
        self.directory: str | None
        base = _base()
        _sweep(base)
        try:
            self.directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{self.owner}-", dir=base)
        except OSError as exc:
            self.directory = None
            _logger.warning(
                "no directory for the figures of %s's DataLoader workers (%s); snapshots "
                "show this process's figures only",
                self.name,
                exc,
            )
        else:
            weakref.finalize(self, _remove, self.directory, self.owner)
        self._fresh()
        track(self)  # read by snapshot() while the dataset lives

    def _fresh(self) -> None:
        self._lock = threading.Lock()
        self._folded: dict[int, _Record] = {}  # by worker id: its exited processes, summed
        self._writer: _Writer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "owner": self.owner,
            "directory": self.directory,
            "summary": self.summary,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self.owner, self.directory = state["name"], state["owner"], state["directory"]
        self.summary = state["summary"]
        self._fresh()

    def iteration(self, store: Any, cache: Any, prefetcher: Any) -> Publisher:
        """The hooks of an iteration over ``store`` and ``cache`` with ``prefetcher``: in a
        DataLoader worker, they publish its record; elsewhere they do nothing."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None or self.directory is None:
            return Publisher()
        writer = self._writer
        if writer is None or writer.pid != os.getpid():
            writer = self._writer = _Writer(self.directory, info.id)
        writer.start(store, cache, prefetcher)
        return writer

    def _records(self) -> list[_Record]:
        """Every live worker's record; those of exited workers folded and removed."""
        if self.directory is None:
            return []
        live = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                if entry.name.endswith(".tmp"):
                    self._drop_dead_temp(entry.name, entry.path)
                if not entry.name.endswith(_SUFFIX):
                    continue
                try:
                    pid = int(entry.name.split("-")[1])
                except (IndexError, ValueError):
                    continue
                alive = _alive(pid)  # before the read: a record read after its end is its last
                try:
                    with open(entry.path, "rb") as file:
                        record = _decoder.decode(file.read())
                except (FileNotFoundError, msgspec.DecodeError):
                    continue
                if alive:
                    live.append(record)
                    continue
                self._folded[record.worker] = _add(self._folded.get(record.worker), record)
                for path in (entry.path, os.path.join(self.directory, f".{entry.name[:-4]}.tmp")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        return live

    @staticmethod
    def _drop_dead_temp(name: str, path: str) -> None:
        # A worker killed between writing its temporary record and renaming it.
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            return
        if not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def fold(self) -> None:
        """Fold the records of exited workers into the figures kept for their worker ids and
        remove their files (the dataset calls it at each :meth:`set_epoch`, so that a job
        nobody scrapes keeps about one file per live worker too)."""
        if os.getpid() != self.owner:
            return  # only the process that reads them folds them
        with self._lock:
            self._records()

    def components(self) -> list[Component[Any]]:
        """Per worker id, its figures summed over its processes, live and exited: one entry
        each for its store, cache, prefetcher and dataset."""
        with self._lock:  # two scrapes at once must not fold a record twice
            live = self._records()
            totals = dict(self._folded)
        for record in sorted(live, key=lambda record: record.time):
            totals[record.worker] = _add(totals.get(record.worker), record)
        entries: list[Component[Any]] = []
        for worker, total in sorted(totals.items()):
            entries += [
                Component(kind="store", name=total.store_name, stats=total.store, worker=worker),
                Component(kind="cache", name=total.cache_name, stats=total.cache, worker=worker),
            ]
            if total.prefetch is not None:
                entries.append(
                    Component(
                        kind="prefetcher",
                        name=total.prefetch_name,
                        stats=total.prefetch,
                        worker=worker,
                    )
                )
            dataset = self.summary(
                samples=total.samples, prefetch=total.prefetch, cache=total.cache
            )
            entries.append(Component(kind="dataset", name=self.name, stats=dataset, worker=worker))
        return entries
