"""StreamingDataset with a real DataLoader: sharding, epochs, workers, fork/spawn, resume."""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import pytest
from torch.utils.data import DataLoader

from asyncstore import InvalidArgument, NotFound
from asyncstore._concurrency import TaskSet
from asyncstore.testing import belady_hits
from asyncstore.torch import StreamingDataset

from ..helpers import SAMPLE_KEYS, SAMPLES, key_of
from .helpers import closed_after_test


def epoch_keys(ds: StreamingDataset[str], workers: int, context: str = "fork") -> list[str]:
    loader = DataLoader(
        ds,
        batch_size=4,
        num_workers=workers,
        multiprocessing_context=context if workers else None,
    )
    return [key for batch in loader for key in batch]


# 3 workers per rank as the issue asks; DataLoader warns that this machine has 2 CPUs.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_every_sample_once_per_epoch_across_ranks_and_workers(
    dataset_dir: Path, tmp_path: Path
) -> None:
    everything = set(SAMPLE_KEYS)
    orders = []
    for epoch in range(2):
        seen: list[str] = []
        for rank in range(2):
            ds = StreamingDataset(
                dataset_dir,
                cache_dir=tmp_path / "cache",
                shuffle=True,
                seed=7,
                decode=key_of,
                rank=rank,
                world_size=2,
                batch_size=4,
            )
            ds.set_epoch(epoch)
            keys = epoch_keys(ds, workers=3)
            assert len(keys) == len(ds) == 31  # equal lengths: ceil(61 / 2)
            assert keys == ds.plan()  # batch_size matches the loader: the plan's order
            assert ds.totals().samples == 31  # summed over the three worker processes
            seen += keys
        assert set(seen) == everything
        counts = collections.Counter(seen)
        assert sorted(counts.values()) == [1] * (SAMPLES - 1) + [2]  # one padded repeat
        orders.append(seen)
    assert orders[0] != orders[1]  # another epoch, another order
    again = StreamingDataset(
        dataset_dir, shuffle=True, seed=7, decode=key_of, rank=0, world_size=2, batch_size=4
    )
    assert again.plan(0) == orders[0][:31]  # same seed, same order


def test_listing_is_kept_in_the_cache_dir(dataset_dir: Path, tmp_path: Path) -> None:
    first: StreamingDataset[bytes] = StreamingDataset(dataset_dir, cache_dir=tmp_path / "cache")
    (dataset_dir / "train" / "late.bin").write_bytes(b"x")
    second: StreamingDataset[bytes] = StreamingDataset(dataset_dir, cache_dir=tmp_path / "cache")
    assert second.plan() == first.plan()  # not listed again
    assert len(list((tmp_path / "cache").glob("keys-*.idx"))) == 1


@pytest.mark.parametrize(
    "kept", ["readable", "{not json", '"train/0000.bin"', '{"a": 1}', '["../x", ""]']
)
def test_a_listing_kept_by_an_earlier_version_is_converted_not_listed_again(
    dataset_dir: Path, tmp_path: Path, kept: str
) -> None:
    import json

    import xxhash

    url = str(dataset_dir)
    old = tmp_path / "cache" / f"listing-{xxhash.xxh3_64_hexdigest(url.encode())}.json"
    old.parent.mkdir()
    listed = ["train/0000.bin", "train/gone.bin"]  # as listed then: one since deleted
    old.write_text(json.dumps(listed) if kept == "readable" else kept)
    ds: StreamingDataset[bytes] = StreamingDataset(url, cache_dir=tmp_path / "cache")
    assert not old.exists()
    assert len(list((tmp_path / "cache").glob("keys-*.idx"))) == 1
    if kept == "readable":
        assert sorted(ds.plan()) == listed  # converted: the directory was not listed
    else:
        assert len(ds) == SAMPLES  # not a list of valid keys: listed again


def test_spawn_workers(dataset_dir: Path, tmp_path: Path) -> None:
    ds = StreamingDataset(dataset_dir, cache_dir=tmp_path / "cache", decode=key_of, batch_size=4)
    keys = epoch_keys(ds, workers=2, context="spawn")
    assert keys == ds.plan()


def test_no_workers_and_stats(dataset_dir: Path) -> None:
    ds: StreamingDataset[bytes] = StreamingDataset(dataset_dir, shuffle=True, seed=1)
    samples = list(ds)
    assert len(samples) == SAMPLES
    stats = ds.stats()
    assert stats is not None
    assert stats.samples == SAMPLES
    assert stats.prefetch is not None
    assert stats.prefetch.items == SAMPLES
    state = ds.state_dict()
    assert (state["epoch"], state["consumed"], state["seed"]) == (0, SAMPLES, 1)


def warm_dataset(tmp_path: Path, samples: int) -> StreamingDataset[str]:
    """A dataset of ``samples`` small files (each holding its key) read once: warm."""
    for i in range(samples):
        (tmp_path / "d" / "s").mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / "s" / f"{i:04d}").write_bytes(f"s/{i:04d}".encode())
    ds = closed_after_test(StreamingDataset(tmp_path / "d", decode=key_of))
    assert len(list(ds)) == samples
    return ds


@pytest.mark.parametrize("failing", [3, 8])
def test_an_error_reading_the_plan_reaches_the_consumer_after_the_samples_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    # The key index fails as the plan is read: on the consumer's trip (the 3rd read of keys)
    # or while the loop stages ahead on a wake-up (the 8th). Either way the consumer gets
    # every sample before it, in order, then the error: none lost, no early end.
    from asyncstore.torch import _keyindex

    ds = warm_dataset(tmp_path, 6000)
    reads = 0
    take = _keyindex.KeyIndex.take

    def failing_take(self: Any, part: Any) -> Any:
        nonlocal reads
        reads += 1
        if reads == failing:
            raise OSError("the key index could not be read")
        return take(self, part)

    monkeypatch.setattr(_keyindex.KeyIndex, "take", failing_take)
    ds.set_epoch(1)
    got: list[str] = []
    with pytest.raises(OSError, match="key index could not be read"):
        for key in ds:
            got.append(key)
    # Keys are read 512 at a time: the samples of the reads before the failed one.
    assert got == ds.plan(1)[: 512 * (failing - 1)]


def test_an_error_while_the_loop_stages_reaches_the_consumer_after_the_staged_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Staging runs in a callback on the loop, where an exception would reach no one: the
    # consumer gets it once the batches staged before it are used, in order.
    from asyncstore.cache import RowPrefetcher

    ds = warm_dataset(tmp_path, 1000)
    calls = 0
    take = RowPrefetcher.take_rows_nowait

    def failing(self: RowPrefetcher, most: int) -> Any:
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("the cache broke while staging")
        return take(self, most)

    monkeypatch.setattr(RowPrefetcher, "take_rows_nowait", failing)
    got: list[str] = []
    with pytest.raises(RuntimeError, match="broke while staging"):
        for key in ds:
            got.append(key)
    assert got == ds.plan(0)[: 64 * (1 + 5)]  # the first trip's batch, then five staged


def test_a_warm_epoch_takes_staged_batches_without_trips_to_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the consumer works on a batch, the loop stages the next from the memory tier:
    # the consumer takes it without a trip (each costs two thread wake-ups). Same samples,
    # same order.
    from asyncstore import _loop
    from asyncstore.torch import _dataset

    keys = [f"s/{i:04d}" for i in range(640)]
    for key in keys:
        (tmp_path / "data" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / key).write_bytes(key.encode())
    ds = closed_after_test(StreamingDataset(tmp_path / "data", shuffle=True, decode=key_of))
    assert list(ds) == ds.plan(0)  # cold: fills the memory tier
    trips = 0
    run_sync = _loop.run_sync

    def counted(coro: Any) -> Any:
        nonlocal trips
        trips += 1
        return run_sync(coro)

    monkeypatch.setattr(_dataset, "run_sync", counted)
    # Batches staged by each staging run on the loop.
    runs: list[int] = []
    stage = _dataset._Session._stage

    def staging(self: Any) -> None:
        before = self.samples + sum(map(len, self._staged))
        stage(self)
        if staged := round((self.samples + sum(map(len, self._staged)) - before) / 64):
            runs.append(staged)

    monkeypatch.setattr(_dataset._Session, "_stage", staging)
    # Tasks started on the loop: a warm epoch's wake-ups stage without any, each in one turn
    # of the loop (each turn took the GIL from the consumer again).
    tasks: list[str] = []
    spawn = TaskSet.spawn

    def spawned(self: TaskSet, coro: Any, *, name: str, detached: bool = False) -> Any:
        tasks.append(name)
        return spawn(self, coro, name=name, detached=detached)

    monkeypatch.setattr(TaskSet, "spawn", spawned)
    ds.set_epoch(1)
    got = []
    for number, key in enumerate(ds):
        got.append(key)
        if number % 64 == 63:
            time.sleep(0.005)  # the training step: the next batch is staged meanwhile
    assert got == ds.plan(1)
    # Opening, the first batch, closing (and at most one batch not staged in time), where
    # a trip per batch would make 13.
    assert trips <= 4, trips
    # After the first run fills the stage, the consumer wakes the loop when one batch is
    # left, and each run stages the three taken since: a wake-up every third batch, where
    # one a batch cost the consumer a hand-over of the GIL each.
    assert runs[0] <= _dataset._STAGED, runs
    restaged = _dataset._STAGED - _dataset._RESTAGE_AT
    assert sorted(runs[1:])[len(runs[1:]) // 2] == restaged == 3, runs
    # A trip's take() refills the window in the background: a task per trip at most.
    assert len(tasks) <= trips, (tasks, trips)
    assert set(tasks) <= {"prefetch refill"}, tasks
    stats = ds.stats()
    assert stats is not None
    assert stats.prefetch is not None
    assert (stats.samples, stats.prefetch.items, stats.prefetch.stalls) == (640, 640, 0)


def test_a_missing_sample_fails_at_its_place_after_every_sample_before_it(
    dataset_dir: Path,
) -> None:
    keys = [*SAMPLE_KEYS[:40], "train/gone.bin", *SAMPLE_KEYS[40:]]
    ds = closed_after_test(StreamingDataset(dataset_dir, keys=keys, decode=key_of))
    got: list[str] = []
    with pytest.raises(NotFound, match=r"gone\.bin"):
        for key in ds:
            got.append(key)
    assert got == SAMPLE_KEYS[:40]


def memory_hits(ds: StreamingDataset[bytes], epochs: int) -> int:
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        assert len(list(ds)) == SAMPLES
    stats = ds.stats()
    assert stats is not None
    assert stats.cache is not None
    ds.close()
    return stats.cache.memory.hits


def test_plan_policy_is_optimal_across_epochs(dataset_dir: Path) -> None:
    # Memory for 20 of 61 equal-sized samples, no disk tier, 4 shuffled epochs: every hit
    # comes from the memory tier, which follows each epoch's plan as the prefetcher reads it.
    size = len(b"train/0000.bin")
    settings = {"shuffle": True, "seed": 5, "memory_bytes": 20 * size}
    ds: StreamingDataset[bytes] = StreamingDataset(dataset_dir, **settings)  # type: ignore[arg-type]
    reads = [key for epoch in range(4) for key in ds.plan(epoch)]
    optimum = belady_hits(reads, 20)
    assert memory_hits(ds, 4) == optimum
    lru: StreamingDataset[bytes] = StreamingDataset(
        dataset_dir,
        cache_policy="lru",
        **settings,  # type: ignore[arg-type]
    )
    assert memory_hits(lru, 4) < optimum


RESUME = """
import sys
from torch.utils.data import DataLoader
from asyncstore.torch import StreamingDataset
ds = StreamingDataset(sys.argv[1], shuffle=True, seed=3, batch_size=4, decode=lambda k, d: k)
ds.load_state_dict({"epoch": 1, "consumed": int(sys.argv[2]), "seed": 3})
loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
print("\\n".join(k for batch in loader for k in batch))
"""


def test_resume_mid_epoch_in_a_fresh_process(dataset_dir: Path) -> None:
    ds = StreamingDataset(dataset_dir, shuffle=True, seed=3, batch_size=4, decode=key_of)
    ds.set_epoch(1)
    full = epoch_keys(ds, workers=2)
    consumed = 5 * 4  # five batches done before the job stopped
    state = ds.state_dict(consumed=consumed)
    assert (state["epoch"], state["consumed"], state["seed"]) == (1, 20, 3)
    result = subprocess.run(
        [sys.executable, "-c", RESUME, str(dataset_dir), str(consumed)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.split() == full[consumed:]


def test_bad_arguments(dataset_dir: Path) -> None:
    with pytest.raises(InvalidArgument, match="rank and world_size together"):
        StreamingDataset(dataset_dir, rank=0)
    with pytest.raises(InvalidArgument, match="cache_policy='fifo'"):
        StreamingDataset(dataset_dir, cache_policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not in range"):
        StreamingDataset(dataset_dir, rank=2, world_size=2)
    with pytest.raises(InvalidArgument, match="holds no objects"):
        StreamingDataset(dataset_dir / "nothing-here")
    ds: StreamingDataset[bytes] = StreamingDataset(dataset_dir, batch_size=4)
    with pytest.raises(InvalidArgument, match="not a multiple"):
        ds.load_state_dict({"epoch": 0, "consumed": 3})
    with pytest.raises(InvalidArgument, match="seed"):
        ds.load_state_dict({"epoch": 0, "consumed": 4, "seed": 99})


# Every public argument: a bad value is refused at construction, before any worker starts,
# with the parameter's name in the message.
BAD_DATASET_ARGUMENTS: list[tuple[str, object]] = [
    ("keys", "abc"),
    ("keys", b"abc"),
    ("keys", 5),
    ("keys", []),
    ("keys", ["train/0000.bin", 7]),
    ("keys", ["train/0000.bin", "../escape"]),
    ("cache_dir", 5),
    ("cache_dir", ""),
    ("memory_bytes", 0),
    ("memory_bytes", 1.5),
    ("disk_bytes", -5),
    ("disk_bytes", 0),
    ("disk_bytes", True),
    ("shuffle", "yes"),
    ("seed", 1.5),
    ("seed", None),
    ("decode", "utf-8"),
    ("lookahead", -1),
    ("lookahead", 0),
    ("lookahead", "deep"),
    ("lookahead", 2.5),
    ("max_inflight", 0),
    ("max_inflight", -3),
    ("max_inflight", "32"),
    ("cache_policy", "fifo"),
    ("batch_size", 0),
    ("store_options", ["fsync"]),
]


@pytest.mark.parametrize(("name", "value"), BAD_DATASET_ARGUMENTS)
def test_every_argument_is_checked(
    dataset_dir: Path, tmp_path: Path, name: str, value: object
) -> None:
    kwargs: dict[str, object] = {name: value}
    if name == "disk_bytes":
        kwargs["cache_dir"] = tmp_path / "cache"
    with pytest.raises(InvalidArgument) as caught:
        StreamingDataset(dataset_dir / "train", **kwargs)  # type: ignore[arg-type]
    assert name in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"rank": 0}, "world_size"),
        ({"rank": "0", "world_size": 2}, "rank"),
        ({"rank": -1, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": 0, "world_size": 1.0}, "world_size"),
        ({"disk_bytes": 1 << 20}, "cache_dir"),
        ({"store_options": {"fsync": "yes"}}, "fsync='yes'"),
    ],
)
def test_arguments_checked_together(
    dataset_dir: Path, kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        StreamingDataset(dataset_dir / "train", **kwargs)  # type: ignore[arg-type]
    assert name in str(caught.value)


@pytest.mark.anyio
async def test_store_options_with_an_open_store_are_refused(dataset_dir: Path) -> None:
    import asyncstore

    async with asyncstore.open_store(dataset_dir / "train") as store:
        with pytest.raises(InvalidArgument, match="store_options"):
            StreamingDataset(store, store_options={"fsync": False})


def test_local_store_with_a_percent_in_its_path_reopens_in_workers(tmp_path: Path) -> None:
    import asyncstore

    # Workers reopen the store from what the dataset kept: the path, not the URL shown,
    # whose '%20' would decode to a different directory.
    root = tmp_path / "a%20b"
    root.mkdir()
    (root / "k").write_bytes(b"k")
    store = asyncstore.open_store(root)
    ds: StreamingDataset[str] = StreamingDataset(store, decode=key_of)
    assert list(ds) == ["k"]
    ds.close()


@pytest.mark.parametrize("policy", ["plan", "lru"])
def test_a_second_epoch_fetches_nothing_the_process_already_has(
    tmp_path: Path, policy: Literal["plan", "lru"]
) -> None:
    # A dataset three times the memory tier, read twice back to back: every sample of the
    # second epoch is in memory, on disk, or still on its way there; none is fetched again
    # (each such read is a paid request on S3).
    root = tmp_path / "data"
    blob = bytes(range(256)) * 200  # 51,200 bytes
    for i in range(3000):
        path = root / f"{i // 1000}" / f"{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    ds: StreamingDataset[bytes] = StreamingDataset(
        root,
        cache_dir=tmp_path / "cache",
        memory_bytes=50_000_000,
        disk_bytes=1_000_000_000,
        shuffle=True,
        cache_policy=policy,
    )
    try:
        fetched = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            assert sum(1 for _ in ds) == 3000
            stats = ds.stats()
            assert stats is not None
            assert stats.cache is not None
            fetched.append(stats.cache.store.fetches)
        assert fetched[0] == 3000
        assert fetched[1] == fetched[0], f"epoch 2 fetched {fetched[1] - fetched[0]} again"
    finally:
        ds.close()
