"""A StreamingDataset position saved at one world size resumes exactly once at another.

"Exactly once" for an epoch interrupted and resumed, stated precisely (docs/datasets.md,
"Resuming with another number of ranks"): every sample of the epoch is read by some rank
before or after the restarts, and the only samples read twice are the padding of the last
streams, those that reached the epoch's end: ``ceil(R / W) * W - R`` reads (fewer than
``W``, that world's size; ``R`` the samples left to it), which repeat the epoch's first
samples, one at the end of each of its last ranks. Every rank of a world reads as many
samples as every other (DDP needs it).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from asyncstore import InvalidArgument
from asyncstore.torch import StreamingDataset
from asyncstore.torch._datastate import (
    Facts,
    Position,
    make_state,
    read_state,
    stream_length,
    stream_slices,
)
from asyncstore.torch._order import EpochOrder
from asyncstore.torch._shard import per_rank

from ..helpers import SAMPLE_KEYS, SAMPLES, key_of
from .helpers import closed_after_test

BATCH = 4
T = TypeVar("T")


def expected_reads(everything: list[T], order_of: list[T], reads: int) -> collections.Counter[T]:
    """Each sample once, plus the padding: the epoch's first ``reads - len(everything)``
    samples of ``order_of`` (the epoch's order) once more."""
    pad = reads - len(everything)
    assert pad >= 0
    return collections.Counter(everything) + collections.Counter(
        order_of[i % len(order_of)] for i in range(pad)
    )


# -- the arithmetic, over every size --------------------------------------------------------


def facts(count: int, rank: int, world: int, batch: int) -> Facts:
    return Facts(
        seed=5,
        shuffle=True,
        samples=count,
        key_digest=0,
        rank=rank,
        world=world,
        batch=batch,
        shard_known=True,
    )


def worker_stream(order: EpochOrder, position: Position, batch: int, workers: int) -> list[int]:
    """The rank's stream as a DataLoader hands it over: a batch from each worker in turn."""
    parts = [
        [
            i
            for part in stream_slices(order, position.start, position.skip, batch, w, workers)
            for i in part
        ]
        for w in range(workers)
    ]
    out: list[int] = []
    turn = 0
    while any(parts):
        worker = turn % workers
        out += parts[worker][:batch]
        parts[worker] = parts[worker][batch:]
        turn += 1
    return out


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(1, 200),
    worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    batches=st.lists(st.integers(1, 8), min_size=4, max_size=4),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    workers=st.integers(1, 3),
)
def test_the_union_over_every_world_is_the_epoch_once_but_the_last_padding(
    count: int, worlds: list[int], batches: list[int], fractions: list[float], workers: int
) -> None:
    # One epoch, saved and resumed at each world size of `worlds` in turn (with its own
    # batch size), each world consuming a fraction of its streams before the save.
    seed, epoch = 5, 3
    whole_order = EpochOrder(count, seed=seed, epoch=epoch, shuffle=True, rank=0, world=1)
    order_of = whole_order.rank_indices(0, count).tolist()  # the epoch's order
    reads: list[int] = []
    state: dict[str, int] | None = None
    batch = batches[0]
    ended = 0  # the world size whose streams reached the end of the epoch
    for hop, world in enumerate(worlds):
        # A new world may take a new batch size; the same world goes on in its streams,
        # whose position must be whole batches of its own (see the test below).
        if hop == 0 or world != worlds[hop - 1]:
            batch = batches[hop]
        last = hop == len(worlds) - 1
        streams = []
        for rank in range(world):
            here = facts(count, rank, world, batch)
            position = Position(epoch) if state is None else read_state(state, here)
            assert position.epoch == epoch
            order = EpochOrder(count, seed=seed, epoch=epoch, shuffle=True, rank=rank, world=world)
            streams.append((position, worker_stream(order, position, batch, workers)))
        lengths = {len(stream) for _, stream in streams}
        assert len(lengths) == 1  # every rank of a world reads as much as every other
        length = lengths.pop()
        position = streams[0][0]
        assert length == stream_length(count, position.start, world) - position.skip
        if last:
            reads += [index for _, stream in streams for index in stream]
            ended = world if length else ended
            break
        # Every rank stops after the same number of whole batches, and saves.
        stop = round(fractions[hop] * length) // batch * batch
        ended = world if length and stop == length else ended
        reads += [index for _, stream in streams for index in stream[:stop]]
        states = [
            make_state(pos, pos.skip + stop, 0, facts(count, rank, world, batch))
            for rank, (pos, _) in enumerate(streams)
        ]
        assert all(each == states[0] for each in states)  # one dict for the whole job
        state = states[0]
    assert collections.Counter(reads) == expected_reads(list(range(count)), order_of, len(reads))
    assert len(reads) - count < ended  # fewer repeats than that world has ranks


def test_a_save_at_the_end_of_the_epoch_leaves_nothing_to_read() -> None:
    state = make_state(Position(0), per_rank(SAMPLES, 2), 0, facts(SAMPLES, 0, 2, 1))
    for world in (1, 2, 3):
        position = read_state(state, facts(SAMPLES, 0, world, 1))
        order = EpochOrder(SAMPLES, seed=5, epoch=0, shuffle=True, rank=0, world=world)
        assert worker_stream(order, position, 1, 1) == []


# -- datasets, read through DataLoader workers ---------------------------------------------


def dataset(dataset_dir: Path, rank: int, world: int, **options: Any) -> StreamingDataset[str]:
    made: StreamingDataset[str] = StreamingDataset(
        dataset_dir,
        keys=SAMPLE_KEYS,
        shuffle=True,
        seed=3,
        decode=key_of,
        rank=rank,
        world_size=world,
        batch_size=options.pop("batch_size", BATCH),
        cache_dir=dataset_dir.parent / "cache",
        **options,
    )
    return closed_after_test(made)


def loader_keys(
    ds: StreamingDataset[str], batch: int, stop: int | None = None, workers: int = 2
) -> list[str]:
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, multiprocessing_context="fork")
    keys: list[str] = []
    for step, got in enumerate(loader):
        if step == stop:
            break
        keys += got
    return keys


def whole_order(dataset_dir: Path, epoch: int) -> list[str]:
    return dataset(dataset_dir, 0, 1).plan(epoch)


def run_world(
    dataset_dir: Path,
    world: int,
    state: dict[str, int] | None,
    stop: int | None,
    batch: int = BATCH,
) -> tuple[list[list[str]], dict[str, int] | None]:
    """Every rank of ``world`` reads epoch 1 through a DataLoader with two workers, from
    ``state`` (None: the epoch's start), for ``stop`` batches (None: to the end); their
    streams, and the state they save (the same on every rank)."""
    streams, states = [], []
    for rank in range(world):
        ds = dataset(dataset_dir, rank, world, batch_size=batch)
        if state is None:
            ds.set_epoch(1)
        else:
            ds.load_state_dict(state)
            ds.set_epoch(1)  # the usual loop sets the loaded epoch: the position holds
        assert ds.state_dict()["epoch"] == 1
        first = ds.state_dict()["consumed"]
        keys = loader_keys(ds, batch, stop)
        assert keys == ds.plan()[first : first + len(keys)]  # in the stream's order
        streams.append(keys)
        if stop is not None:
            states.append(ds.state_dict(consumed=first + len(keys)))
    assert len({len(stream) for stream in streams}) == 1  # equal lengths for DDP
    if states:
        assert all(each == states[0] for each in states)
        return streams, states[0]
    return streams, None


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_a_job_resumes_at_another_world_size_reading_each_sample_once(
    dataset_dir: Path, before: int, after: int
) -> None:
    order = whole_order(dataset_dir, 1)
    first, state = run_world(dataset_dir, before, None, stop=3)
    assert state is not None
    assert state["world_size"] == before
    assert [len(stream) for stream in first] == [3 * BATCH] * before
    # What the old world read is the first 3 * BATCH * before samples of the epoch.
    assert sorted(k for s in first for k in s) == sorted(order[: 3 * BATCH * before])
    rest, _ = run_world(dataset_dir, after, state, stop=None)
    left = SAMPLES - 3 * BATCH * before
    assert [len(stream) for stream in rest] == [-(-left // after)] * after
    reads = [k for s in first + rest for k in s]
    assert collections.Counter(reads) == expected_reads(SAMPLE_KEYS, order, len(reads))
    # The next epoch is whole again, at the new world size.
    nxt = dataset(dataset_dir, 0, after)
    nxt.set_epoch(2)
    assert len(nxt.plan()) == len(nxt) == per_rank(SAMPLES, after)


def test_a_resumed_job_resumes_again_at_a_third_world_size(dataset_dir: Path) -> None:
    order = whole_order(dataset_dir, 1)
    first, state = run_world(dataset_dir, 2, None, stop=2)
    assert state is not None
    second, state = run_world(dataset_dir, 3, state, stop=1, batch=2)
    assert state is not None
    assert (state["start"], state["consumed"], state["world_size"]) == (2 * BATCH * 2, 2, 3)
    third, _ = run_world(dataset_dir, 1, state, stop=None)
    assert [len(stream) for stream in third] == [SAMPLES - 16 - 6]
    reads = [k for s in first + second + third for k in s]
    assert sorted(reads) == SAMPLE_KEYS  # each once: one rank last, so no padding
    assert order[:16] == sorted(first[0] + first[1], key=order.index)


def test_every_ranks_states_are_checked_for_equal_counts(dataset_dir: Path) -> None:
    ds = [dataset(dataset_dir, rank, 2) for rank in range(2)]
    for each in ds:
        each.set_epoch(1)
    states = [ds[0].state_dict(consumed=8), ds[1].state_dict(consumed=4)]
    one = dataset(dataset_dir, 0, 1)
    with pytest.raises(InvalidArgument) as caught:
        one.load_state_dict(states)
    message = str(caught.value)
    assert "saved after different counts (consumed=[8, 4], by rank)" in message
    assert "ds.set_epoch(1)" in message
    # Agreeing states load as one (the first stands for them all).
    states[1] = ds[1].state_dict(consumed=8)
    one.load_state_dict(states)
    assert one.state_dict()["start"] == 16
    assert read_all(one) == whole_order(dataset_dir, 1)[16:]
    # States of the second format name their rank: each rank's, each once.
    old = [
        {k: v for k, v in state.items() if k != "start"} | {"version": 2, "rank": rank}
        for rank, state in enumerate(states)
    ]
    with pytest.raises(InvalidArgument, match=r"states of ranks \[0, 0\] .*each once"):
        one.load_state_dict([old[0], old[0]])
    again = dataset(dataset_dir, 1, 2)
    again.load_state_dict(old)  # the same world: rank 1 goes on in its own stream
    assert again.state_dict()["consumed"] == 8
    with pytest.raises(InvalidArgument, match=r"differ in 'epoch' \(\[1, 0\], by rank\)"):
        one.load_state_dict([states[0], dict(states[1], epoch=0)])


def read_all(ds: StreamingDataset[str]) -> list[str]:
    stream = iter(ds)
    try:
        return list(stream)
    finally:
        stream.close()  # type: ignore[attr-defined]


def test_a_state_of_the_second_format_resumes_at_another_world_size(dataset_dir: Path) -> None:
    # What the last release saved, one state per rank: any rank's stands for the job's.
    order = whole_order(dataset_dir, 1)
    saved = dataset(dataset_dir, 1, 2).state_dict(consumed=12)
    old = {k: v for k, v in saved.items() if k != "start"} | {"version": 2, "rank": 1}
    old["epoch"] = 1
    ds = dataset(dataset_dir, 0, 1)
    ds.load_state_dict(old)
    assert read_all(ds) == order[24:]


def test_consumed_is_checked_against_the_saved_worlds_stream(dataset_dir: Path) -> None:
    state = dataset(dataset_dir, 0, 2).state_dict(consumed=28)
    with pytest.raises(InvalidArgument) as caught:
        dataset(dataset_dir, 0, 3).load_state_dict(dict(state, consumed=32 + BATCH))
    assert "state['consumed']=36: pass an int >= 0 and <= 31 (each of the 2 ranks' stream" in str(
        caught.value
    )
    # After a resume at another world size the rank's stream is the rest of the epoch.
    ds = dataset(dataset_dir, 0, 3)
    ds.load_state_dict(state)
    assert ds.state_dict()["consumed"] == 0
    with pytest.raises(InvalidArgument, match=r"consumed=8: .*<= 2 \(this rank's stream of the"):
        ds.state_dict(consumed=8)


def test_the_same_world_size_with_another_batch_size_needs_whole_batches(dataset_dir: Path) -> None:
    state = dataset(dataset_dir, 0, 2, batch_size=4).state_dict(consumed=12)
    with pytest.raises(InvalidArgument, match="consumed=12 is not a multiple of batch_size=8"):
        dataset(dataset_dir, 0, 2, batch_size=8).load_state_dict(state)
    # At another world size the stream begins anew: any batch size goes.
    dataset(dataset_dir, 0, 3, batch_size=8).load_state_dict(state)
