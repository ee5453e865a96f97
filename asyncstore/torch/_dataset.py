"""StreamingDataset: a PyTorch ``IterableDataset`` over a store, cached and prefetched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import sys
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence, Sized
from itertools import starmap
from operator import itemgetter, length_hint
from pathlib import Path
from types import FrameType
from typing import Any, Generic, Literal, TypeVar, cast

import torch.distributed as dist
import xxhash
from torch.utils.data import IterableDataset, get_worker_info

try:  # only to tell the DataLoader's batch size (see _loader_batch)
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher
except ImportError:  # pragma: no cover - a torch without it: the check is skipped
    _IterableDatasetFetcher = None  # type: ignore[assignment,misc]

from .._config import DatasetConfig, build
from .._dirs import check_disk_dir
from .._loop import run_sync
from .._resource import track
from ..cache import CacheStats, DiskRow, RowPrefetcher, RowReader, TieredCache
from ..errors import AsyncStoreError, InvalidArgument, InvalidKey
from ..metrics import WorkerFigures
from ..stores import Store, check_key, open_store
from ._datastate import (
    MAX_EPOCH,
    Facts,
    Position,
    check_world,
    make_state,
    read_state,
    stream_slices,
)
from ._epochfigures import DatasetStats, EpochFigures, EpochTotals, figures
from ._keyindex import KeyIndex, build_index, write_index
from ._order import EpochOrder
from ._shard import per_rank

T = TypeVar("T")

__all__ = ["StreamingDataset", "DatasetStats", "EpochTotals"]

MiB = 1 << 20

logger = logging.getLogger("asyncstore.torch")

# Items handed over per trip to the background loop: each trip costs a thread hop, which is
# worth amortising over several ready items.
_BATCH = 64

_second = itemgetter(1)  # a sample's bytes, from its (key, bytes)

# Keys decoded from the key index at a time, as the prefetcher reads the plan.
_DECODE = 512

# Batches staged ahead on the loop (see _Session), and the bytes that stops staging early.
_STAGED = 4
_STAGED_BYTES = 64 << 20
# Batches left staged when the consumer wakes the loop to stage more, in batches with no
# rows to hand back (see _Session).
_RESTAGE_AT = 1


def _check_keys(keys: object, url: str) -> list[str]:
    if isinstance(keys, str | bytes) or not isinstance(keys, Iterable):
        raise InvalidArgument(
            f"keys={keys!r:.100}: pass a list of keys such as ['train/0.jpg'], not "
            f"{'a single key' if isinstance(keys, str | bytes) else type(keys).__name__}"
        )
    listed = list(keys)
    if not listed:
        raise InvalidArgument("keys=[]: pass at least one key, or None to list the source")
    for index, key in enumerate(listed):
        try:
            check_key(key, url)
        except InvalidKey as exc:
            raise InvalidKey(f"keys[{index}]: {exc}") from None
    return listed


class StreamingDataset(IterableDataset[T], Generic[T]):
    """Stream a dataset's objects from a store, through a tiered cache and prefetch.

    Args:
        source: a URL prefix (``"s3://bucket/train/"``, a local directory) or an open store.
        keys: the objects to read, relative to ``source``; by default ``source`` is listed
            once (and the listing kept in ``cache_dir``, so a restart does not list again).
        cache_dir: a local directory for the disk tier, shared by the node's processes.
        memory_bytes: memory tier budget per process.
        disk_bytes: disk tier budget (with ``cache_dir``); default 64 GiB.
        shuffle, seed: a fresh deterministic order per epoch from ``seed`` and the epoch.
        decode: ``decode(key, data) -> sample``, run in the worker; default: the bytes.
        lookahead, max_inflight: the prefetcher's depth and requests in flight.
        cache_policy: the memory tier's eviction: ``"plan"`` (default) follows the epoch's
            order (Belady's rule: the most hits possible when the dataset does not fit in
            memory); ``"lru"`` evicts by recency, which thrashes on shuffled epochs.
        rank, world_size: this process's shard; default from ``torch.distributed``.
        batch_size: set to the DataLoader's ``batch_size`` so that, with workers, the stream
            comes out in exactly the plan's order (workers take whole batches in turn); that
            makes mid-epoch resume exact.
        store_options: options for ``open_store`` when ``source`` is a URL.

    Every sample is read exactly once per epoch across ranks and workers. Ranks get equal
    lengths (``ceil(N / world_size)``): the last shard is padded by repeating samples from
    the start of the epoch's order, as DDP needs every rank to step the same number of times.
    """

    # The batch this process's iteration is handing out: its size and iterator.
    _handing: tuple[int, Iterator[tuple[str, bytes]]] | None

    def __init__(
        self,
        source: str | os.PathLike[str] | Store,
        *,
        keys: Sequence[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        memory_bytes: int = 512 * MiB,
        disk_bytes: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        decode: Callable[[str, bytes], T] | None = None,
        lookahead: int | Literal["auto"] = "auto",
        max_inflight: int = 32,
        cache_policy: Literal["lru", "plan"] = "plan",
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int = 1,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # Everything is checked here, before any worker starts: a worker opens the store,
        # the cache and the prefetcher from these values, where an error would surface only
        # as a failed DataLoader worker.
        if store_options is not None and not isinstance(store_options, dict):
            raise InvalidArgument(
                f"store_options={store_options!r}: pass a dict of open_store options"
            )
        if isinstance(source, Store):
            if store_options:
                raise InvalidArgument(
                    f"store_options={store_options!r} was given with an open store; they "
                    "apply only when source is a URL (the store keeps its own options)"
                )
            # Workers reopen the store from its URL and options: a live client never crosses
            # a process boundary (async clients inherited across fork hang).
            self._url, self._options = source.reopen_args()
        elif isinstance(source, str | os.PathLike):
            self._url = os.fspath(source)
            self._options = dict(store_options or {})
            open_store(self._url, **self._options)  # checks the URL and options now
        else:
            raise InvalidArgument(f"source={source!r}: pass a URL, a local path or a store")
        if decode is not None and not callable(decode):
            raise InvalidArgument(
                f"decode={decode!r}: pass a function decode(key, data) -> sample, or None"
            )
        config = self._config = build(
            DatasetConfig,
            {
                "cache_dir": os.fspath(cache_dir)
                if isinstance(cache_dir, os.PathLike)
                else cache_dir,
                "memory_bytes": memory_bytes,
                "disk_bytes": disk_bytes,
                "shuffle": shuffle,
                "seed": seed,
                "lookahead": lookahead,
                "max_inflight": max_inflight,
                "cache_policy": cache_policy,
                "rank": rank,
                "world_size": world_size,
                "batch_size": batch_size,
            },
            "StreamingDataset",
        )
        self._cache_dir = config.cache_dir
        if config.cache_dir is not None:
            # Here rather than in a worker, where the disk tier would only switch itself off.
            check_disk_dir(
                config.cache_dir,
                "cache_dir",
                "cache_dir=None for no disk tier (the listing is then kept in memory)",
            )
        self._memory_bytes = config.memory_bytes
        self._disk_bytes = config.disk_bytes if config.disk_bytes is not None else 64 << 30
        self._shuffle = config.shuffle
        self._seed = config.seed
        self._decode = decode
        self._lookahead: int | Literal["auto"] = config.lookahead
        self._max_inflight = config.max_inflight
        self._policy: Literal["lru", "plan"] = config.cache_policy
        self._rank = config.rank
        self._world = config.world_size
        self._batch = config.batch_size
        # The Position (_datastate) in shared memory: DataLoader workers (persistent ones
        # too) read the position the main process set, at each iteration.
        self._position = multiprocessing.RawArray("q", list(Position(0)))
        self._figures = EpochFigures()
        self._figures.begin(0)
        self._count_yielded()
        self._last: DatasetStats | None = None
        self._conn: _Connection | None = None
        # Compact, and mapped from cache_dir when listed: one copy per node, not per process.
        self._keys = (
            self._listing() if keys is None else KeyIndex.from_keys(_check_keys(keys, self._url))
        )
        if not self._keys:
            raise InvalidArgument(f"{self._url} holds no objects to read")
        track(self)  # listed by asyncstore.metrics.snapshot() while it lives
        # DataLoader workers' figures, for it
        self._worker_figures = WorkerFigures(self, DatasetStats)

    # -- the plan ----------------------------------------------------------------------------

    def _listing(self) -> KeyIndex:
        async def listed(start_after: str) -> AsyncIterator[str]:
            async with open_store(self._url, **self._options) as store:
                async for info in store.list(start_after=start_after):
                    try:
                        yield check_key(info.key, self._url)
                    except InvalidKey as exc:
                        # A local file whose name is not UTF-8, say: it could not be read.
                        raise InvalidKey(
                            f"listing {self._url}: {exc}; rename that object, or pass "
                            "keys=[...] without it"
                        ) from None

        async def list_all() -> KeyIndex:
            return KeyIndex.from_keys(sorted([key async for key in listed("")]))

        if self._cache_dir is None:
            return run_sync(list_all())
        # Named by what is listed: the URL, and the endpoint when one is set (the same
        # bucket name on two servers is two datasets).
        source = f"{self._url}\0{self._options.get('endpoint_url') or ''}"
        digest = xxhash.xxh3_64_hexdigest(source.encode())
        path = Path(self._cache_dir) / f"keys-{digest}.idx"
        old = Path(self._cache_dir) / f"listing-{xxhash.xxh3_64_hexdigest(self._url.encode())}.json"
        if old.exists() and not path.exists():
            # Earlier versions kept it as JSON: converted once rather than listed again (a
            # file that does not read as a list of keys is dropped, and the source listed).
            with contextlib.suppress(OSError, ValueError):
                kept = json.loads(old.read_text())
                if isinstance(kept, list) and kept:
                    write_index(path, _check_keys(kept, self._url))
            old.unlink(missing_ok=True)
        try:
            return run_sync(build_index(path, listed))
        except OSError as exc:
            if isinstance(exc, AsyncStoreError):
                raise  # the store's (NotFound, PermissionDenied), not the cache directory's
            # A read-only or full cache directory: the listing is a cache too, and like
            # the disk tier it must not stop a dataset the store can serve.
            logger.warning(
                "could not keep the listing of %s in %s (%s); listed in memory instead",
                self._url,
                self._cache_dir,
                exc,
            )
            return run_sync(list_all())

    def __len__(self) -> int:
        """Samples per epoch for this rank (padded: equal across ranks)."""
        _, world = self._shard()
        return per_rank(len(self._keys), world)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows.

        Raises:
            InvalidArgument: ``epoch`` is not an int from 0 to ``2**31 - 1``.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
            raise InvalidArgument(f"epoch={epoch!r}: pass an int >= 0 and <= {MAX_EPOCH}")
        if epoch != self._epoch:
            self._position[:] = list(Position(epoch))
        self._figures.begin(epoch)
        self._worker_figures.fold()  # the last epoch's exited workers: their files go

    @property
    def url(self) -> str:
        """The source it reads: the store's URL, or the URL or local path given."""
        return self._url

    @property
    def _epoch(self) -> int:
        return int(self._position[0])

    def _here(self) -> Position:
        """The position the next iteration starts from (of the current epoch)."""
        return Position(*map(int, self._position))

    def _shard(self) -> tuple[int, int]:
        if self._rank is not None and self._world is not None:
            return self._rank, self._world
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _order(self, epoch: int) -> EpochOrder:
        rank, world = self._shard()
        return EpochOrder(
            len(self._keys),
            seed=self._seed,
            epoch=epoch,
            shuffle=self._shuffle,
            rank=rank,
            world=world,
        )

    def plan(self, epoch: int | None = None) -> list[str]:
        """This rank's keys for ``epoch`` (default: the current one), in stream order.

        The whole list, for inspection and tests: iterating the dataset computes the plan a
        slice at a time instead (see ``docs/datasets.md``, "Ten million samples").
        """
        epoch = self._epoch if epoch is None else epoch
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgument(f"epoch={epoch!r}: pass an int >= 0")
        # A re-sharded epoch's stream begins where the world that saved it stopped.
        start = self._here().start if epoch == self._epoch else 0
        parts = stream_slices(self._order(epoch), start, 0, 1, 0, 1)
        return [key for part in parts for key in self._keys.take(part)]

    # -- resume ------------------------------------------------------------------------------

    def state_dict(self, consumed: int | None = None) -> dict[str, int]:
        """The position to resume from: the epoch, and how much of it this rank consumed,
        with what that position depends on. The same dict on every rank of a DDP job (all
        ranks step together), so it can be saved once for the whole job.

        With ``num_workers=0`` the dataset counts ``consumed`` itself; with workers, pass
        it (batches consumed times batch size) from the training loop: the samples of this
        rank's stream of the epoch consumed, counted from the epoch's start, or from
        where :meth:`load_state_dict` resumed it (``state_dict()["consumed"]`` right after
        the load).

        The dict holds ints only (``shuffle`` a bool): ``version`` (3), ``epoch``,
        ``start`` (samples of the epoch's order the job had consumed when this rank's
        stream began: 0 but after a resume at another world size), ``consumed``,
        ``world_size``, and the plan it counts in: ``seed``, ``shuffle``, ``samples`` (the
        dataset's keys) and ``key_digest`` (a 63-bit digest of them, in order). It does
        not depend on the rank or the DataLoader's number of workers.

        Raises:
            InvalidArgument: ``consumed`` is not an int from 0 to this rank's stream's
                length (``len(self)`` in an epoch not resumed at another world size), or
                not a multiple of ``batch_size``; or the position was loaded at another
                world size than the dataset now has.
        """
        return make_state(self._here(), consumed, self._yielded, self._facts())

    def load_state_dict(self, state: Mapping[str, object] | Sequence[Mapping[str, object]]) -> None:
        """Resume: the next iteration continues the epoch after what ``state`` consumed,
        at this dataset's world size, which may differ from the one that saved it.

        ``state`` is what :meth:`state_dict` returned, in a dataset over the same keys with
        the same ``seed`` and ``shuffle``; or the list of every rank's states, which must
        agree (then ranks that consumed different counts are refused). At the same world
        size each rank goes on in its own stream and counts on from the saved
        ``consumed``. At another, the samples the old ranks consumed together (the first
        ``start + consumed * world_size`` of the epoch's order, as every rank consumed the
        same count) are done, the rest is split anew among this world's ranks in equal
        streams, and ``consumed`` counts from 0 again (see ``docs/datasets.md``). States of
        the earlier formats load too: format 2 (one per rank) at the same world size on
        its own rank only, or at another on any rank; the first format as this rank's.

        Raises:
            InvalidArgument: ``state`` is not such a state: an entry missing or unknown, not
                an int, negative, beyond ``2**31 - 1`` (``epoch``) or the saved epoch's
                stream (``consumed``), ``consumed`` not a multiple of ``batch_size`` (same
                world size); saved by a dataset that differs in keys, seed or shuffle, or by
                another rank (format 2, same world size); every rank's states that
                disagree; or a state of another world size loaded before the process group
                is set up. The message names the entry, the values and what to do.
        """
        position = read_state(state, self._facts())
        self._position[:] = list(position)
        self._count_yielded()
        self._figures.begin(position.epoch)

    def _facts(self) -> Facts:
        rank, world = self._shard()
        known = self._world is not None or (dist.is_available() and dist.is_initialized())
        return Facts(
            seed=self._seed,
            shuffle=self._shuffle,
            samples=len(self._keys),
            key_digest=self._key_digest(),
            rank=rank,
            world=world,
            batch=self._batch,
            shard_known=known,
        )

    def _key_digest(self) -> int:
        # The index's own checksums (of the offsets and of the keys' bytes), taken when it
        # was made or opened: a digest of ten million keys at no cost. Cut to 63 bits, so
        # it fits wherever a state is kept as int64.
        offsets, blob = self._keys.digest
        return xxhash.xxh3_64_intdigest(b"%d:%d" % (offsets, blob)) >> 1

    # -- iteration ---------------------------------------------------------------------------

    def _worker_keys(self, epoch: int) -> Iterator[str]:
        # Lazily, a slice at a time: the first batch does not wait for the epoch's plan, and
        # no process holds all of it.
        info = get_worker_info()
        # Workers take whole batches in turn, as the DataLoader asks them for batches in turn:
        # with batch_size matching the DataLoader's, the stream keeps the plan's order.
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        here = self._here()
        check_world(here, self._shard()[1])
        slices = stream_slices(
            self._order(epoch), here.start, here.skip, self._batch, worker, workers
        )
        take = self._keys.take
        for part in slices:
            # Decoded a few hundred keys at a time: the first batch waits for its own keys,
            # not for a whole slice's (up to 2**18 of them).
            for start in range(0, len(part), _DECODE):
                yield from take(part[start : start + _DECODE])

    def __iter__(self) -> Iterator[T]:
        # Runs at the first next(): the caller is then the DataLoader's fetcher, if any.
        self._check_loader_batch(sys._getframe(1))
        epoch = self._epoch
        keys = self._worker_keys(epoch)
        self._count_yielded()
        conn = self._connection()
        session = run_sync(conn.start(keys, self._lookahead, self._max_inflight))
        published = self._worker_figures.iteration(conn.store, conn.cache, session.prefetcher)
        try:
            # A DataLoader uses nothing before it has a whole batch: wait for one per trip
            # (or a full trip) rather than make several trips for a few items each, which
            # in a cold epoch cost more CPU than the samples' own handling.
            least = min(self._batch, _BATCH)
            decode = self._decode
            while True:
                items = session.next_batch(_BATCH, least)
                published.tick()
                if not items:
                    break
                # Handed out by starmap or map, in C: no bytecode per sample here (the
                # loop it replaced cost the consumer's thread about 0.15 us a sample). What
                # was yielded so far is read from the batch's iterator when asked.
                pairs = iter(items)
                self._handing = (len(items), pairs)
                if decode is None:
                    yield from map(_second, pairs)
                else:
                    yield from starmap(decode, pairs)
                self._yielded_before += len(items)
                self._handing = None
        finally:
            self._last = stats = run_sync(session.close())
            info = get_worker_info()
            worker = None if info is None else info.id
            self._figures.add(epoch, worker, figures(stats, session.before))
            published.end(stats)

    def _count_yielded(self) -> None:
        # Count the samples this process's iteration hands out from zero.
        self._yielded_before = 0  # in the batches handed out whole
        self._handing = None

    @property
    def _yielded(self) -> int:
        # Samples handed out by this process's iteration so far: those of whole batches,
        # and what the iterator over the batch being handed out has given (an item taken
        # from it is yielded before the consumer can ask).
        if self._handing is None:
            return self._yielded_before
        size, pairs = self._handing
        return self._yielded_before + size - length_hint(pairs)

    def _check_loader_batch(self, caller: FrameType | None) -> None:
        # Workers take whole batches of the dataset's batch_size in turn, while the
        # DataLoader takes batches of its own from each worker in turn: with two workers or
        # more, unequal sizes interleave the workers' streams out of the plan's order, and a
        # position counted in the loader's batches resumes somewhere else. Nothing fails, so
        # say it, once per DataLoader (from its first worker).
        info = get_worker_info()
        if info is None or info.num_workers < 2 or info.id != 0:
            return
        loader = _loader_batch(caller)
        if loader is None or loader == self._batch:
            return
        warnings.warn(
            f"StreamingDataset(batch_size={self._batch}) is read by a DataLoader with "
            f"batch_size={loader} and {info.num_workers} workers: its samples come out in "
            "a different order from ds.plan(), and a state_dict() saved from this loop does "
            "not resume exactly. Pass the DataLoader's batch size to the dataset: "
            f"StreamingDataset(..., batch_size={loader}).",
            UserWarning,
            stacklevel=2,
        )

    def _connection(self) -> _Connection:
        # One store and cache per process, kept across epochs (the memory tier stays warm
        # with persistent_workers=True), made anew in every worker: a live client never
        # crosses a process boundary.
        conn = self._conn
        if conn is None or conn.pid != os.getpid():
            conn = self._conn = run_sync(self._open())
        return conn

    async def _open(self) -> _Connection:
        store = open_store(self._url, **self._options)
        await store.__aenter__()
        cache = TieredCache(
            store,
            memory_bytes=self._memory_bytes,
            disk_dir=self._cache_dir,
            disk_bytes=self._disk_bytes if self._cache_dir is not None else None,
            policy=self._policy,
        )
        await cache.__aenter__()
        return _Connection(store, cache)

    def close(self) -> None:
        """Close this process's store and cache (they reopen if the dataset is iterated)."""
        conn, self._conn = self._conn, None
        if conn is not None and conn.pid == os.getpid():
            run_sync(conn.close())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_conn"] = None  # never pickle a live client into a worker
        state["_yielded_before"], state["_handing"] = self._yielded, None
        if self._rank is None and dist.is_available() and dist.is_initialized():
            # A spawned DataLoader worker (spawn, forkserver) starts without this process's
            # group: it would read the whole dataset as rank 0 of 1. The copy keeps the
            # shard the group gives here; a forked worker inherits the group itself.
            state["_rank"], state["_world"] = dist.get_rank(), dist.get_world_size()
        return state

    def stats(self) -> DatasetStats | None:
        """Figures of the last iteration in this process (None before one ran)."""
        return self._last

    def totals(self) -> EpochTotals:
        """Figures of every iteration since the dataset was made, summed over all processes
        (DataLoader workers included): every epoch together. See :meth:`epoch_stats` for
        one epoch's."""
        return self._figures.totals()

    def epoch_stats(self, epoch: int | None = None) -> EpochTotals:
        """One epoch's figures (default: the current one), summed over all processes.

        Call it in the training process after the epoch's loop: every DataLoader worker
        has added its part when its iteration ended. The figures count every iteration of
        ``epoch`` since :meth:`set_epoch` (or :meth:`load_state_dict`) made it current,
        after an epoch with other figures.

        Raises:
            InvalidArgument: ``epoch`` is not one of the last 8 epochs made current.
        """
        epoch = self._epoch if epoch is None else epoch
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgument(f"epoch={epoch!r}: pass an int >= 0")
        return self._figures.epoch(epoch, self._epoch)


def _loader_batch(caller: FrameType | None) -> int | None:
    """The batch size of the DataLoader whose fetcher is ``caller``, or None if it is not one.

    The DataLoader hands its batch size to no dataset, and a worker cannot reach the
    DataLoader; but its fetcher asks the dataset for one batch at a time, holding that
    batch's indices (one per sample) in ``possibly_batched_index``.
    """
    if caller is None or _IterableDatasetFetcher is None:
        return None
    fetcher = caller.f_locals.get("self")
    if not isinstance(fetcher, _IterableDatasetFetcher):
        return None  # iterated by hand, or by another loader
    if not fetcher.auto_collation:
        return 1  # batch_size=None: the DataLoader takes one sample at a time
    indices = caller.f_locals.get("possibly_batched_index")
    return len(indices) if isinstance(indices, Sized) else None


class _Connection:
    """A process's store and cache, living on its background loop."""

    def __init__(self, store: Store, cache: TieredCache) -> None:
        self.store, self.cache = store, cache
        self.pid = os.getpid()

    async def start(
        self, keys: Iterable[str], lookahead: int | Literal["auto"], inflight: int
    ) -> _Session:
        prefetcher = RowPrefetcher(self.cache, keys, lookahead=lookahead, max_inflight=inflight)
        reader = self.cache.row_reader()
        prefetcher.rows = reader is not None
        before = self.cache.stats()  # the iteration's cache figures are counted from here
        await prefetcher.__aenter__()
        return _Session(self.cache, prefetcher, reader, before)

    async def close(self) -> None:
        await self.cache.aclose()
        await self.store.aclose()


class _Session:
    """One epoch's prefetcher over a process's cache, with the next batch staged ahead.

    The consumer (the training loop or a DataLoader worker, on its own thread) takes a
    staged batch without a trip to the loop: a trip wakes two threads, about 0.3 ms on a
    small VM (5 µs a sample at 64 samples), more than a warm sample's own handling. The loop
    stages the next batches from the items ready now (``take_rows_nowait`` never waits for a
    fetch, so the prefetcher's waits and stalls stay the consumer's own), up to 4 batches or
    64 MiB. Only when nothing is staged does the consumer make a trip and wait; it wakes the
    loop to stage the next batches once it has its own, not before: the first batch of a
    warm epoch from the disk tier came 6.7-6.9 ms after the epoch's start, not 8.1 (two
    thirds of the trip was the staging of the three batches after it).

    The consumer wakes the loop when one staged batch is left, and the loop stages the three
    taken since, in one turn: no task, no await. Each wake-up costs the consumer a write to
    the loop's socket and the GIL handed over and back (the kernel's wake-ups took 6% of its
    CPU time, per ``perf``, with a wake-up a batch), and each further turn of the loop had
    taken the GIL from it again: a wake-up was four turns when staging ran as tasks.
    Measured on warm epochs served from memory (2 cores, 0 workers, alternating processes):
    0.90-0.95x an in-memory list, against 0.82-0.91x with a wake-up a batch and staging as
    tasks. A batch with rows to hand back wakes the loop at once: the consumer's reads let
    the loop in mid-batch, and it then waits for the loop's turn, which three batches' rows
    (looked up, counted, promoted to memory) made long: with 2 workers, epochs from the disk
    tier ran 10-20% slower when their rows waited for a wake-up every fourth batch.

    Warm disk-tier hits come in the batches as rows (where each lies), which the consumer
    reads itself with a :class:`~asyncstore.cache.RowReader`, as a plain file read would
    be; the bytes go back to the loop with the next wake-up, to be counted and promoted to
    memory. On the loop, each read had made the two threads hand the GIL to each other at
    every system call. A row not read (page cache cold, evicted since, damaged) is got the
    regular way, and the loop reads ahead itself for the rest of the iteration.
    """

    def __init__(
        self,
        cache: TieredCache,
        prefetcher: RowPrefetcher,
        reader: RowReader | None,
        before: CacheStats,
    ) -> None:
        self.cache, self.prefetcher, self.before = cache, prefetcher, before
        self.samples = 0
        self._loop = asyncio.get_running_loop()
        # Batches, whose warm disk hits are rows the consumer reads (appended on the loop).
        self._staged: deque[list[tuple[str, bytes | DiskRow]]] = deque()
        self._reader = reader  # the consumer's, for the rows
        self._settling: deque[list[tuple[DiskRow, bytes]]] = deque()  # rows read, to count
        self._failed: BaseException | None = None  # raised by the consumer's next call
        self._taking = asyncio.Lock()  # one take at a time: batches keep the plan's order
        self._most = _BATCH
        self._error: Exception | None = None  # staging's: raised once the batches before it go
        # Set by the consumer when it wakes the loop, cleared by the loop when it wakes: no
        # second wake-up while one is on its way (each costs a write to the loop's socket).
        self._waking = False

    def next_batch(self, most: int, least: int) -> list[tuple[str, bytes]]:
        """The next items, at least ``least`` unless the plan ends (from the consumer's
        thread); ``[]`` at the end of the plan."""
        self._most = most
        if self._failed is not None:  # a row's regular read failed: after what came before it
            failed, self._failed = self._failed, None
            raise failed
        try:
            taken = self._staged.popleft()
        except IndexError:
            taken = run_sync(self._take(most, least))
        items = self._read_rows(taken)
        if (self._settling or len(self._staged) <= _RESTAGE_AT) and not self._waking:
            # The loop stages the next batches meanwhile, and counts the rows read.
            self._waking = True
            self._loop.call_soon_threadsafe(self._woken)
        self.samples += len(items)
        return items

    def _read_rows(self, taken: list[tuple[str, bytes | DiskRow]]) -> list[tuple[str, bytes]]:
        # On the consumer's thread: the bytes of the batch's rows, read here as a plain file
        # read would be; a row that cannot be read so is got the regular way, on the loop.
        reader = self._reader
        if reader is None or not any(type(value) is DiskRow for _, value in taken):
            return cast("list[tuple[str, bytes]]", taken)
        items: list[tuple[str, bytes]] = []
        read: list[tuple[DiskRow, bytes]] = []
        missing: list[int] = []
        for key, value in taken:
            if not isinstance(value, DiskRow):
                items.append((key, value))
                continue
            data = reader.read(value)
            if data is None:
                missing.append(len(items))
            else:
                read.append((value, data))
            items.append((key, b"" if data is None else data))
        if read:
            self._settling.append(read)
        if missing:
            # Not in the page cache, evicted since, damaged: got the regular way while the
            # consumer waits. The loop reads ahead itself again for the rest of the
            # iteration, as it would have read these.
            self.prefetcher.rows = False
            got = run_sync(self._get_each([items[i][0] for i in missing]))
            for i, result in zip(missing, got, strict=True):
                if isinstance(result, BaseException):
                    # As the prefetcher does: what came before the failed key first (if
                    # anything: [] would end the plan), its error at the next call.
                    if i == 0:
                        raise result
                    self._failed = result
                    return items[:i]
                items[i] = (items[i][0], result)
        return items

    async def _get_each(self, keys: list[str]) -> list[bytes | BaseException]:
        # A window's worth of rows may come back unread (a cold page cache): read as many
        # at once as the prefetcher fetches, each result or error in the keys' order.
        limit = asyncio.Semaphore(self.prefetcher.config.max_inflight)

        async def get(key: str) -> bytes:
            async with limit:
                return await self.cache.get(key)

        return await asyncio.gather(*map(get, keys), return_exceptions=True)

    def _settle(self) -> None:
        # On the loop: count the rows the consumer read, and promote their bytes to memory.
        while self._settling:
            self.cache.settle(self._settling.popleft())

    def _woken(self) -> None:
        # On the loop: the consumer took a batch. A wake-up it sends from now on is a new one.
        self._waking = False
        self._settle()
        self._stage()

    async def _take(self, most: int, least: int) -> list[tuple[str, bytes | DiskRow]]:
        self._settle()
        async with self._taking:
            # A batch staged while this call waited for the lock comes first.
            if self._staged:
                return self._staged.popleft()
            if self._error is not None:
                raise self._error
            return await self.prefetcher.take_rows(most, least=least)

    def _stage(self) -> None:
        # On the loop, in one go: stage the next batches from the items ready now, up to
        # _STAGED batches or _STAGED_BYTES, unless a take is under way (batches keep the
        # plan's order). No task and no await: a wake-up is one turn of the loop, which
        # takes the GIL once (each turn took it from the consumer again).
        if self._taking.locked() or self.prefetcher.closed:
            return
        staged = 0  # bytes staged by this call (the consumer takes from the deque meanwhile)
        while len(self._staged) < _STAGED and staged < _STAGED_BYTES and self._error is None:
            try:
                items = self.prefetcher.take_rows_nowait(self._most)
            except Exception as exc:  # a callback's error would reach no one: the consumer's
                self._error = exc
                return
            if not items:
                return
            self._staged.append(items)
            staged += sum(map(len, map(_second, items)))

    async def close(self) -> DatasetStats:
        self._staged.clear()
        self._settle()
        if self._reader is not None:
            self._reader.close()
        await self.prefetcher.aclose()
        # Another worker may read in the next epoch what this one fetched at the end of
        # this one: put it on the shared disk tier before the epoch counts as done.
        await self.cache.flush()
        return DatasetStats(
            samples=self.samples, prefetch=self.prefetcher.stats(), cache=self.cache.stats()
        )
