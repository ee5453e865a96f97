"""Each epoch's order of a dataset, computed a slice at a time.

Shuffling ten million indices with ``random.shuffle`` takes seconds and a list of ten million
ints (hundreds of MB) in every process that needs its part of the plan. Instead the order is
a keyed permutation of ``range(count)``: position ``p`` of epoch ``e`` holds dataset index
``permute(p)``, computed for any positions without computing the others. A process asks
only for its own positions, in slices, so no process ever holds the whole epoch.

The permutation is an unbalanced Feistel network over the smallest power of two that covers
``count``, made to stay inside ``range(count)`` by cycle walking (re-applying it to a value
until it lands in range, which preserves the bijection: Black and Rogaway, "Ciphers with
Arbitrary Finite Domains", CT-RSA 2002). Four rounds of a multiply-xorshift mix keyed by
``(seed, epoch)`` are not a cipher, but they scatter neighbours well enough for SGD, and
every operation is integer arithmetic in torch, so every process, rank and machine computes
the same order from the same seed.

The arithmetic runs on the calling thread only (:func:`one_thread`), never on torch's
intra-op pool: a slice is a few dozen memory-bound passes over a few MB, which a second
thread barely speeds up when the machine is idle, while on a busy machine the pool's
threads spin against the DataLoader's workers and the training step for their cores (ten
million positions: 1.4 s on one thread, 15.9 s on two with the other core taken, 61.8 s
on a loaded machine). Slices small enough to stay below torch's parallel threshold would
avoid the pool too, but pay torch's per-call cost three times over (3.8 s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import xxhash

from . import _shard

__all__ = ["EpochOrder", "one_thread"]

# Half-rounds, each mixing one half into the other: eight make four full Feistel rounds,
# which suffice for a pseudorandom permutation (Luby and Rackoff, SIAM J. Comput. 1988).
_ROUNDS = 8
_MUL1 = 0x5BD1E995  # odd constants below 2**31: products of 31-bit values stay in int64
_MUL2 = 0x27D4EB2F
_LOW31 = (1 << 31) - 1
# Positions computed per slice: enough to amortise torch's per-call cost over the cycle
# walk's dozen small steps, small enough that a slice's temporaries stay in the caches (10 M
# positions on one thread: 1.7 s in slices of 2**16, 1.4 s of 2**18, 1.8 s of 2**20), and a
# few MB in memory.
SLICE = 1 << 18


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's operations inside on the calling thread only, then give torch's intra-op
    pool back the size it had.

    Where torch uses OpenMP the size is the calling thread's own, so another thread's
    operations (the training step's) keep theirs meanwhile. A size someone else set while
    inside is kept. Never yield to other code from inside: the calling thread would run it
    at one thread too.
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() == 1:  # not changed meanwhile
            torch.set_num_threads(before)


class EpochOrder:
    """The order of one epoch over ``count`` samples, split by rank and worker.

    Args:
        count: samples in the dataset (at least 1, below ``2**62``).
        seed, epoch: the permutation's key; ``shuffle=False`` keeps the dataset's order.
        rank, world: this process's shard, split as :mod:`._shard` says: each rank gets
            ``ceil(count / world)`` positions, padded from the start of the epoch's order.
    """

    def __init__(
        self, count: int, *, seed: int, epoch: int, shuffle: bool, rank: int, world: int
    ) -> None:
        self.count = count
        self.rank, self.world = rank, world
        self.per_rank = _shard.per_rank(count, world)
        self._shuffle = shuffle and count > 1
        bits = max(2, (count - 1).bit_length())
        self._low_bits = bits - bits // 2
        self._low_mask = (1 << self._low_bits) - 1
        self._high_mask = (1 << (bits // 2)) - 1
        self._keys = [
            xxhash.xxh3_64_intdigest(f"{seed}:{epoch}:{i}".encode()) for i in range(_ROUNDS)
        ]

    def permute(self, positions: torch.Tensor) -> torch.Tensor:
        """Dataset indices at these positions of the epoch's (global) order."""
        if not self._shuffle:
            return positions.clone()
        with one_thread():
            return self._permute(positions)

    def _permute(self, positions: torch.Tensor) -> torch.Tensor:
        out = self._feistel(positions)
        # Cycle walking, on the shrinking set of values still out of range only: at most
        # half of the domain lies outside, so the total work is under twice one pass.
        waiting = (out >= self.count).nonzero().flatten()
        values = out[waiting]
        while len(waiting):
            values = self._feistel(values)
            inside = values < self.count
            out[waiting[inside]] = values[inside]
            waiting, values = waiting[~inside], values[~inside]
        return out

    def _feistel(self, values: torch.Tensor) -> torch.Tensor:
        # An unbalanced Feistel network on (high, low) halves of `bits` bits: each step
        # xors one half with a keyed mix of the other, so each is invertible and the
        # domain is 2**bits, less than twice the count.
        low_bits, low_mask, high_mask = self._low_bits, self._low_mask, self._high_mask
        high, low = values >> low_bits, values & low_mask
        # In place, on two temporaries made once: the steps are memory-bound, and a fresh
        # tensor per shift costs as much as the shift (a third of the time, measured).
        mixed, shifted = torch.empty_like(values), torch.empty_like(values)
        for step, key in enumerate(self._keys):
            source, mask, target = (
                (low, high_mask, high) if step % 2 == 0 else (high, low_mask, low)
            )
            torch.bitwise_xor(source, key & _LOW31, out=mixed)
            mixed.mul_(_MUL1)
            torch.bitwise_right_shift(mixed, 31, out=shifted)
            mixed ^= shifted
            mixed.bitwise_and_(_LOW31).mul_(_MUL2)
            torch.bitwise_right_shift(mixed, 29, out=shifted)
            mixed ^= shifted
            mixed ^= key >> 33
            mixed.bitwise_and_(mask)
            target ^= mixed
        high <<= low_bits
        high |= low
        return high

    def rank_indices(self, start: int, stop: int) -> torch.Tensor:
        """Dataset indices at positions ``start:stop`` of this rank's part of the epoch."""
        with one_thread():
            local = torch.arange(start, min(stop, self.per_rank), dtype=torch.int64)
            return self.permute(self._global(local))

    def _global(self, local: torch.Tensor) -> torch.Tensor:
        return _shard.global_position(local, count=self.count, rank=self.rank, world=self.world)

    def slices(
        self, skip: int = 0, batch: int = 1, worker: int = 0, workers: int = 1
    ) -> Iterator[list[int]]:
        """This rank's dataset indices from position ``skip`` on, for one of ``workers``
        taking whole batches of ``batch`` in turn (as the DataLoader asks its workers), in
        lists of about :data:`SLICE` indices."""
        groups = _shard.worker_batches(
            self.per_rank, skip=skip, batch=batch, worker=worker, workers=workers, size=SLICE
        )
        for group in groups:
            with one_thread():  # left before the yield: the consumer's code runs outside
                local = torch.cat([_local_positions(batches) for batches in group])
                indices = self.permute(self._global(local)).tolist()
            yield indices


def _local_positions(batches: _shard.Batches) -> torch.Tensor:
    # Batches.positions(), as one tensor operation rather than a Python int per position.
    starts = torch.arange(batches.starts.start, batches.starts.stop, batches.starts.step)
    return (starts[:, None] + torch.arange(batches.length)).flatten()
