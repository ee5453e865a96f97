"""StreamingDataset.state_dict / load_state_dict: a state resumes exactly the plan it was
saved in, and anything else (a stray number, another shard, other keys) is refused with an
error that names the entry, both values and what to do."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from asyncstore import InvalidArgument
from asyncstore.torch import StreamingDataset

from ..helpers import SAMPLE_KEYS, SAMPLES, key_of
from .helpers import closed_after_test

MAX_EPOCH = 2**31 - 1  # the largest epoch, as docs/datasets.md gives it


def dataset(dataset_dir: Path, **options: Any) -> StreamingDataset[str]:
    settings: dict[str, Any] = {"keys": SAMPLE_KEYS, "shuffle": True, "seed": 3, "decode": key_of}
    settings.update(options)
    made: StreamingDataset[str] = StreamingDataset(dataset_dir, **settings)
    return closed_after_test(made)


def read(ds: StreamingDataset[str], samples: int | None = None) -> list[str]:
    """``samples`` of the next iteration (all of it by default), the iteration then closed."""
    stream: Iterator[str] = iter(ds)
    try:
        return list(stream if samples is None else islice(stream, samples))
    finally:
        stream.close()  # type: ignore[attr-defined]


def loader_keys(ds: StreamingDataset[str], workers: int, stop: int | None = None) -> list[str]:
    loader = DataLoader(
        ds,
        batch_size=4,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    keys: list[str] = []
    for step, batch in enumerate(loader):
        if step == stop:
            break
        keys += batch
    return keys


# -- a valid state resumes exactly ----------------------------------------------------------


def test_a_state_resumes_exactly_where_it_was_saved(dataset_dir: Path) -> None:
    ds = dataset(dataset_dir, rank=1, world_size=2, batch_size=4)
    ds.set_epoch(2)
    plan = ds.plan()
    assert read(ds, 12) == plan[:12]
    state = ds.state_dict()
    assert state["version"] == 3
    assert (state["epoch"], state["start"], state["consumed"], state["seed"]) == (2, 0, 12, 3)
    assert (state["world_size"], state["samples"]) == (2, SAMPLES)
    assert "rank" not in state  # the same dict on every rank: saved once for the job
    assert state["shuffle"] is True
    assert 0 <= state["key_digest"] < 1 << 63  # fits an int64 wherever the state is kept
    # Kept as JSON (or by torch.save), loaded by a new dataset of the same configuration.
    kept = json.loads(json.dumps(state))
    again = dataset(dataset_dir, rank=1, world_size=2, batch_size=4)
    again.load_state_dict(kept)
    again.set_epoch(2)  # the usual loop sets the loaded epoch again: the position holds
    assert read(again) == plan[12:]


def format_2(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """``state`` as the second format wrote it: one per rank, no ``start``."""
    assert state["start"] == 0  # the second format could not say otherwise
    old = {name: value for name, value in state.items() if name != "start"}
    return {**old, "version": 2, "rank": rank}


def test_a_state_of_the_second_format_loads_on_its_own_rank(dataset_dir: Path) -> None:
    ds = dataset(dataset_dir, rank=1, world_size=2, batch_size=4)
    ds.set_epoch(2)
    saved = format_2(ds.state_dict(consumed=12), rank=1)
    again = dataset(dataset_dir, rank=1, world_size=2, batch_size=4)
    again.load_state_dict(saved)
    assert read(again) == ds.plan(2)[12:]
    assert again.state_dict()["consumed"] == SAMPLES // 2 + 1  # counted on from 12
    message = refused(dataset(dataset_dir, rank=0, world_size=2, batch_size=4), saved)
    assert message.startswith("state['rank']=1, but this dataset has rank=0: ")
    assert "load on each rank the state that rank saved" in message
    with pytest.raises(InvalidArgument, match=r"state\['rank'\]=2 is not below .*=2"):
        again.load_state_dict(dict(saved, rank=2))


def test_a_state_of_the_first_format_still_loads_and_is_checked(dataset_dir: Path) -> None:
    # What the first release saved: no version, nothing of the shard or the keys; those
    # are taken to be this dataset's.
    ds = dataset(dataset_dir, batch_size=4)
    ds.load_state_dict({"epoch": 1, "consumed": 20, "seed": 3})
    assert read(ds) == ds.plan(1)[20:]
    older = dataset(dataset_dir, batch_size=4)
    older.load_state_dict({"epoch": 1, "consumed": 8})  # before the seed was recorded
    assert read(older) == older.plan(1)[8:]
    # Its numbers are checked all the same, against this dataset's epoch.
    fresh = dataset(dataset_dir, batch_size=4)
    with pytest.raises(InvalidArgument, match=r"state\['consumed'\]=64: .* holds 61 samples"):
        fresh.load_state_dict({"epoch": 1, "consumed": 64, "seed": 3})
    with pytest.raises(InvalidArgument, match=r"state\['epoch'\]=True: an int was expected"):
        fresh.load_state_dict({"epoch": True, "consumed": 0})


def test_integers_of_numpy_and_torch_are_taken_and_nothing_else(dataset_dir: Path) -> None:
    ds = dataset(dataset_dir, batch_size=4)
    state: dict[str, object] = dict(ds.state_dict(consumed=8))
    for other in (np.float64(8.0), torch.tensor(8.0), "8"):
        with pytest.raises(InvalidArgument, match=r"state\['consumed'\]=.*an int was expected"):
            ds.load_state_dict(dict(state, consumed=other))
    state["consumed"] = np.int64(8)
    state["epoch"] = torch.tensor(0)
    ds.load_state_dict(state)
    assert read(ds) == ds.plan(0)[8:]


# Workers take whole batches of the rank's stream in turn: the stream, and so a position in
# it, does not depend on how many there are. 3 workers: DataLoader warns of 2 CPUs.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 0), (0, 2)])
def test_a_state_resumes_with_another_number_of_workers(
    dataset_dir: Path, before: int, after: int
) -> None:
    seen: list[str] = []
    for rank in range(2):
        ds = dataset(
            dataset_dir, rank=rank, world_size=2, batch_size=4, cache_dir=dataset_dir.parent / "c"
        )
        ds.set_epoch(1)
        first = loader_keys(ds, before, stop=3)  # three batches, then the job stops
        assert first == ds.plan()[:12]
        state = ds.state_dict(consumed=3 * 4)
        # The shard is recorded; the number of workers is not, as the stream's order does
        # not depend on it.
        assert state["world_size"] == 2
        assert not {name for name in state if "worker" in name or name == "rank"}
        resumed = dataset(
            dataset_dir, rank=rank, world_size=2, batch_size=4, cache_dir=dataset_dir.parent / "c"
        )
        resumed.load_state_dict(state)
        rest = loader_keys(resumed, after)
        assert first + rest == ds.plan()
        seen += first + rest
    counts = collections.Counter(seen)
    assert set(counts) == set(SAMPLE_KEYS)  # every sample once across ranks and the restart,
    assert sorted(counts.values()) == [1] * (SAMPLES - 1) + [2]  # but the one padded repeat


# -- numbers that are not a position ----------------------------------------------------------


def loaded_position(ds: StreamingDataset[str]) -> tuple[int, int]:
    state = ds.state_dict()
    return state["epoch"], state["consumed"]


@pytest.mark.parametrize("huge", [2**63, 2**64, 2**64 + 8, 2**100])
def test_a_huge_int_is_refused_not_wrapped(dataset_dir: Path, huge: int) -> None:
    ds = dataset(dataset_dir, batch_size=4)
    with pytest.raises(
        InvalidArgument, match=r"state\['consumed'\]=\d+: pass an int >= 0 and <= 61"
    ):
        ds.load_state_dict({"epoch": 0, "consumed": huge, "seed": 3})
    with pytest.raises(InvalidArgument, match=rf"state\['epoch'\]=\d+: .*<= {MAX_EPOCH}"):
        ds.load_state_dict({"epoch": huge, "consumed": 0, "seed": 3})
    assert loaded_position(ds) == (0, 0)  # nothing was loaded
    assert read(ds) == ds.plan(0)  # a whole epoch, neither endless nor empty
    with pytest.raises(
        InvalidArgument, match=rf"epoch={huge}: pass an int >= 0 and <= {MAX_EPOCH}"
    ):
        ds.set_epoch(huge)
    ds.set_epoch(MAX_EPOCH)  # the largest epoch is a real one
    assert read(ds) == ds.plan(MAX_EPOCH)


def test_consumed_beyond_the_epoch_is_refused(dataset_dir: Path) -> None:
    ds = dataset(dataset_dir, rank=0, world_size=2, batch_size=1)
    assert len(ds) == 31
    state = ds.state_dict(consumed=31)
    # The end of the epoch is a position: the rest is empty, and the next epoch whole.
    done = dataset(dataset_dir, rank=0, world_size=2, batch_size=1)
    done.load_state_dict(state)
    assert read(done) == []
    done.set_epoch(1)
    assert read(done) == done.plan(1)
    for beyond in (32, 40, 61):
        with pytest.raises(InvalidArgument) as caught:
            ds.load_state_dict(dict(state, consumed=beyond))
        message = str(caught.value)
        assert f"state['consumed']={beyond}" in message
        assert "this rank's epoch holds 31 samples" in message
    # The first format, checked against this dataset's epoch too.
    with pytest.raises(InvalidArgument, match=r"state\['consumed'\]=32:"):
        ds.load_state_dict({"epoch": 0, "consumed": 32})
    assert loaded_position(ds) == (0, 0)
    # Refused when saved, too: a state that could not load is never written.
    with pytest.raises(InvalidArgument, match="consumed=32: pass an int >= 0 and <= 31"):
        ds.state_dict(consumed=32)
    with pytest.raises(InvalidArgument, match="consumed=-4"):
        ds.state_dict(consumed=-4)
    with pytest.raises(InvalidArgument, match=r"consumed=2\.0: an int was expected"):
        ds.state_dict(consumed=2.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not a multiple of batch_size=4"):
        dataset(dataset_dir, batch_size=4).state_dict(consumed=6)


@pytest.mark.parametrize(
    ("entry", "value", "expected"),
    [
        ("epoch", True, "an int was expected, not bool"),
        ("consumed", False, "an int was expected, not bool"),
        ("consumed", 4.0, "an int was expected, not float"),
        ("epoch", "1", "an int was expected, not str"),
        ("consumed", None, "an int was expected, not NoneType"),
        ("seed", 3.0, "an int was expected, not float"),
        ("world_size", "2", "an int was expected, not str"),
        ("start", True, "an int was expected, not bool"),
        ("start", SAMPLES + 1, f"pass an int >= 0 and <= {SAMPLES} (the dataset holds {SAMPLES}"),
        ("samples", [SAMPLES], "an int was expected, not list"),
        ("shuffle", 1, "a bool was expected"),
        ("version", "2", "an int was expected, not str"),
        ("consumed", -4, "pass an int >= 0"),
        ("epoch", -1, "pass an int >= 0"),
        ("world_size", 0, "pass an int >= 1"),
    ],
)
def test_an_entry_of_the_wrong_type_is_refused(
    dataset_dir: Path, entry: str, value: object, expected: str
) -> None:
    ds = dataset(dataset_dir, rank=0, world_size=2)
    state: dict[str, object] = dict(ds.state_dict(consumed=4))
    state[entry] = value
    with pytest.raises(InvalidArgument) as caught:
        ds.load_state_dict(state)
    message = str(caught.value)
    assert message.startswith(f"state[{entry!r}]=")
    assert expected in message
    assert "pass the dict state_dict() returned, unchanged" in message
    assert loaded_position(ds) == (0, 0)


def test_what_is_not_a_state_is_refused(dataset_dir: Path) -> None:
    ds = dataset(dataset_dir)
    state = ds.state_dict()
    with pytest.raises(InvalidArgument, match=r"state=7: pass the dict"):
        ds.load_state_dict(7)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"state\[0\]=0: pass the dicts"):
        ds.load_state_dict([0, 0])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=r"state=\[\]: pass one state"):
        ds.load_state_dict([])
    with pytest.raises(InvalidArgument, match="unknown entries 'model'"):
        ds.load_state_dict(dict(state, model=1))
    with pytest.raises(InvalidArgument, match="missing 'start', 'world_size'"):
        ds.load_state_dict({k: v for k, v in state.items() if k not in ("start", "world_size")})
    with pytest.raises(InvalidArgument, match="unknown entries 'rank'"):
        ds.load_state_dict(dict(state, rank=0))  # format 3 holds no rank
    with pytest.raises(InvalidArgument, match="unknown entries 'start'; missing 'rank'"):
        ds.load_state_dict(dict(state, version=2))
    with pytest.raises(InvalidArgument, match="unknown entries 'rank'"):
        ds.load_state_dict({"epoch": 0, "consumed": 0, "rank": 0})  # no version: format 1
    with pytest.raises(InvalidArgument, match="missing 'consumed'"):
        ds.load_state_dict({"epoch": 0})
    with pytest.raises(InvalidArgument, match=r"version'\]=4: .*newer asyncstore"):
        ds.load_state_dict(dict(state, version=4))
    with pytest.raises(InvalidArgument, match=r"version'\]=1: not a version"):
        ds.load_state_dict(dict(state, version=1))


# -- a state of another plan ----------------------------------------------------------------


def refused(ds: StreamingDataset[str], state: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgument) as caught:
        ds.load_state_dict(state)
    assert loaded_position(ds) == (0, 0)  # nothing of it was taken
    return str(caught.value)


def test_a_state_of_another_world_size_before_the_group_is_refused(dataset_dir: Path) -> None:
    # Loaded before the process group is set up, the dataset is rank 0 of 1, which is
    # most likely not the world it will read at: say so rather than re-shard for one rank.
    state = dataset(dataset_dir, rank=0, world_size=2, batch_size=4).state_dict(consumed=8)
    for saved in (state, format_2(state, rank=0)):
        message = refused(dataset(dataset_dir, batch_size=4), saved)
        assert message.startswith("state['world_size']=2, but this dataset has world_size=1 ")
        assert "no torch.distributed group is initialised" in message
        assert "call ds.set_epoch(0)" in message  # the other way out: the epoch afresh


def test_a_position_loaded_at_one_world_size_is_not_read_at_another(dataset_dir: Path) -> None:
    # Saved by one rank and loaded with no group: taken as this world's position. A group
    # of two set up afterwards would read another split from the same skip: refused.
    state = dataset(dataset_dir, batch_size=4).state_dict(consumed=8)
    ds = dataset(dataset_dir, batch_size=4)
    ds.load_state_dict(state)
    ds._rank, ds._world = 0, 2  # what a process group set up now would give
    with pytest.raises(InvalidArgument, match=r"loaded at world_size=1, .* world_size=2: call"):
        read(ds)
    with pytest.raises(InvalidArgument, match=r"loaded at world_size=1, .* world_size=2: call"):
        ds.state_dict()


def test_a_state_of_another_dataset_length_is_refused(dataset_dir: Path) -> None:
    state = dataset(dataset_dir).state_dict(consumed=5)
    fewer = dataset(dataset_dir, keys=SAMPLE_KEYS[:-1])
    message = refused(fewer, state)
    assert message.startswith(f"state['samples']={SAMPLES}, but this dataset has samples=60: ")
    assert "resume over the same keys" in message
    # As many keys, but others, or the same in another order: the positions name other
    # samples all the same.
    for keys in ([*SAMPLE_KEYS[:-1], "train/extra.bin"], SAMPLE_KEYS[::-1]):
        message = refused(dataset(dataset_dir, keys=keys), state)
        assert message.startswith(f"state['key_digest']={state['key_digest']}, but ")
        assert "keys (or their order) changed" in message


def test_a_state_of_another_order_is_refused(dataset_dir: Path) -> None:
    state = dataset(dataset_dir).state_dict(consumed=5)
    message = refused(dataset(dataset_dir, seed=4), state)
    assert message.startswith("state['seed']=3, but this dataset has seed=4: ")
    assert "make the dataset with seed=3" in message
    message = refused(dataset(dataset_dir, shuffle=False), state)
    assert message.startswith("state['shuffle']=True, but this dataset has shuffle=False: ")
