"""The compact key index and the epoch order: exact, shared, resumable, and at scale."""

from __future__ import annotations

import array
import collections
import itertools
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncstore
from asyncstore import IntegrityError
from asyncstore.torch import StreamingDataset, _keyindex
from asyncstore.torch import _dataset as dataset_module
from asyncstore.torch._keyindex import KeyIndex, build_index, write_index
from asyncstore.torch._order import EpochOrder

KEYS = ["b", "a/x", "é/ü", "a/b" * 300, "z"]


# -- the index -------------------------------------------------------------------------------


def test_keys_read_back_in_order_from_memory_and_from_a_file(tmp_path: Path) -> None:
    write_index(tmp_path / "i.idx", KEYS)
    for index in (KeyIndex.from_keys(KEYS), KeyIndex.open(tmp_path / "i.idx")):
        assert len(index) == len(KEYS)
        assert list(index) == KEYS
        assert [index[i] for i in range(len(KEYS))] == KEYS
        assert index[-1] == "z"
        assert index[1:4] == KEYS[1:4]
        assert index.take([4, 0, 4]) == ["z", "b", "z"]
        with pytest.raises(IndexError):
            index[len(KEYS)]
        assert list(pickle.loads(pickle.dumps(index))) == KEYS
        assert index.take(np.array([3, 1], dtype=np.int64)) == [KEYS[3], KEYS[1]]
        # The offsets are read where they lie (the mapping), never copied per process.
        assert not index._bounds.flags.owndata


def test_a_mapped_index_pickles_by_path_and_refuses_a_rebuilt_file(tmp_path: Path) -> None:
    path = tmp_path / "i.idx"
    write_index(path, [f"k{i:06d}" for i in range(100_000)])
    index = KeyIndex.open(path)
    assert index.path == str(path)
    pickled = pickle.dumps(index)
    assert len(pickled) < 1000  # the path, not 100,000 keys
    assert pickle.loads(pickled)[99_999] == "k099999"
    write_index(path, ["other"])  # rebuilt from a different listing meanwhile
    with pytest.raises(IntegrityError, match="changed since"):
        pickle.loads(pickled)


@pytest.mark.parametrize("where", ["magic", "count", "offsets", "blob", "truncated", "empty"])
def test_a_damaged_index_is_refused(tmp_path: Path, where: str) -> None:
    path = tmp_path / "i.idx"
    write_index(path, KEYS)
    raw = bytearray(path.read_bytes())
    header, offsets_end = 48, 48 + 8 * (len(KEYS) + 1)
    if where == "magic":
        raw[0] ^= 1
    elif where == "count":
        raw[16] += 1
    elif where == "offsets":
        raw[header + 8] ^= 1
    elif where == "blob":
        raw[offsets_end + 3] ^= 0x20
    elif where == "truncated":
        del raw[-1]
    else:
        raw.clear()
    path.write_bytes(raw)
    with pytest.raises(IntegrityError):
        KeyIndex.open(path)


@pytest.mark.parametrize("crafted", ["not utf-8", "out of order", "past 2**63"])
def test_an_index_made_to_pass_its_checksums_still_names_no_wrong_key(
    tmp_path: Path, crafted: str
) -> None:
    # Checksums are recomputed after the damage, so the file opens: the damage must still
    # surface as IntegrityError when the keys are read, never as other bytes taken for keys.
    keys = [b"a", b"bb", b"ccc"]
    if crafted == "not utf-8":
        keys[1] = b"\xff\xfe"
    header, offsets, blob = _keyindex._encode(keys)
    values = list(memoryview(offsets).cast("Q"))
    if crafted == "out of order":
        values[2] = 0  # key 1 ends before it starts
    elif crafted == "past 2**63":
        values[1] = 2**64 - 40  # -40 as a signed offset: back into the header
    fixed = array.array("Q", values).tobytes()
    head = bytearray(header)
    struct.pack_into("<Q", head, 32, xxhash.xxh3_64_intdigest(fixed))
    path = tmp_path / "i.idx"
    path.write_bytes(bytes(head) + fixed + bytes(blob))
    index = KeyIndex.open(path)
    with pytest.raises(IntegrityError, match=r"i\.idx"):
        index.take(range(3))
    with pytest.raises(IntegrityError):
        list(index)


@pytest.mark.parametrize("keep", [True, False], ids=["small: decoded keys kept", "large"])
def test_keys_decoded_once_are_the_same_objects_each_time_in_a_small_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    # A warm epoch looks keys up in the cache: the same str objects every epoch match by
    # identity, hashes known. A large index keeps none (its keys stay compact).
    if not keep:
        monkeypatch.setattr(_keyindex, "_KEEP_DECODED_BYTES", 100)
    keys = [f"k/{i:04d}" for i in range(1000)]
    write_index(tmp_path / "i.idx", keys)
    for index in (KeyIndex.from_keys(keys), KeyIndex.open(tmp_path / "i.idx")):
        first = index.take([5, 7, 5])
        assert first == ["k/0005", "k/0007", "k/0005"]
        # Some decoded before, some not, some twice in one call: each in its place.
        second = index.take(np.array([9, 7, 5, 9, 999], dtype=np.int64))
        assert second == ["k/0009", "k/0007", "k/0005", "k/0009", "k/0999"]
        assert (second[1] is first[1]) is keep
        assert (index.take([999])[0] is second[4]) is keep
        assert list(index) == keys
        assert index[-1] == "k/0999"
        # A place outside the index is refused, not read from other bounds (and kept).
        for bad in ([-2], [3, 1000], np.array([0, -1], dtype=np.int64)):
            with pytest.raises(IndexError, match="out of range"):
                index.take(bad)
        assert index.take([998, 3]) == ["k/0998", "k/0003"]


def test_an_index_of_wide_keys_keeps_them_only_if_their_strings_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One character beyond the Basic Multilingual Plane makes a str take 4 bytes for every
    # character: the estimate counts them so (an index of ASCII keys the same size fits).
    narrow = [f"k{i:09d}" for i in range(100)]
    wide = [f"\U0001f600{i:06d}" for i in range(100)]  # also 10 bytes in UTF-8
    monkeypatch.setattr(_keyindex, "_KEEP_DECODED_BYTES", 100 * 60 + 2 * 1000)
    assert KeyIndex.from_keys(narrow)._decoded is not None
    index = KeyIndex.from_keys(wide)
    assert index._decoded is None
    assert index.take([7, 0]) == [wide[7], wide[0]]


# -- building it from a listing --------------------------------------------------------------


def listing_of(keys: list[str], calls: list[str], fail_after: int | None = None) -> object:
    async def listed(start_after: str) -> AsyncIterator[str]:
        calls.append(start_after)
        for count, key in enumerate(k for k in keys if k > start_after):
            if fail_after is not None and count == fail_after:
                raise ConnectionError("listing interrupted")
            yield key

    return listed


@pytest.mark.anyio
async def test_an_interrupted_build_resumes_after_its_last_complete_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstore.torch import _keyindex

    monkeypatch.setattr(_keyindex, "_CHUNK", 100)  # flush the partial listing every 100
    keys = [f"train/{i:05d}.jpg" for i in range(1000)]
    path = tmp_path / "keys.idx"
    calls: list[str] = []
    with pytest.raises(ConnectionError):
        await build_index(path, listing_of(keys, calls, fail_after=450))  # type: ignore[arg-type]
    assert not path.exists()
    # Four flushes of 100 keys landed; the 50 pending were lost with the process.
    with open(f"{path}.partial", "ab") as f:
        f.write(b"train/004")  # and a torn key, as a kill mid-write leaves one
    index = await build_index(path, listing_of(keys, calls))  # type: ignore[arg-type]
    assert calls == ["", "train/00399.jpg"]
    assert list(index) == keys
    assert not Path(f"{path}.partial").exists()
    again = await build_index(path, listing_of(keys, calls))  # type: ignore[arg-type]
    assert calls == ["", "train/00399.jpg"]  # reused, not listed again
    assert list(again) == keys


@pytest.mark.anyio
async def test_a_build_sorts_and_deduplicates_and_replaces_a_damaged_index(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.idx"
    path.write_bytes(b"ASKI garbage")
    calls: list[str] = []

    async def unordered(start_after: str) -> AsyncIterator[str]:
        calls.append(start_after)
        for key in ["b", "a-b", "a/b", "b", "a0"]:  # a server's own order, a repeat
            yield key

    index = await build_index(path, unordered)
    assert list(index) == ["a-b", "a/b", "a0", "b"]
    assert calls == [""]


BUILDER = """
import asyncio, sys, time
from asyncstore.torch._keyindex import build_index

async def listed(start_after):
    with open(sys.argv[2], "a") as log:
        log.write(f"list after {start_after!r}\\n")
    for i in range(3000):
        key = f"k/{i:05d}"
        if key > start_after:
            if i % 100 == 0:
                await asyncio.sleep(float(sys.argv[3]))
            yield key

index = asyncio.run(build_index(sys.argv[1], listed))
print(len(index), index[0], index[len(index) - 1])
"""


def builder(path: Path, log: Path, pause: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(path), str(log), str(pause)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_processes_of_a_node_build_it_once_and_a_killed_builder_is_resumed(
    tmp_path: Path,
) -> None:
    path, log = tmp_path / "keys.idx", tmp_path / "log"
    first = builder(path, log, 0.05)
    deadline = time.monotonic() + 30
    while not log.exists():
        assert time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)
    time.sleep(0.2)
    # Keys are flushed every 65,536: this kill, mid-listing, leaves an empty partial
    # listing; write part of one, as a longer listing killed later would have left.
    first.send_signal(signal.SIGKILL)
    first.communicate()
    Path(f"{path}.partial").write_bytes(b"".join(f"k/{i:05d}\0".encode() for i in range(1200)))
    waiting = [builder(path, log, 0.01) for _ in range(3)]
    for proc in waiting:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.split() == ["3000", "k/00000", "k/02999"]
    listings = log.read_text().splitlines()
    assert listings[0] == "list after ''"  # the killed one
    assert listings[1:] == ["list after 'k/01199'"]  # one builder resumed; the others waited


# -- the epoch order -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 5000),
    seed=st.integers(-(2**70), 2**70),
    epoch=st.integers(0, 10**6),
    world=st.integers(1, 9),
)
def test_every_rank_gets_equal_shares_and_every_sample_appears(
    count: int, seed: int, epoch: int, world: int
) -> None:
    seen: list[int] = []
    for rank in range(world):
        order = EpochOrder(count, seed=seed, epoch=epoch, shuffle=True, rank=rank, world=world)
        part = order.rank_indices(0, order.per_rank).tolist()
        assert len(part) == -(-count // world)
        assert part == [i for s in order.slices() for i in s]
        seen += part
    assert set(seen) == set(range(count))  # each once, plus padding from the start
    first = EpochOrder(count, seed=seed, epoch=epoch, shuffle=True, rank=0, world=1)
    assert sorted(first.permute(range(count)).tolist()) == list(range(count))


def test_orders_differ_by_epoch_and_seed_and_look_uniform() -> None:
    def order(seed: int, epoch: int, count: int = 1000) -> list[int]:
        o = EpochOrder(count, seed=seed, epoch=epoch, shuffle=True, rank=0, world=1)
        return [int(i) for i in o.permute(range(count))]

    assert order(0, 0) != order(0, 1) != order(1, 0)
    assert order(3, 5) == order(3, 5)
    unshuffled = EpochOrder(10, seed=0, epoch=3, shuffle=False, rank=0, world=1)
    assert unshuffled.permute(range(10)).tolist() == list(range(10))
    # Where sample 0 lands over 2,000 epochs of 40: each position about 50 times.
    landed = collections.Counter(order(0, e, 40).index(0) for e in range(2000))
    assert len(landed) == 40
    assert min(landed.values()) > 20
    assert max(landed.values()) < 90
    # Neighbours are scattered: few consecutive indices stay side by side.
    big = torch.tensor(order(9, 0, 100_000))
    assert int(((big[1:] - big[:-1]).abs() == 1).sum()) < 20


def test_the_order_is_the_same_in_another_process() -> None:
    code = (
        "import torch; from asyncstore.torch._order import EpochOrder; "
        "o = EpochOrder(100003, seed=12345, epoch=7, shuffle=True, rank=1, world=3); "
        "print(o.rank_indices(0, o.per_rank)[::997].tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    here = EpochOrder(100003, seed=12345, epoch=7, shuffle=True, rank=1, world=3)
    assert out.strip() == str(here.rank_indices(0, here.per_rank)[::997].tolist())


# -- a million keys through the dataset ------------------------------------------------------


MILLION = 1_000_000


@pytest.fixture(scope="module")
def million(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    # The index of a million-object listing, where the dataset keeps it: the objects are not
    # needed to check the plan, and creating a million files would take minutes.
    root = tmp_path_factory.mktemp("million")
    source, cache = root / "store", root / "cache"
    source.mkdir()
    cache.mkdir()
    keys = [f"train/{i // 1000:04d}/{i:07d}.jpg" for i in range(MILLION)]
    import xxhash

    digest = xxhash.xxh3_64_hexdigest(f"{source}\0".encode())
    write_index(cache / f"keys-{digest}.idx", keys)
    return source, cache, keys


def worker_streams(
    ds: StreamingDataset[bytes], workers: int, monkeypatch: pytest.MonkeyPatch
) -> list[list[str]]:
    streams = []
    for worker in range(workers):
        info = SimpleNamespace(id=worker, num_workers=workers)
        monkeypatch.setattr(dataset_module, "get_worker_info", lambda info=info: info)
        streams.append(list(ds._worker_keys(ds._epoch)))
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: None)
    return streams


def interleave(streams: list[list[str]], batch: int) -> list[str]:
    # The DataLoader's order: one batch from each worker in turn.
    out: list[str] = []
    positions = [0] * len(streams)
    worker = 0
    while any(p < len(s) for p, s in zip(positions, streams, strict=True)):
        out += streams[worker][positions[worker] : positions[worker] + batch]
        positions[worker] += batch
        worker = (worker + 1) % len(streams)
    return out


def test_a_million_keys_shard_exactly_once_and_resume_through_the_index(
    million: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, cache, keys = million
    world, workers, batch = 3, 2, 64
    seen: list[str] = []
    for rank in range(world):
        ds: StreamingDataset[bytes] = StreamingDataset(
            source,
            cache_dir=cache,
            shuffle=True,
            seed=11,
            rank=rank,
            world_size=world,
            batch_size=batch,
        )
        assert ds._keys.path is not None  # mapped from the cache, not listed
        assert len(ds) == -(-MILLION // world)
        plan = ds.plan()
        assert len(plan) == len(ds)
        assert interleave(worker_streams(ds, workers, monkeypatch), batch) == plan
        seen += plan
        if rank == 1:
            # Resume after 1,000 batches: the workers continue exactly where it stopped.
            ds.load_state_dict({"epoch": 0, "consumed": 1000 * batch, "seed": 11})
            rest = interleave(worker_streams(ds, workers, monkeypatch), batch)
            assert rest == plan[1000 * batch :]
    counts = collections.Counter(seen)
    assert set(counts) == set(keys)
    assert sum(counts.values()) - MILLION == world * -(-MILLION // world) - MILLION  # padding
    assert max(counts.values()) <= 2


def test_the_first_key_of_an_epoch_decodes_a_few_hundred_keys_not_a_slice(
    million: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, cache, _ = million
    ds: StreamingDataset[bytes] = StreamingDataset(source, cache_dir=cache, shuffle=True)
    decoded: list[int] = []
    take = KeyIndex.take

    def counted(self: KeyIndex, indices: object) -> list[str]:
        keys = take(self, indices)  # type: ignore[arg-type]
        decoded.append(len(keys))
        return keys

    monkeypatch.setattr(KeyIndex, "take", counted)
    stream = ds._worker_keys(0)
    first = next(stream)
    assert decoded == [dataset_module._DECODE]  # a slice holds 262,144 keys
    assert [first, *itertools.islice(stream, 9999)] == ds.plan()[:10000]


def test_a_dataset_over_a_listed_store_reads_what_its_index_names(tmp_path: Path) -> None:
    # The ordinary path end to end: listed once into the index, read through a DataLoader.
    root = tmp_path / "data"
    for i in range(300):
        (root / f"{i % 7}").mkdir(parents=True, exist_ok=True)
        (root / f"{i % 7}" / f"{i:04d}").write_bytes(str(i).encode())

    async def check() -> None:
        async with asyncstore.open_store(root) as store:
            assert len([i async for i in store.list()]) == 300

    import anyio

    anyio.run(check)
    ds: StreamingDataset[bytes] = StreamingDataset(root, cache_dir=tmp_path / "c", shuffle=True)
    got = sorted(int(x) for x in ds)
    assert got == list(range(300))
    assert isinstance(ds._keys, KeyIndex)
    assert ds._keys.path is not None
    ds.close()


# -- what a review found ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_cancelled_build_finishes_its_file_work_before_letting_the_lock_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from asyncstore.torch import _keyindex

    finished: list[bool] = []
    real = _keyindex._finish

    def slow_finish(name: str) -> KeyIndex:
        time.sleep(0.5)
        index = real(name)
        finished.append(True)
        return index

    monkeypatch.setattr(_keyindex, "_finish", slow_finish)
    calls: list[str] = []
    task = asyncio.ensure_future(build_index(tmp_path / "k.idx", listing_of(["a", "b"], calls)))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)  # inside _finish, in its thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]  # the lock was held until the file work was done


@pytest.mark.anyio
async def test_a_stale_partial_listing_beside_an_index_is_never_resumed(tmp_path: Path) -> None:
    path = tmp_path / "k.idx"
    write_index(path, ["a", "b"])
    Path(f"{path}.partial").write_bytes(b"a\0c\0")  # what a kill after publishing left
    calls: list[str] = []
    assert list(await build_index(path, listing_of(["a", "b"], calls))) == ["a", "b"]  # type: ignore[arg-type]
    path.unlink()  # "list again": the objects changed
    assert list(await build_index(path, listing_of(["a", "b", "d"], calls))) == ["a", "b", "d"]  # type: ignore[arg-type]
    assert calls == [""]  # listed from the start, not after the stale "c"


@pytest.mark.anyio
async def test_a_damaged_partial_listing_is_listed_again(tmp_path: Path) -> None:
    path = tmp_path / "k.idx"
    for damage in (b"a\0\xff\xfe\0", b"\xff\xfe\0a\0"):
        Path(f"{path}.partial").write_bytes(damage)
        calls: list[str] = []
        assert list(await build_index(path, listing_of(["a", "b"], calls))) == ["a", "b"]  # type: ignore[arg-type]
        assert calls[-1] == ""
        path.unlink()


@pytest.mark.anyio
async def test_an_empty_listing_is_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "k.idx"
    calls: list[str] = []
    assert len(await build_index(path, listing_of([], calls))) == 0  # type: ignore[arg-type]
    assert not path.exists()
    assert list(await build_index(path, listing_of(["late"], calls))) == ["late"]  # type: ignore[arg-type]


@pytest.mark.parametrize("cached", [True, False])
def test_a_file_name_that_is_not_utf8_is_named_in_an_asyncstore_error(
    tmp_path: Path, cached: bool
) -> None:
    from asyncstore import InvalidKey

    root = tmp_path / "data"
    root.mkdir()
    (root / "good.bin").write_bytes(b"x")
    os.close(os.open(os.path.join(os.fsencode(root), b"bad\xff.bin"), os.O_CREAT | os.O_WRONLY))
    with pytest.raises(InvalidKey, match="rename that object"):
        StreamingDataset(root, cache_dir=tmp_path / "c" if cached else None)


def test_a_resume_state_with_negative_positions_is_refused(tmp_path: Path) -> None:
    from asyncstore import InvalidArgument

    ds: StreamingDataset[bytes] = StreamingDataset(tmp_path, keys=[f"k{i}" for i in range(6)])
    for state in ({"epoch": 0, "consumed": -4}, {"epoch": -3, "consumed": 0}):
        with pytest.raises(InvalidArgument, match=">= 0"):
            ds.load_state_dict(state)
