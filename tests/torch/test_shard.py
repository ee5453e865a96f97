"""How an epoch is shared out across ranks and DataLoader workers, and resumed: properties
that hold for any dataset size, world size, worker count, batch size, epoch and seed."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstore.errors import InvalidArgument
from asyncstore.torch import _order, _shard
from asyncstore.torch._order import EpochOrder

# Each example builds every rank's stream from small tensors: a few milliseconds.
quick = settings(max_examples=60, deadline=None)


@dataclass(frozen=True)
class Split:
    """One dataset's split: what a training job chooses."""

    count: int
    world: int
    workers: int
    batch: int
    seed: int
    epoch: int
    shuffle: bool
    slice: int  # positions per group: small ones cross group boundaries within an epoch

    def order(self, rank: int) -> EpochOrder:
        return EpochOrder(
            self.count,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
            rank=rank,
            world=self.world,
        )

    def workers_read(self, rank: int, skip: int = 0) -> list[list[int]]:
        """The dataset indices each worker of ``rank`` reads, from local position ``skip``."""
        order = self.order(rank)
        with mock.patch.object(_order, "SLICE", self.slice):
            return [
                [
                    index
                    for part in order.slices(skip, self.batch, worker, self.workers)
                    for index in part
                ]
                for worker in range(self.workers)
            ]

    def stream(self, rank: int, skip: int = 0) -> list[int]:
        """What ``rank``'s DataLoader yields: one batch from each worker in turn."""
        return self.interleave(self.workers_read(rank, skip))

    def interleave(self, parts: list[list[int]]) -> list[int]:
        out: list[int] = []
        for first in range(0, max(map(len, parts), default=0), self.batch):
            for part in parts:
                out += part[first : first + self.batch]
        return out

    def padded(self, rank: int, local: int) -> bool:
        """Whether ``rank``'s local position ``local`` lies past the end of the epoch."""
        return rank + local * self.world >= self.count

    def epoch_order(self) -> list[int]:
        """The epoch's whole order: the dataset index at each global position."""
        return [int(i) for i in self.order(0).permute(range(self.count))]


@st.composite
def splits(draw: st.DrawFn, least: int = 0) -> Split:
    return Split(
        count=draw(st.integers(least, 100)),
        world=draw(st.integers(1, 8)),
        workers=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 9)),
        seed=draw(st.integers(-(2**70), 2**70)),
        epoch=draw(st.integers(0, 10**6)),
        shuffle=draw(st.booleans()),
        slice=draw(st.sampled_from([4, 16, _order.SLICE])),
    )


@quick
@given(splits())
def test_every_sample_appears_once_per_epoch_before_padding(split: Split) -> None:
    read: list[int] = []
    for rank in range(split.world):
        parts = split.workers_read(rank)
        stream = split.interleave(parts)
        read += [index for local, index in enumerate(stream) if not split.padded(rank, local)]
        # The stream is what the rank's workers read between them, no more and no less.
        assert sorted(stream) == sorted(index for part in parts for index in part)
    assert sorted(read) == list(range(split.count))


@quick
@given(splits())
def test_ranks_get_equal_lengths_in_the_plans_order(split: Split) -> None:
    length = -(-split.count // split.world)
    assert _shard.per_rank(split.count, split.world) == length
    for rank in range(split.world):
        stream = split.stream(rank)
        assert len(stream) == length
        if split.count:
            # The DataLoader's order, workers taking batches in turn, is the rank's plan.
            assert stream == split.order(rank).rank_indices(0, length).tolist()


@quick
@given(splits())
def test_padding_repeats_samples_from_the_start_of_the_epoch(split: Split) -> None:
    repeated = []
    for rank in range(split.world):
        stream = split.stream(rank)
        pads = [local for local in range(len(stream)) if split.padded(rank, local)]
        # At most one per rank, and only its last sample: the rest of the stream is real.
        assert pads in ([], [len(stream) - 1])
        repeated += [stream[local] for local in pads]
    padding = split.world * -(-split.count // split.world) - split.count
    assert len(repeated) == padding < split.world
    # The epoch's first samples, in rank order (cycling, when ranks outnumber samples).
    order = split.epoch_order()
    assert repeated == [order[i % split.count] for i in range(padding)]


@quick
@given(splits(least=1))
def test_an_epochs_order_is_a_permutation_fixed_by_seed_and_epoch(split: Split) -> None:
    order = split.epoch_order()
    assert sorted(order) == list(range(split.count))
    if not split.shuffle:
        assert order == list(range(split.count))
    # Built again, as another process or a restarted job builds it: the same order, and the
    # same stream for every rank and worker.
    again = Split(**vars(split))
    assert again.epoch_order() == order
    for rank in range(split.world):
        assert again.stream(rank) == split.stream(rank)


@quick
@given(splits(), st.data())
def test_resuming_anywhere_in_an_epoch_yields_exactly_the_rest(
    split: Split, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, split.world - 1), label="rank")
    whole = split.stream(rank)
    skip = data.draw(st.integers(0, len(whole) + split.batch), label="skip")
    assert split.stream(rank, skip) == whole[skip:]


@given(
    length=st.integers(0, 300),
    skip=st.integers(0, 300),
    batch=st.integers(1, 16),
    workers=st.integers(1, 6),
    size=st.integers(1, 100),
)
def test_workers_groups_hold_whole_rounds_of_batches(
    length: int, skip: int, batch: int, workers: int, size: int
) -> None:
    # Pure arithmetic, no torch: the groups a worker computes at a time stay bounded, and
    # between them the workers cover local positions skip, skip + 1, ... exactly once.
    covered: list[int] = []
    for worker in range(workers):
        for group in _shard.worker_batches(
            length, skip=skip, batch=batch, worker=worker, workers=workers, size=size
        ):
            positions = [p for batches in group for p in batches.positions()]
            assert 0 < len(positions) <= max(size, batch * workers)
            assert all(batches.length == batch for batches in group[:-1])
            covered += positions
    assert sorted(covered) == list(range(skip, length))


@given(consumed=st.integers(0, 10**6), batch=st.integers(1, 64))
def test_a_resume_position_is_a_whole_number_of_batches(consumed: int, batch: int) -> None:
    if consumed % batch == 0:
        _shard.check_resume(consumed, batch)
    else:
        with pytest.raises(InvalidArgument, match="not a multiple of batch_size"):
            _shard.check_resume(consumed, batch)
