"""How one epoch's order is shared out: across ranks, across a rank's DataLoader workers, and
from where a resumed epoch continues.

Integer arithmetic over positions only: which dataset index sits at a position is the
order's business (``_order``); which positions a process reads is decided here, once, so
that every rule of the split can be read and tested on its own.

Two kinds of position:

- a *global* position, in ``range(count)``, is a place in the epoch's order;
- a *local* position, in ``range(per_rank(count, world))``, is a place in one rank's stream.

Rank ``r`` of ``world`` takes global positions ``r, r + world, r + 2 * world, ...``. To give
every rank the same length (DDP steps all ranks together), the count is rounded up to a
multiple of ``world``; positions past the end wrap to the start of the order. Fewer than
``world`` positions wrap, so a rank repeats at most one sample, its last, and the repeats are
the first samples of the epoch's order (cycling through it when ranks outnumber samples).
Within a rank, DataLoader workers take whole batches in turn, as the DataLoader asks them for
batches in turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol, Self, TypeVar

from ..errors import InvalidArgument

__all__ = ["Batches", "Integers", "check_resume", "global_position", "per_rank", "worker_batches"]


class Integers(Protocol):
    """An int, or an array of ints (a numpy array): the arithmetic works elementwise."""

    def __add__(self, other: int, /) -> Self: ...
    def __mul__(self, other: int, /) -> Self: ...
    def __mod__(self, other: int, /) -> Self: ...


P = TypeVar("P", bound=Integers)


def per_rank(count: int, world: int) -> int:
    """Samples each of ``world`` ranks takes from an epoch of ``count``: ``ceil(count / world)``.

    The same for every rank: the shortest shards are padded (see :func:`global_position`).
    """
    return -(-count // world)


def global_position(local: P, *, count: int, rank: int, world: int) -> P:
    """The global position of ``rank``'s local position(s) ``local`` (``0 <= local <
    per_rank(count, world)``), elementwise for an array.

    Ranks take global positions in turn; a position past the end of the epoch wraps to its
    start, which pads the shorter ranks with the epoch's first samples.
    """
    return (local * world + rank) % count


class Batches(NamedTuple):
    """Local positions in batches: ``length`` consecutive ones from each of ``starts``."""

    starts: range
    length: int

    def positions(self) -> list[int]:
        """The local positions, batch after batch."""
        return [start + offset for start in self.starts for offset in range(self.length)]


def worker_batches(
    length: int, *, skip: int = 0, batch: int = 1, worker: int = 0, workers: int = 1, size: int
) -> Iterator[list[Batches]]:
    """The local positions one DataLoader worker reads, from local position ``skip`` on.

    Args:
        length: the rank's length (:func:`per_rank`).
        skip: local positions already consumed (a resumed epoch continues after them).
        batch: the DataLoader's batch size.
        worker, workers: this worker's id and the number of workers (0 and 1 without any).
        size: about how many positions each yielded group holds (at least one round of
            ``batch * workers``, and always whole rounds), so a caller can work a group at a
            time without holding the rank's whole stream.

    Workers take whole batches in turn from ``skip``: worker ``w`` reads ``[skip + w * batch,
    skip + (w + 1) * batch)``, then the same ``batch * workers`` later, and so on. Read one
    batch from each worker in turn, as the DataLoader does, they give back local positions
    ``skip, skip + 1, ...`` in order, the last batch possibly shorter. Each group is a list
    of full batches and, at the end of the rank, that shorter one.
    """
    span = batch * workers  # one round: a batch from each worker
    step = max(1, size // span) * span
    for first in range(skip + worker * batch, length, step):
        starts = range(first, min(first + step, length), span)
        # Only the rank's very last batch can be short: it is the last of its group.
        last = starts[-1]
        if last + batch <= length:
            yield [Batches(starts, batch)]
        elif len(starts) > 1:
            yield [Batches(starts[:-1], batch), Batches(starts[-1:], length - last)]
        else:
            yield [Batches(starts, length - last)]


def check_resume(consumed: int, batch: int) -> None:
    """Check that a rank can resume after ``consumed`` local positions with batches of ``batch``.

    Raises:
        InvalidArgument: ``consumed`` is not a whole number of batches: a resumable position
            is counted as batches consumed times the batch size.
    """
    if consumed % batch:
        raise InvalidArgument(
            f"consumed={consumed} is not a multiple of batch_size={batch}: count it as "
            "batches consumed times batch_size (the DataLoader's, which the dataset's matches)"
        )
