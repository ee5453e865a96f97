"""The checkpoint engine end to end: round trips, partial loads, one save per target at a time,
and the errors a bad argument gets."""

from __future__ import annotations

import asyncio
import io
import os
import random
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncstore
import asyncstore.torch
from asyncstore import IntegrityError, InvalidArgument, NotFound, UnsafeCheckpoint
from asyncstore.checkpoint import _target, read_manifest
from asyncstore.checkpoint._target import StoreSource
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import assert_same_storage_layout

pytestmark = pytest.mark.anyio

MiB = 1 << 20

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]


def random_tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    raw = torch.randint(0, 256, (max(1, int(torch.Size(shape).numel())) * 16,), generator=generator)
    data = raw.to(torch.uint8)
    width = torch.empty(0, dtype=dtype).element_size()
    count = int(torch.Size(shape).numel())
    flat = data[: count * width].view(dtype) if dtype != torch.bool else data[:count] % 2 == 1
    return flat[:count].reshape(shape).clone()


@st.composite
def states(draw: st.DrawFn) -> dict[str, Any]:
    rng = random.Random(draw(st.integers(0, 1 << 30)))
    state: dict[str, Any] = {}
    for i in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        kind = draw(st.sampled_from(["plain", "scalar", "empty", "transposed", "view", "tied"]))
        if kind == "scalar":
            state[f"t{i}"] = random_tensor(rng, dtype, ())
        elif kind == "empty":
            state[f"t{i}"] = random_tensor(rng, dtype, (0, 3))
        else:
            shape = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
            base = random_tensor(rng, dtype, shape)
            if kind == "transposed":
                state[f"t{i}"] = base.t()
            elif kind == "view":
                state[f"t{i}"] = base
                state[f"t{i}.view"] = base[1:, ::2]
            elif kind == "tied":
                state[f"t{i}"] = base
                state[f"t{i}.tied"] = base
            else:
                state[f"t{i}"] = base
    if draw(st.booleans()):
        state["nested"] = {"list": [random_tensor(rng, torch.float32, (3,)), 1, "x"], "n": None}
    state["step"] = draw(st.integers(0, 10**9))
    state["config"] = {"lr": 0.1, "name": "run", "betas": (0.9, 0.99)}
    return state


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(state=states(), compression=st.sampled_from([None, "zstd", "auto"]))
async def test_round_trip(store: asyncstore.Store, state: dict[str, Any], compression: Any) -> None:
    key = unique("ckpt")
    handle = await asyncstore.save(
        state, (store, key), compression=compression, chunk_bytes=4096, staging_bytes=16384
    )
    result = await handle
    assert result.stored_bytes == (await store.stat(key)).size
    loaded = await asyncstore.load((store, key))
    assert_same_storage_layout(state, loaded)


async def test_large_storages_compress_and_span_chunks(store: asyncstore.Store) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(600, 1000, generator=gen).to(torch.bfloat16),  # 1.2 MB, 2-byte floats
        "emb": torch.randn(300, 1000, generator=gen),  # fp32
        "noise": torch.randint(0, 256, (500_000,), dtype=torch.uint8, generator=gen),
    }
    handle = await asyncstore.save(
        state,
        (store, "big.ckpt"),
        compression="zstd",
        chunk_bytes=256 * 1024,
        staging_bytes=MiB,
        exclude=["emb"],
    )
    result = await handle
    manifest = await read_manifest((store, "big.ckpt"))
    assert manifest is not None
    codecs = {s.name: {c.codec for c in s.chunks} for s in manifest.storages}
    assert codecs["w"] == {"zstd+shuffle2"}
    assert codecs["emb"] == {"raw"}  # excluded by name
    assert codecs["noise"] <= {"raw", "zstd"}  # random bytes: kept raw where zstd cannot help
    assert len(next(s for s in manifest.storages if s.name == "w").chunks) == 5
    assert result.stored_bytes < result.raw_bytes
    assert_same_storage_layout(state, await asyncstore.load((store, "big.ckpt")))


async def test_auto_compresses_where_it_pays(
    seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where the target is slower than the encoders, "auto" compresses bf16 weights (with
    # the byte-plane codec), and keeps random bytes raw (the probe finds they do not
    # shrink). The target's speed is set, as a save there would have measured it: on a
    # loaded 2-core machine the real one, against loopback, flips the decision.
    from asyncstore.checkpoint import _codec

    gen = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(2_000_000, generator=gen).to(torch.bfloat16),
        "noise": torch.randint(0, 256, (2_000_000,), dtype=torch.uint8, generator=gen),
    }
    options = s3_options(seaweedfs)
    url = f"s3://{BUCKET}/{unique()}"
    monkeypatch.setitem(_codec._BANDWIDTH, url, 10e6)  # 10 MB/s: a slow link
    result = await (await asyncstore.save(state, f"{url}/auto.ckpt", store_options=options))
    assert result.compressed_storages == 1
    async with asyncstore.open_store(url, **options) as store:
        manifest = await read_manifest((store, "auto.ckpt"))
    assert manifest is not None
    by_name = {s.name: s for s in manifest.storages}
    assert {c.codec for c in by_name["w"].chunks} == {"zstd+planes2"}
    assert {c.codec for c in by_name["noise"].chunks} == {"raw"}
    assert_same_storage_layout(
        state, await asyncstore.load(f"{url}/auto.ckpt", store_options=options)
    )


async def test_metadata_and_torch_save_files(tmp_path: Path) -> None:
    state = {"w": torch.arange(10.0)}
    await (await asyncstore.save(state, tmp_path / "m.ckpt", metadata={"step": 7, "tag": "a"}))
    async with asyncstore.open_store(tmp_path) as store:
        manifest = await read_manifest((store, "m.ckpt"))
    assert manifest is not None
    assert manifest.metadata == {"step": 7, "tag": "a"}
    torch.save(state, tmp_path / "plain.pt")
    assert_same_storage_layout(state, await asyncstore.load(tmp_path / "plain.pt"))
    # keys= and into= behave on torch.save files as on ours.
    assert list(await asyncstore.load(tmp_path / "plain.pt", keys=["w"])) == ["w"]
    with pytest.raises(InvalidArgument, match="no entries"):
        await asyncstore.load(tmp_path / "plain.pt", keys=["nope"])
    with pytest.raises(InvalidArgument, match=r"into\['w'\]"):
        await asyncstore.load(tmp_path / "plain.pt", into={"w": torch.zeros(4)})


async def test_torch_save_file_from_s3(seaweedfs: SeaweedFS) -> None:
    state = {"w": torch.randn(50, 50), "n": 3}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    url = f"s3://{BUCKET}/{unique()}"
    async with asyncstore.open_store(url, **s3_options(seaweedfs)) as store:
        await store.put("plain.pt", buffer.getvalue())
    loaded = await asyncstore.load(f"{url}/plain.pt", store_options=s3_options(seaweedfs))
    assert_same_storage_layout(state, loaded)


async def test_keys_read_only_their_chunks() -> None:
    a = torch.randn(1000)
    state: dict[str, Any] = {"a": a, "b": torch.randn(1000), "tied": a, "n": 1}
    reads: list[tuple[int, int]] = []

    class Counting(StoreSource):
        async def read(self, start: int, end: int) -> bytes:
            reads.append((start, end))
            return await super().read(start, end)

    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await (await asyncstore.save(state, (store, "k"), compression=None, chunk_bytes=4096))
        manifest = await read_manifest((store, "k"))
        assert manifest is not None
        a_chunks = [c for s in manifest.storages if s.name == "a" for c in s.chunks]
        b_chunks = [c for s in manifest.storages if s.name == "b" for c in s.chunks]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_target, "StoreSource", Counting)
            part = await asyncstore.load((store, "k"), keys=["a", "tied"])
        with pytest.raises(InvalidArgument, match="no entries \\['nope'\\]"):
            await asyncstore.load((store, "k"), keys=["nope"])
    assert list(part) == ["a", "tied"]
    assert torch.equal(part["a"], state["a"])
    assert part["tied"].data_ptr() == part["a"].data_ptr()

    def touched(chunks: list[Any]) -> bool:
        return any(s < c.offset + c.stored and c.offset < e for c in chunks for s, e in reads)

    assert touched(a_chunks)
    assert not touched(b_chunks)  # b's chunks were never read


async def test_into_fills_existing_tensors_in_place(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    path = tmp_path / "model.ckpt"
    await (await asyncstore.save(model.state_dict(), path))
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    target = other.state_dict()
    pointers = {k: v.data_ptr() for k, v in target.items()}
    result = await asyncstore.load(path, into=target)
    assert result is target
    for key, value in model.state_dict().items():
        assert torch.equal(target[key], value)
        assert target[key].data_ptr() == pointers[key]  # filled in place
    wrong = {"0.weight": torch.zeros(3, 3)}
    with pytest.raises(InvalidArgument, match=r"0\.weight"):
        await asyncstore.load(path, into=wrong)


@pytest.mark.parametrize("compression", [None, "zstd"])
async def test_into_reads_whole_storages_straight_into_the_targets(
    tmp_path: Path, compression: Literal["zstd"] | None
) -> None:
    # Several chunks per tensor; targets of other dtypes' widths, one a slice of a larger
    # tensor (its neighbours untouched), and a saved view of a larger storage (copied).
    base = torch.randn(100_000)
    state = {
        "big": torch.randn(300_000),
        "half": torch.randn(70_000).to(torch.bfloat16),
        "flags": torch.rand(50_000) > 0.5,
        "view": base[10:20],
    }
    path = tmp_path / "direct.ckpt"
    await (await asyncstore.save(state, path, compression=compression, chunk_bytes=256 * 1024))
    holder = torch.full((300_010,), -1.0)
    into: dict[str, Any] = {
        "big": holder[5:300_005],
        "half": torch.zeros(70_000, dtype=torch.bfloat16),
        "flags": torch.zeros(50_000, dtype=torch.bool),
        "view": torch.zeros(10),
    }
    from asyncstore.checkpoint._reader import ChunkReader

    direct: list[str] = []
    read_into = ChunkReader.read_into

    async def spy(self: ChunkReader, places: list[tuple[Any, memoryview]]) -> None:
        direct.extend(entry.name for entry, _ in places)
        await read_into(self, places)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(ChunkReader, "read_into", spy)
        await asyncstore.load(path, into=into)
    assert len(direct) == 3  # every storage but the one "view" is a part of
    for key, value in state.items():
        assert torch.equal(into[key], value), key
    assert torch.equal(holder[:5], torch.full((5,), -1.0))
    assert torch.equal(holder[300_005:], torch.full((5,), -1.0))
    # A damaged chunk still fails the load, naming the tensor.
    data = bytearray(path.read_bytes())
    data[len(data) // 4] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="big"):
        await asyncstore.load(path, into={"big": torch.zeros(300_000)})


async def test_tied_weights_are_read_straight_into_their_one_target(tmp_path: Path) -> None:
    # A model with tied weights (the embedding and the output layer, one tensor) saves one
    # storage under two names; loaded into the same kind of model, it is read into the
    # target in place, not into a buffer copied from once per name.
    weight = torch.randn(50_000)
    path = tmp_path / "tied.ckpt"
    await (await asyncstore.save({"embed": weight, "head": weight}, path, chunk_bytes=65536))
    from asyncstore.checkpoint._reader import ChunkReader

    staged: list[str] = []
    storages = ChunkReader.storages

    async def spy(self: ChunkReader, entries: list[Any]) -> Any:
        staged.extend(entry.name for entry in entries)
        return await storages(self, entries)

    target = torch.zeros(50_000)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(ChunkReader, "storages", spy)
        await asyncstore.load(path, into={"embed": target, "head": target})
        assert staged == []
        assert torch.equal(target, weight)
        # Two different targets for the tied names: each gets its copy (through a buffer).
        first, second = torch.zeros(50_000), torch.zeros(50_000)
        await asyncstore.load(path, into={"embed": first, "head": second})
    assert len(staged) == 1
    assert torch.equal(first, weight)
    assert torch.equal(second, weight)


async def test_into_loads_non_tensor_entries_whole(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(2)}, "step": torch.tensor(5), "w": torch.full((2,), 3.0)}
    await (await asyncstore.save(state, tmp_path / "mixed.ckpt"))
    into: dict[str, Any] = {"model": None, "step": 0, "w": torch.zeros(2)}
    await asyncstore.load(tmp_path / "mixed.ckpt", into=into)
    assert into["model"]["w"].device.type == "cpu"
    assert torch.equal(into["model"]["w"], torch.ones(2))
    assert int(into["step"]) == 5
    assert torch.equal(into["w"], torch.full((2,), 3.0))
    with pytest.raises(InvalidArgument, match="is a tensor, but"):
        await asyncstore.load(tmp_path / "mixed.ckpt", into={"model": torch.zeros(2)})


async def test_keys_loads_tensors_carrying_tensor_attributes(tmp_path: Path) -> None:
    # A tensor's Python attributes are pickled with it: a partial load must read their
    # storages too (they came back on the meta device).
    w = torch.arange(8.0)
    w.scale = torch.full((4,), 7.0)  # type: ignore[attr-defined]
    p = torch.nn.Parameter(torch.ones(3))
    p.mask = torch.zeros(3)  # type: ignore[attr-defined]
    state = {"w": w, "p": p, "other": torch.ones(2)}
    await (await asyncstore.save(state, tmp_path / "attrs.ckpt", compression=None))
    part = await asyncstore.load(tmp_path / "attrs.ckpt", keys=["w", "p"], weights_only=False)
    assert torch.equal(part["w"].scale, torch.full((4,), 7.0))
    assert torch.equal(part["p"].mask, torch.zeros(3))


async def test_many_small_tensors_load_from_a_local_file(tmp_path: Path) -> None:
    # More chunks in one span than one preadv call takes (1024 on Linux).
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(1100)}
    await (await asyncstore.save(state, tmp_path / "many.ckpt", compression=None))
    assert_same_storage_layout(state, await asyncstore.load(tmp_path / "many.ckpt"))


@pytest.mark.parametrize("weights_only", [True, False])
async def test_sparse_tensors_save_and_load(tmp_path: Path, weights_only: bool) -> None:
    # A sparse tensor has no storage of its own (its indices and values do): saving one
    # used to fail with a bare NotImplementedError. weights_only=True loads it as torch does
    # (checking its indices against its shape: tests/checkpoint/test_weights_only_rules.py).
    state = {"sparse": torch.eye(4).to_sparse(), "w": torch.ones(3)}
    await (await asyncstore.save(state, tmp_path / "s.ckpt"))
    loaded = await asyncstore.load(tmp_path / "s.ckpt", weights_only=weights_only)
    assert loaded["sparse"].layout == torch.sparse_coo
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(4))


async def test_a_load_reads_one_file_while_a_save_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An evaluation job loading "latest.ckpt" while training saves a new one over it: the
    # load keeps reading the file whose manifest it read, and gets that checkpoint whole.
    from asyncstore.checkpoint import _reader

    old = {"w": torch.randn(300_000), "b": torch.randn(10)}
    new = {"w": torch.randn(300_000), "b": torch.randn(10)}
    await (await asyncstore.save(old, tmp_path / "latest.ckpt"))
    await (await asyncstore.save(new, tmp_path / "next.ckpt"))
    structure = _reader.ChunkReader.structure
    replaced: list[bool] = []

    async def replace_then_read(self: Any) -> bytes:
        if not replaced:  # after the manifest was read, before any tensor is
            os.replace(tmp_path / "next.ckpt", tmp_path / "latest.ckpt")
            replaced.append(True)
        return await structure(self)

    monkeypatch.setattr(_reader.ChunkReader, "structure", replace_then_read)
    assert_same_storage_layout(old, await asyncstore.load(tmp_path / "latest.ckpt"))
    assert replaced
    assert_same_storage_layout(new, await asyncstore.load(tmp_path / "latest.ckpt"))


async def test_a_directory_at_the_key_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    async with asyncstore.open_store(tmp_path) as store:
        with pytest.raises(NotFound):
            await asyncstore.load((store, "ckpt"))


async def test_caller_may_change_tensors_after_the_snapshot(tmp_path: Path) -> None:
    state = {"w": torch.randn(2_000_000)}
    expected = state["w"].clone()
    handle = await asyncstore.save(state, tmp_path / "s.ckpt")
    state["w"].zero_()  # training goes on
    await handle
    assert torch.equal((await asyncstore.load(tmp_path / "s.ckpt"))["w"], expected)


async def test_one_save_per_target_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "same.ckpt"
    first = await asyncstore.save({"v": torch.full((1000,), 1.0)}, path)
    second_started = asyncio.ensure_future(asyncstore.save({"v": torch.full((1000,), 2.0)}, path))
    await (await second_started)
    assert first.done()  # the second snapshot waited for the first commit
    assert torch.equal((await asyncstore.load(path))["v"], torch.full((1000,), 2.0))


async def test_cancelled_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "keep.ckpt"
    await (await asyncstore.save({"v": torch.zeros(10)}, path))
    handle = await asyncstore.save(
        {"v": torch.randn(4_000_000)}, path, compression="zstd", level=19
    )
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert torch.equal((await asyncstore.load(path))["v"], torch.zeros(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.ckpt"]


async def test_bad_arguments(tmp_path: Path) -> None:
    state = {"w": torch.ones(1)}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"compression": "lz4"}, "compression='lz4'"),
        ({"level": 99}, "level=99"),
        ({"chunk_bytes": 0}, "chunk_bytes=0"),
        ({"staging_bytes": 8192, "chunk_bytes": 16384}, "smaller than chunk_bytes"),
        ({"metadata": {"f": object()}}, "metadata cannot be stored"),
        (
            {"metadata": {1: "a"}},
            r"metadata=\{1: 'a'\}: expected str, got int for a key of metadata",
        ),
        ({"exclude": [3]}, "exclude="),
    ]
    for kwargs, match in cases:
        with pytest.raises(InvalidArgument, match=match):
            await asyncstore.save(state, tmp_path / "x.ckpt", **kwargs)
    with pytest.raises(InvalidArgument, match="names no object"):
        await asyncstore.save(state, "s3://bucket")
    with pytest.raises(InvalidArgument, match="is a directory"):
        await asyncstore.save(state, tmp_path)
    with pytest.raises(InvalidArgument, match="is a int"):
        await asyncstore.save(state, 42)
    with pytest.raises(UnsafeCheckpoint, match="cannot be saved"):
        await asyncstore.save({"f": lambda: 1}, tmp_path / "x.ckpt")
    with pytest.raises(NotFound):
        await asyncstore.load(tmp_path / "missing.ckpt")
    with pytest.raises(InvalidArgument, match="keys= or into="):
        await asyncstore.load(tmp_path / "x.ckpt", keys=["w"], into={})
    assert not (tmp_path / "x.ckpt").exists()


def test_auto_compression_counts_the_cores_the_ranks_of_a_node_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncstore.checkpoint._codec import _cores

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _cores() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))  # torchrun: one rank per core
    assert _cores() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert _cores() == cores


@pytest.mark.parametrize(("cores", "encoding"), [(1, 1), (2, 1), (3, 2), (64, 4)])
def test_auto_compression_leaves_a_core_to_the_writer(
    monkeypatch: pytest.MonkeyPatch, cores: int, encoding: int
) -> None:
    from asyncstore.checkpoint import _codec

    monkeypatch.setattr(_codec, "_cores", lambda: cores)
    monkeypatch.setattr(_codec, "ENCODERS", 4)
    assert _codec._encoding_cores() == encoding


async def test_into_refuses_overlapping_and_meta_targets(tmp_path: Path) -> None:
    path = tmp_path / "two.ckpt"
    await (await asyncstore.save({"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}, path))
    buffer = torch.zeros(6)
    with pytest.raises(InvalidArgument, match="share memory"):
        await asyncstore.load(path, into={"a": buffer[0:4], "b": buffer[2:6]})
    assert torch.equal(buffer, torch.zeros(6))  # refused before anything was written
    with pytest.raises(InvalidArgument, match="meta device"):
        await asyncstore.load(path, into={"a": torch.empty(4, device="meta")})
    tied = torch.zeros(4)  # the same tensor under two names (tied weights) is fine
    await (await asyncstore.save({"a": torch.ones(4), "b": torch.ones(4)}, path))
    await asyncstore.load(path, into={"a": tied, "b": tied})
    assert torch.equal(tied, torch.ones(4))
