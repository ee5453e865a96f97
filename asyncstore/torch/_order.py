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
every operation is int64 arithmetic in numpy, so every process, rank and machine computes
the same order from the same seed.

numpy runs these elementwise operations on the calling thread: the plan never touches
torch's intra-op pool, whose threads spin against the DataLoader's workers and the training
step for a busy machine's cores (ten million positions took 15.9 s on torch's pool of two
threads with the other core taken, 61.8 s on a loaded machine, against 1.4 s on one
thread). The arithmetic was torch's before and gives the same order: saved positions
resume where they did. numpy's per-call cost is also a third of torch's, which a warm
epoch of a few thousand samples paid at its start (4,000 positions: 0.38 ms, 1.05 ms in
torch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import xxhash

from . import _shard

__all__ = ["EpochOrder", "Indices"]

Indices = npt.NDArray[np.int64]
"""Positions or dataset indices: a one-dimensional int64 array."""

# Half-rounds, each mixing one half into the other: eight make four full Feistel rounds,
# which suffice for a pseudorandom permutation (Luby and Rackoff, SIAM J. Comput. 1988).
_ROUNDS = 8
_MUL1 = 0x5BD1E995  # odd constants below 2**31: products of 31-bit values stay in int64
_MUL2 = 0x27D4EB2F
_LOW31 = (1 << 31) - 1
# Positions computed per slice: enough to amortise the per-call cost over the cycle walk's
# dozen small steps, small enough that a slice's temporaries stay in the caches (10 M
# positions on one thread: 1.7 s in slices of 2**16, 1.4 s of 2**18, 1.8 s of 2**20), and a
# few MB in memory.
SLICE = 1 << 18


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

    def permute(self, positions: npt.ArrayLike) -> Indices:
        """Dataset indices at these positions of the epoch's (global) order."""
        positions = np.array(positions, dtype=np.int64)  # a copy: worked on in place
        if not self._shuffle:
            return positions
        out = self._feistel(positions)
        # Cycle walking, on the shrinking set of values still out of range only: at most
        # half of the domain lies outside, so the total work is under twice one pass.
        waiting = np.flatnonzero(out >= self.count)
        values = out[waiting]
        while len(waiting):
            values = self._feistel(values)
            inside = values < self.count
            out[waiting[inside]] = values[inside]
            waiting, values = waiting[~inside], values[~inside]
        return out

    def _feistel(self, values: Indices) -> Indices:
        # An unbalanced Feistel network on (high, low) halves of `bits` bits: each step
        # xors one half with a keyed mix of the other, so each is invertible and the
        # domain is 2**bits, less than twice the count.
        low_bits, low_mask, high_mask = self._low_bits, self._low_mask, self._high_mask
        high, low = values >> low_bits, values & low_mask
        # In place, on two temporaries made once: the steps are memory-bound, and a fresh
        # array per shift costs as much as the shift.
        mixed, shifted = np.empty_like(values), np.empty_like(values)
        for step, key in enumerate(self._keys):
            source, mask, target = (
                (low, high_mask, high) if step % 2 == 0 else (high, low_mask, low)
            )
            np.bitwise_xor(source, key & _LOW31, out=mixed)
            mixed *= _MUL1
            np.right_shift(mixed, 31, out=shifted)
            mixed ^= shifted
            mixed &= _LOW31
            mixed *= _MUL2
            np.right_shift(mixed, 29, out=shifted)
            mixed ^= shifted
            mixed ^= key >> 33
            mixed &= mask
            target ^= mixed
        high <<= low_bits
        high |= low
        return high

    def rank_indices(self, start: int, stop: int) -> Indices:
        """Dataset indices at positions ``start:stop`` of this rank's part of the epoch."""
        local = np.arange(start, min(stop, self.per_rank), dtype=np.int64)
        return self.permute(self._global(local))

    def _global(self, local: Indices) -> Indices:
        return _shard.global_position(local, count=self.count, rank=self.rank, world=self.world)

    def slices(
        self, skip: int = 0, batch: int = 1, worker: int = 0, workers: int = 1
    ) -> Iterator[Indices]:
        """This rank's dataset indices from position ``skip`` on, for one of ``workers``
        taking whole batches of ``batch`` in turn (as the DataLoader asks its workers), in
        arrays of about :data:`SLICE` indices."""
        groups = _shard.worker_batches(
            self.per_rank, skip=skip, batch=batch, worker=worker, workers=workers, size=SLICE
        )
        for group in groups:
            local = np.concatenate([local_positions(batches) for batches in group])
            yield self.permute(self._global(local))


def local_positions(batches: _shard.Batches) -> Indices:
    """``batches.positions()``, as one array operation rather than a Python int each."""
    starts = np.arange(
        batches.starts.start, batches.starts.stop, batches.starts.step, dtype=np.int64
    )
    return (starts[:, None] + np.arange(batches.length, dtype=np.int64)).ravel()
