"""One view over every live component's figures.

Every store, :class:`~asyncstore.TieredCache`, :class:`~asyncstore.Prefetcher`,
:class:`~asyncstore.Checkpointer` and ``asyncstore.torch.StreamingDataset`` of this process
joins a weak registry when it is built and leaves it when it is closed or garbage-collected;
:func:`snapshot` asks each for its ``stats()``, and adds what a ``StreamingDataset``'s
DataLoader workers published (see :mod:`asyncstore.metrics._workers`)::

    import asyncstore.metrics

    for cache in asyncstore.metrics.snapshot().caches:
        print(cache.name, cache.stats.hit_rate)

For Prometheus, see :mod:`asyncstore.metrics.prometheus`.
"""

from __future__ import annotations

import logging
import time
import typing
from typing import Any, Generic, TypeVar

import msgspec

from .._resource import live as _live
from ..cache import CacheStats, PrefetchStats
from ..stores import LATENCY_BUCKETS, RequestStats, StoreStats
from ..stores import redact as _redact

if typing.TYPE_CHECKING:
    from ..checkpoint._manager import CheckpointerStats
    from ..torch import DatasetStats

__all__ = [
    "CacheStats",
    "Component",
    "Failure",
    "LATENCY_BUCKETS",
    "Metrics",
    "PrefetchStats",
    "RequestStats",
    "StoreStats",
    "WorkerFigures",
    "snapshot",
]

_logger = logging.getLogger("asyncstore.metrics")

_S = TypeVar("_S")


class Component(msgspec.Struct, Generic[_S], frozen=True):
    """One live component and its figures.

    Attributes:
        kind: ``"store"``, ``"cache"``, ``"prefetcher"``, ``"checkpointer"`` or ``"dataset"``.
        name: what it works on, without credentials: the store's URL, the URL of the store
            under a cache or prefetcher, a checkpointer's URL, a dataset's source.
        stats: its ``stats()`` at the time of the snapshot.
        worker: ``None`` for a component of this process; for the figures of a
            ``StreamingDataset``'s DataLoader workers, the worker id (their figures summed
            over every process that had that id: a worker's restarts, several loaders).
    """

    kind: str
    name: str
    stats: _S
    worker: int | None = None


class Failure(msgspec.Struct, frozen=True):
    """A component whose ``stats()`` raised during a snapshot (it is left out of the lists).

    Attributes:
        kind: the component's class name.
        name: what it works on, as in :class:`Component`.
        error: the exception's type and message, credentials masked.
    """

    kind: str
    name: str
    error: str


class Metrics(msgspec.Struct, frozen=True):
    """The figures of every live component of this process (see :func:`snapshot`).

    Each list is sorted by name, then worker. A component shows in one list from its
    construction to its close; the components a :class:`StreamingDataset` opens for itself
    (its store, cache and prefetcher) show in their own lists too, so the dataset's nested
    figures repeat theirs.

    Read by a DataLoader with workers, a dataset's store, cache and prefetcher live in the
    workers: each list then holds one entry per worker id too (:attr:`Component.worker`),
    with what every process of that id counted since it started, exited ones included, for
    as long as the dataset lives. Its dataset entries count every iteration of the worker's
    (``samples`` and ``prefetch`` summed over them, ``cache`` since the worker started).

    Attributes:
        stores: :class:`StoreStats` of every store.
        caches: :class:`~asyncstore.CacheStats` of every :class:`~asyncstore.TieredCache`.
        prefetchers: :class:`~asyncstore.PrefetchStats` of every prefetcher.
        checkpointers: ``CheckpointerStats`` of every :class:`~asyncstore.Checkpointer`.
        datasets: ``DatasetStats`` of every ``StreamingDataset`` (``None`` before its first
            iteration in this process).
        failures: components whose ``stats()`` raised.
        time: when the snapshot was taken (``time.time()``).
    """

    stores: list[Component[StoreStats]]
    caches: list[Component[CacheStats]]
    prefetchers: list[Component[PrefetchStats]]
    checkpointers: list[Component[CheckpointerStats]]
    datasets: list[Component[DatasetStats | None]]
    failures: list[Failure]
    time: float


def _name(component: Any) -> str:
    """What ``component`` works on, for labels and lists; never raises."""
    try:
        # Every component says it: a cache and a prefetcher give their store's.
        url = getattr(component, "url", None)
        if isinstance(url, str):
            return _redact(url)
    except Exception:  # a property that raises: the class name still says what it is
        pass
    return type(component).__name__


def _kind(stats: object) -> str | None:
    if isinstance(stats, StoreStats):
        return "store"
    if isinstance(stats, CacheStats):
        return "cache"
    if isinstance(stats, PrefetchStats):
        return "prefetcher"
    # Their modules import torch: recognised by name rather than imported here.
    cls = type(stats)
    if cls.__module__.startswith("asyncstore."):
        return {"CheckpointerStats": "checkpointer", "DatasetStats": "dataset"}.get(cls.__name__)
    return None


def snapshot() -> Metrics:
    """The figures of every live component of this process, now.

    Cheap (each component copies its counters), safe to call from any thread (a Prometheus
    scrape runs in its server's thread), and it never raises because of one component: a
    ``stats()`` that raises is listed in :attr:`Metrics.failures` and logged at DEBUG.

    The figures of a ``StreamingDataset``'s DataLoader workers are read from the records
    they publish (at most twice a second while they iterate, and at the end of each
    iteration), so they lag theirs by up to half a second mid-epoch and are exact once an
    epoch's loop ended.
    """
    lists: dict[str, list[Any]] = {
        kind: [] for kind in ("store", "cache", "prefetcher", "checkpointer", "dataset")
    }
    failures: list[Failure] = []
    for component in _live():
        if isinstance(component, WorkerFigures):
            try:
                for entry in component.components():
                    lists[entry.kind].append(entry)
            except Exception as exc:
                error = _redact(f"{type(exc).__name__}: {exc}")
                _logger.debug("figures of %s's workers failed: %s", component.name, error)
                failures.append(Failure(kind="WorkerFigures", name=component.name, error=error))
            continue
        try:
            stats = component.stats()
        except Exception as exc:
            name = _name(component)
            error = _redact(f"{type(exc).__name__}: {exc}")
            _logger.debug("stats() of %s %s failed: %s", type(component).__name__, name, error)
            failures.append(Failure(kind=type(component).__name__, name=name, error=error))
            continue
        if stats is None:
            kind = "dataset"  # a StreamingDataset before its first iteration
        else:
            found = _kind(stats)
            if found is None:
                continue  # a component of another library's making: not ours to list
            kind = found
        lists[kind].append(Component(kind=kind, name=_name(component), stats=stats))
    for entries in lists.values():
        entries.sort(key=lambda entry: (entry.name, -1 if entry.worker is None else entry.worker))
    return Metrics(
        stores=lists["store"],
        caches=lists["cache"],
        prefetchers=lists["prefetcher"],
        checkpointers=lists["checkpointer"],
        datasets=lists["dataset"],
        failures=failures,
        time=time.time(),
    )


# Last: it imports Component and _name from this module.
from ._workers import WorkerFigures  # noqa: E402
