"""A StreamingDataset's position in an epoch: what ``state_dict()`` saves, what
``load_state_dict()`` takes, and how the rest of an epoch is shared out when a job resumes
with another number of ranks.

Why a position can be re-sharded: in a DDP job every rank steps the same number of times, so
at a save every rank has consumed the same count ``c`` of its own stream. Rank ``r`` of
``W`` reads global positions ``r, r + W, ...`` of the epoch's order (see ``_shard``), so
together the ranks have read global positions ``0 .. c * W - 1``: a *prefix* of the order,
the same whatever the rank. What the world has consumed is then one number, ``start + c *
W``, and any number of ranks can share out the rest.

A rank's *stream* of an epoch is its part of global positions ``start .. count - 1``, split
as an epoch is (``_shard``): local position ``l`` of rank ``r`` of ``W`` is global position
``(start + l * W + r) % count``, for ``l < ceil((count - start) / W)``. A fresh epoch has
``start = 0``, which is the plan the rest of the package computes; a job resumed at another
world size starts its stream at what the old world consumed. Every rank's stream has the same
length (DDP needs it); the positions past ``count`` wrap to the epoch's first positions, so
the only repeats of an interrupted epoch are, as in one that was not, fewer than ``W`` of the
epoch's first samples, at the end of the streams that reach the epoch's end. A save
before the end of a stream never counts a wrapped position (``c < ceil((count - start) /
W)`` keeps ``start + c * W`` below ``count``), so the prefix is never overstated.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple, cast

import numpy as np

from ..errors import InvalidArgument
from ._order import SLICE, EpochOrder, Indices, local_positions
from ._shard import check_resume, per_rank, worker_batches

__all__ = [
    "MAX_EPOCH",
    "Facts",
    "Position",
    "make_state",
    "read_state",
    "stream_length",
    "stream_positions",
    "stream_slices",
]

# Epochs far beyond any training run: the position lives in int64 shared memory, and a
# value this side of it is a counter, not a stray number (a step, a hash) passed as one.
MAX_EPOCH = (1 << 31) - 1

# The formats of state_dict(). The first release's (no "version") held epoch, consumed and
# seed only; 2 added what the position depends on, rank and world size included; 3 holds
# nothing of the rank, so that every rank of a DDP job saves the same dict, and records
# where the rank's stream began, so that any number of ranks can resume it.
_VERSION = 3
_V1 = frozenset({"epoch", "consumed", "seed"})
_PLAN = frozenset({"seed", "shuffle", "samples", "key_digest"})
_V2 = frozenset({"version", "epoch", "consumed", "rank", "world_size"}) | _PLAN
_V3 = frozenset({"version", "epoch", "start", "consumed", "world_size"}) | _PLAN

# What each recorded entry of a state protects, and what to do when it differs.
_MISMATCH = {
    "seed": "the saved position counts in another order; make the dataset with "
    "seed={saved} to resume it",
    "shuffle": "the saved position counts in another order; make the dataset with "
    "shuffle={saved} to resume it",
    "samples": "the source holds another number of keys than when the state was saved, so "
    "the position names other samples; resume over the same keys",
    "key_digest": "the dataset's keys (or their order) changed since the state was saved, "
    "so the position names other samples; resume over the same keys",
    "rank": "each rank saved its own position in this format; load on each rank the state "
    "that rank saved (state_dict() of rank {saved})",
}
_DEFAULT_SHARD = (
    "no torch.distributed group is initialised and no rank and world_size were given: "
    "initialise the group before load_state_dict(), or pass rank= and world_size="
)
_UNCHANGED = "pass the dict state_dict() returned, unchanged"


class Facts(NamedTuple):
    """What a position counts in: the dataset's order and this process's shard."""

    seed: int
    shuffle: bool
    samples: int
    key_digest: int
    rank: int
    world: int
    batch: int
    #: the shard was given or read from a process group (False: rank 0 of 1 by default).
    shard_known: bool


class Position(NamedTuple):
    """Where the next iteration of ``epoch`` starts: its stream begins at global position
    ``start``, and ``skip`` local positions of it, counted at ``world`` ranks, are done."""

    epoch: int
    start: int = 0
    skip: int = 0
    world: int = 0  # 0: nothing is skipped, so any world size reads it


def stream_length(count: int, start: int, world: int) -> int:
    """Samples of each rank's stream over global positions ``start .. count - 1``."""
    return per_rank(count - start, world)


def stream_slices(
    order: EpochOrder, start: int, skip: int, batch: int, worker: int, workers: int
) -> Iterator[Indices]:
    """Dataset indices of one worker's part of this rank's stream from global ``start``,
    local ``skip`` on, in arrays of about :data:`SLICE` (as :meth:`EpochOrder.slices`)."""
    if start == 0:
        yield from order.slices(skip, batch, worker, workers)
        return
    length = stream_length(order.count, start, order.world)
    groups = worker_batches(
        length, skip=skip, batch=batch, worker=worker, workers=workers, size=SLICE
    )
    for group in groups:
        local = np.concatenate([local_positions(batches) for batches in group])
        yield order.permute((local * order.world + (order.rank + start)) % order.count)


def stream_positions(count: int, start: int, rank: int, world: int) -> list[int]:
    """Global positions of rank ``rank``'s stream from ``start``, in order (for tests and
    reasoning; iteration computes them a slice at a time)."""
    length = stream_length(count, start, world)
    return [(start + local * world + rank) % count for local in range(length)]


def whole(
    name: str,
    value: object,
    most: int | None,
    *,
    in_state: bool = False,
    least: int | None = 0,
    why: str = "",
) -> int:
    """``value`` as an int from ``least`` to ``most`` (None: no bound), or InvalidArgument
    that names it: ``state['name']`` for an entry of a state, else ``name``; ``why``
    explains the upper bound."""
    label = f"state[{name!r}]" if in_state else name
    number: int | None = None
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            number = operator.index(value)  # type: ignore[arg-type]
    if number is None:
        raise InvalidArgument(
            f"{label}={value!r:.100}: an int was expected, not {type(value).__name__}; "
            + (_UNCHANGED if in_state else "pass an int")
        )
    if (least is not None and number < least) or (most is not None and number > most):
        bound = " and ".join(
            ([f">= {least}"] if least is not None else [])
            + ([f"<= {most}"] if most is not None else [])
        )
        raise InvalidArgument(
            f"{label}={number}: pass an int {bound}{why}" + (f"; {_UNCHANGED}" if in_state else "")
        )
    return number


def _holds(length: int, start: int) -> str:
    if start == 0:
        return f" (this rank's epoch holds {length} samples: len(ds))"
    return f" (this rank's stream of the resumed epoch holds {length} samples)"


def check_world(position: Position, world: int) -> None:
    """Refuse to read or count a position whose skip counts in another world size.

    Raises:
        InvalidArgument: the position was loaded at one world size and is used at another
            (loaded before the process group was set up, typically).
    """
    if position.skip and position.world != world:
        raise InvalidArgument(
            f"this dataset's position ({position.skip} samples of each rank's stream of epoch "
            f"{position.epoch}) was loaded at world_size={position.world}, but the dataset "
            f"now reads at world_size={world}: call load_state_dict() after "
            "init_process_group(), or pass rank= and world_size= to the dataset"
        )


def make_state(
    position: Position, consumed: int | None, yielded: int, facts: Facts
) -> dict[str, int]:
    """``state_dict()``: the position after ``consumed`` samples of this rank's stream
    (None: ``skip + yielded``, what this process counted itself).

    Raises:
        InvalidArgument: ``consumed`` is not an int from 0 to the stream's length, or not a
            multiple of the batch size; the position was loaded at another world size.
    """
    check_world(position, facts.world)
    if consumed is None:
        done = position.skip + yielded
    else:
        length = stream_length(facts.samples, position.start, facts.world)
        done = whole("consumed", consumed, length, why=_holds(length, position.start))
        check_resume(done, facts.batch)
    return {
        "version": _VERSION,
        "epoch": position.epoch,
        "start": position.start,
        "consumed": done,
        "world_size": facts.world,
        "seed": facts.seed,
        "shuffle": facts.shuffle,
        "samples": facts.samples,
        "key_digest": facts.key_digest,
    }


def read_state(state: object, facts: Facts) -> Position:
    """``load_state_dict()``: the position ``state`` (one state, or every rank's) names,
    checked against this dataset; see ``StreamingDataset.load_state_dict``.

    Raises:
        InvalidArgument: ``state`` is not a state of this dataset's plan, or every rank's
            states disagree (ranks that consumed different counts).
    """
    if isinstance(state, Sequence) and not isinstance(state, str | bytes):
        state = _agreed(state, facts)
    if not isinstance(state, Mapping):
        raise InvalidArgument(
            f"state={state!r:.200}: pass the dict StreamingDataset.state_dict() returned"
        )
    version = _fields(state)
    epoch = whole("epoch", state["epoch"], MAX_EPOCH, in_state=True)
    afresh = (
        f"or, to read epoch {epoch} from its start instead, leave the state out and "
        f"call ds.set_epoch({epoch})"
    )
    _check_plan(state, facts, afresh)
    count = facts.samples
    if version == 1:  # no shard recorded: taken to be this one, as that format never said
        saved_world, start = facts.world, 0
    else:
        saved_world = whole("world_size", state["world_size"], None, in_state=True, least=1)
        start = 0
        if version == 3:
            start = whole(
                "start",
                state["start"],
                count,
                in_state=True,
                why=f" (the dataset holds {count} samples)",
            )
        else:
            saved_rank = whole("rank", state["rank"], None, in_state=True)
            if saved_rank >= saved_world:
                raise InvalidArgument(
                    f"state['rank']={saved_rank} is not below state['world_size']="
                    f"{saved_world}; {_UNCHANGED}"
                )
            if saved_world == facts.world and saved_rank != facts.rank:
                raise InvalidArgument(
                    f"state['rank']={saved_rank}, but this dataset has rank={facts.rank}: "
                    + _MISMATCH["rank"].format(saved=saved_rank)
                )
    length = stream_length(count, start, saved_world)
    holds = _holds(length, start)
    if saved_world != facts.world:
        holds = f" (each of the {saved_world} ranks' stream of that epoch holds {length} samples)"
    consumed = whole("consumed", state["consumed"], length, in_state=True, why=holds)
    if saved_world == facts.world:
        # The same split: this rank goes on in its own stream, and counts on from there.
        check_resume(consumed, facts.batch)
        return Position(epoch, start, consumed, facts.world if consumed else 0)
    if not facts.shard_known:
        raise InvalidArgument(
            f"state['world_size']={saved_world}, but this dataset has world_size=1 "
            f"({_DEFAULT_SHARD}); {afresh}"
        )
    # Another split: every rank consumed `consumed` of its stream (DDP steps all ranks
    # together), so the world consumed a prefix of the epoch's order; the rest is shared
    # out anew and each rank's stream begins there.
    return Position(epoch, min(count, start + consumed * saved_world))


def _fields(state: Mapping[object, object]) -> int:
    if "version" not in state:
        fields, required, version = _V1, _V1 - {"seed"}, 1  # the seed came within format 1
    else:
        version = whole("version", state["version"], None, in_state=True)
        if version > _VERSION:
            raise InvalidArgument(
                f"state['version']={version}: this state was saved by a newer asyncstore; "
                f"this one reads up to version {_VERSION}: upgrade asyncstore here"
            )
        if version not in (2, 3):
            raise InvalidArgument(
                f"state['version']={version}: not a version state_dict() writes (1 has no "
                f"'version' entry, 2 and {_VERSION} do); {_UNCHANGED}"
            )
        fields = required = _V2 if version == 2 else _V3
    unknown = sorted(map(repr, set(state) - fields))
    missing = sorted(required - set(state))
    if unknown or missing:
        raise InvalidArgument(
            f"state {state!r:.200} is not a StreamingDataset state_dict(): "
            + "; ".join(
                ([f"unknown entries {', '.join(unknown)}"] if unknown else [])
                + ([f"missing {', '.join(map(repr, missing))}"] if missing else [])
            )
            + f"; {_UNCHANGED}"
        )
    return version


def _check_plan(state: Mapping[object, object], facts: Facts, afresh: str) -> None:
    current: dict[str, object] = {
        "seed": facts.seed,
        "shuffle": facts.shuffle,
        "samples": facts.samples,
        "key_digest": facts.key_digest,
    }
    for name, value in current.items():
        if name not in state:
            continue  # a first-format state: assumed to match
        saved = state[name]
        if name == "shuffle":
            if not isinstance(saved, bool):
                raise InvalidArgument(
                    f"state['shuffle']={saved!r:.100}: a bool was expected; {_UNCHANGED}"
                )
        else:
            # Any int for the seed, as the dataset takes; the others are counts.
            least = None if name == "seed" else 0
            saved = whole(name, saved, None, in_state=True, least=least)
        if saved != value:
            raise InvalidArgument(
                f"state[{name!r}]={saved!r}, but this dataset has {name}={value!r}: "
                + _MISMATCH[name].format(saved=saved)
                + f"; {afresh}"
            )


def _agreed(states: Sequence[object], facts: Facts) -> Mapping[object, object]:
    """One state for every rank's: they must agree, the counts above all; this rank's own
    (format 2) or the first (format 3, the same on every rank) stands for them."""
    if not states:
        raise InvalidArgument("state=[]: pass one state, or the state every rank saved")
    for index, each in enumerate(states):
        if not isinstance(each, Mapping):
            raise InvalidArgument(
                f"state[{index}]={each!r:.100}: pass the dicts StreamingDataset.state_dict() "
                "returned on each rank"
            )
    listed = [cast(Mapping[object, object], each) for each in states]
    first = listed[0]
    ranks = [each.get("rank") for each in listed]
    if any(rank is not None for rank in ranks):
        world = first.get("world_size")
        try:
            given = sorted(operator.index(rank) for rank in ranks)  # type: ignore[arg-type]
        except TypeError:
            given = []
        if given != list(range(len(listed))) or world != len(listed):
            raise InvalidArgument(
                f"states of ranks {ranks} were given for world_size={world!r}: pass the "
                "state of every rank, each once"
            )
    for name in sorted(set().union(*listed), key=repr):
        values = [each.get(name) for each in listed]
        if name == "rank" or all(value == values[0] for value in values):
            continue
        if name == "consumed":
            raise InvalidArgument(
                f"the ranks' states were saved after different counts (consumed={values}, "
                "by rank): together they consumed no prefix of the epoch's order, so no "
                "resume could read each sample once. Save the state where every rank has "
                "trained the same number of batches (as DDP steps them together), or read "
                f"the epoch from its start: ds.set_epoch({first.get('epoch')})"
            )
        raise InvalidArgument(
            f"the ranks' states differ in {name!r} ({values}, by rank): they were not saved "
            "together; pass the states every rank saved at one step"
        )
    own = [each for each in listed if each.get("rank") == facts.rank]
    return own[0] if own and first.get("world_size") == facts.world else first
