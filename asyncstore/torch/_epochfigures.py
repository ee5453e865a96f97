"""A streaming dataset's figures: this process's (:class:`DatasetStats`), and the totals of
every process, per epoch and overall (:class:`EpochTotals`), which its DataLoader workers add
to in shared memory."""

from __future__ import annotations

import multiprocessing

import msgspec

from ..cache import CacheStats, PrefetchStats
from ..errors import InvalidArgument

__all__ = ["DatasetStats", "EpochFigures", "EpochTotals", "figures"]

# Per-worker slots of the shared totals (workers beyond this share slots, still summed).
_SLOTS = 256

# The figures each process keeps in its slot, in this order (see _figures): the scheduler's,
# the cache's for the iteration, and the number of iterations the slot holds.
_SAMPLES, _STALLS, _WAIT_US, _MEM_HITS, _MEM_MISSES, _DISK_HITS, _DISK_MISSES = range(7)
_FETCHES, _FETCH_BYTES, _P50_US, _P99_US, _ITERATIONS = range(7, 12)
_FIELDS = 12
# Percentiles cannot be added: a slot keeps its process's latest, and the sum takes the worst.
_LATEST = (_P50_US, _P99_US)

# Epochs whose figures epoch_stats() keeps: the current one and the seven before it. Each
# takes a row of the shared array: its epoch (plus one; 0 for none), then a slot per process.
_EPOCHS = 8
_ROW = 1 + _FIELDS * (_SLOTS + 1)


class EpochTotals(msgspec.Struct):
    """Figures summed over every process of this dataset (the main one and every DataLoader
    worker): of one epoch (:meth:`StreamingDataset.epoch_stats`), or of every iteration
    since the dataset was made (:meth:`StreamingDataset.totals`).

    A process adds its figures when its iteration ends (its part of the epoch read to the
    end, or the loop left).

    Attributes:
        samples: samples yielded.
        stalls: samples a consumer had to wait for (not yet fetched when asked).
        stall_fraction: ``stalls / samples``.
        wait_seconds: total time consumers waited for samples not yet fetched.
        epoch: the epoch, or None for the figures of every epoch.
        processes: processes that ended an iteration (with workers, one per worker).
        hit_rate: reads served by the memory or the disk tier, over all reads.
        memory_hits, memory_misses: reads the processes' memory tiers answered, and those
            they passed on to the disk tier (or, without one, to the store).
        memory_hit_rate: ``memory_hits / (memory_hits + memory_misses)``.
        disk_hits, disk_misses: reads the node's disk tier answered, and those it passed on
            to the store (0 and 0 without ``cache_dir``).
        disk_hit_rate: ``disk_hits / (disk_hits + disk_misses)``: of the reads that reached
            the disk tier.
        store_fetches: reads that reached the store (one per object, as reads of an
            object already being fetched wait for that fetch).
        store_bytes: bytes those reads fetched.
        store_latency_p50, store_latency_p99: seconds; the worst over the processes that
            fetched, each process's percentile taken over its most recent 4096 store reads.
    """

    samples: int
    stalls: int
    stall_fraction: float
    wait_seconds: float
    epoch: int | None = None
    processes: int = 0
    hit_rate: float = 0.0
    memory_hits: int = 0
    memory_misses: int = 0
    memory_hit_rate: float = 0.0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_hit_rate: float = 0.0
    store_fetches: int = 0
    store_bytes: int = 0
    store_latency_p50: float = 0.0
    store_latency_p99: float = 0.0


class DatasetStats(msgspec.Struct):
    """Figures of this process's part of a :class:`StreamingDataset` epoch.

    Attributes:
        samples: samples yielded by this process.
        prefetch: the scheduler's figures (waits, stalls, accuracy, depth).
        cache: the cache's figures (hit rate per tier, store latency), or None before use.
    """

    samples: int
    prefetch: PrefetchStats | None
    cache: CacheStats | None


class EpochFigures:
    """The figures of every process of a dataset, in shared memory.

    ``_FIELDS`` figures per process: one slot for the main process and one per DataLoader
    worker, each written by its own process only (no lock needed, and a lock could not cross
    into spawned workers), summed by :meth:`totals`; and the same per epoch, for the last
    ``_EPOCHS`` epochs, summed by :meth:`epoch`. The main process clears an epoch's row
    when it makes the epoch current (:meth:`begin`), before any worker reads it.
    """

    def __init__(self) -> None:
        self._totals = multiprocessing.RawArray("q", _FIELDS * (_SLOTS + 1))
        self._epochs = multiprocessing.RawArray("q", _EPOCHS * _ROW)

    def begin(self, epoch: int) -> None:
        """Make ``epoch`` current: clear its row, unless it is current already."""
        # Made current again (set_epoch with the same epoch, a resume): its figures add up.
        base = (epoch % _EPOCHS) * _ROW
        if self._epochs[base] != epoch + 1:
            self._epochs[base : base + _ROW] = [epoch + 1] + [0] * (_ROW - 1)

    def add(self, epoch: int, worker: int | None, figures: list[int]) -> None:
        """Add one iteration's ``figures`` (see :func:`figures`) to the slot of ``worker``
        (None: the main process), overall and for ``epoch``."""
        slot = _FIELDS * (0 if worker is None else 1 + worker % _SLOTS)
        base = (epoch % _EPOCHS) * _ROW
        rows = [(self._totals, slot)]
        if self._epochs[base] == epoch + 1:  # else the main process moved past this epoch
            rows.append((self._epochs, base + 1 + slot))
        for array, start in rows:
            for field, value in enumerate(figures):
                if field not in _LATEST:
                    array[start + field] += value
                elif figures[_FETCHES]:
                    array[start + field] = value

    def totals(self) -> EpochTotals:
        """Every iteration's figures, summed over every process."""
        return _summed(list(self._totals), None)

    def epoch(self, epoch: int, current: int) -> EpochTotals:
        """The figures of ``epoch``, summed over every process (``current``: the epoch now
        current, for the error).

        Raises:
            InvalidArgument: ``epoch`` is not one of the last 8 epochs made current.
        """
        base = (epoch % _EPOCHS) * _ROW
        if self._epochs[base] != epoch + 1:
            raise InvalidArgument(
                f"epoch={epoch}: no figures are kept for it; epoch_stats() keeps the last "
                f"{_EPOCHS} epochs made current by set_epoch() or load_state_dict() (the "
                f"current one is {current})"
            )
        return _summed(list(self._epochs[base + 1 : base + _ROW]), epoch)


def figures(stats: DatasetStats, before: CacheStats) -> list[int]:
    """One iteration's figures, as a slot keeps them (the cache's: since ``before``)."""
    figures = [0] * _FIELDS
    figures[_ITERATIONS] = 1
    if stats.prefetch is not None:
        figures[_SAMPLES] = stats.prefetch.items
        figures[_STALLS] = stats.prefetch.stalls
        figures[_WAIT_US] = round(stats.prefetch.wait_seconds * 1e6)
    after = stats.cache
    if after is not None:
        figures[_MEM_HITS] = after.memory.hits - before.memory.hits
        figures[_MEM_MISSES] = after.memory.misses - before.memory.misses
        figures[_DISK_HITS] = after.disk.hits - before.disk.hits
        figures[_DISK_MISSES] = after.disk.misses - before.disk.misses
        figures[_FETCHES] = after.store.fetches - before.store.fetches
        figures[_FETCH_BYTES] = after.store.bytes - before.store.bytes
        figures[_P50_US] = round(after.store.latency_p50 * 1e6)
        figures[_P99_US] = round(after.store.latency_p99 * 1e6)
    return figures


def _summed(figures: list[int], epoch: int | None) -> EpochTotals:
    slots = [figures[start : start + _FIELDS] for start in range(0, len(figures), _FIELDS)]
    total = [sum(slot[field] for slot in slots) for field in range(_FIELDS)]
    for field in _LATEST:
        total[field] = max(slot[field] for slot in slots)

    def share(part: int, whole: int) -> float:
        return part / whole if whole else 0.0

    memory_reads = total[_MEM_HITS] + total[_MEM_MISSES]
    return EpochTotals(
        samples=total[_SAMPLES],
        stalls=total[_STALLS],
        stall_fraction=share(total[_STALLS], total[_SAMPLES]),
        wait_seconds=total[_WAIT_US] / 1e6,
        epoch=epoch,
        processes=sum(1 for slot in slots if slot[_ITERATIONS]),
        hit_rate=share(total[_MEM_HITS] + total[_DISK_HITS], memory_reads),
        memory_hits=total[_MEM_HITS],
        memory_misses=total[_MEM_MISSES],
        memory_hit_rate=share(total[_MEM_HITS], memory_reads),
        disk_hits=total[_DISK_HITS],
        disk_misses=total[_DISK_MISSES],
        disk_hit_rate=share(total[_DISK_HITS], total[_DISK_HITS] + total[_DISK_MISSES]),
        store_fetches=total[_FETCHES],
        store_bytes=total[_FETCH_BYTES],
        store_latency_p50=total[_P50_US] / 1e6,
        store_latency_p99=total[_P99_US] / 1e6,
    )
