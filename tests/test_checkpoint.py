"""The checkpoint engine: round trips, verification, safety, atomicity, and the torch adapters."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncstore
import asyncstore.torch
from asyncstore import IntegrityError, InvalidArgument, NotFound, StoreUnavailable, UnsafeCheckpoint
from asyncstore.checkpoint import _target, read_manifest, staging_pool
from asyncstore.checkpoint._target import StoreSource
from asyncstore.testing import SeaweedFS

from .conftest import BUCKET, s3_options, unique

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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = (torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1) for t in (a, b))
    if a.dtype == torch.bool:
        return torch.equal(flat_a, flat_b)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def tensors_in(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in tensors_in(v, f"{path}/{k}")]
    if isinstance(obj, list | tuple):
        return [t for i, v in enumerate(obj) for t in tensors_in(v, f"{path}/{i}")]
    return []


def assert_same(saved: Any, loaded: Any) -> None:
    """Equal values, layouts, and the same sharing of storages."""
    before, after = tensors_in(saved), tensors_in(loaded)
    assert [p for p, _ in before] == [p for p, _ in after]
    for (path, a), (_, b) in zip(before, after, strict=True):
        assert same_bits(a, b), path
        assert a.stride() == b.stride(), path
        assert a.storage_offset() == b.storage_offset(), path
        assert type(a) is type(b), path
    owners = [a.untyped_storage().data_ptr() for _, a in before]
    again = [b.untyped_storage().data_ptr() for _, b in after]
    for i in range(len(owners)):
        for j in range(len(owners)):
            if before[i][1].untyped_storage().nbytes() and before[j][1].untyped_storage().nbytes():
                assert (owners[i] == owners[j]) == (again[i] == again[j])
    assert without_tensors(saved) == without_tensors(loaded)


def without_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return {k: without_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [without_tensors(v) for v in obj]
    return obj


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


# -- round trips -------------------------------------------------------------------------------


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
    assert_same(state, loaded)


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
    assert_same(state, await asyncstore.load((store, "big.ckpt")))


async def test_auto_compresses_where_it_pays(seaweedfs: SeaweedFS) -> None:
    # An object store is slower than zstd: "auto" compresses bf16 weights there, and keeps
    # random bytes raw (the probe finds they do not shrink).
    gen = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(2_000_000, generator=gen).to(torch.bfloat16),
        "noise": torch.randint(0, 256, (2_000_000,), dtype=torch.uint8, generator=gen),
    }
    options = s3_options(seaweedfs)
    url = f"s3://{BUCKET}/{unique()}"
    result = await (await asyncstore.save(state, f"{url}/auto.ckpt", store_options=options))
    assert result.compressed_storages == 1
    async with asyncstore.open_store(url, **options) as store:
        manifest = await read_manifest((store, "auto.ckpt"))
    assert manifest is not None
    by_name = {s.name: s for s in manifest.storages}
    assert {c.codec for c in by_name["w"].chunks} == {"zstd+shuffle2"}
    assert {c.codec for c in by_name["noise"].chunks} == {"raw"}
    assert_same(state, await asyncstore.load(f"{url}/auto.ckpt", store_options=options))


async def test_metadata_and_torch_save_files(tmp_path: Path) -> None:
    state = {"w": torch.arange(10.0)}
    await (await asyncstore.save(state, tmp_path / "m.ckpt", metadata={"step": 7, "tag": "a"}))
    async with asyncstore.open_store(tmp_path) as store:
        manifest = await read_manifest((store, "m.ckpt"))
    assert manifest is not None
    assert manifest.metadata == {"step": 7, "tag": "a"}
    torch.save(state, tmp_path / "plain.pt")
    assert_same(state, await asyncstore.load(tmp_path / "plain.pt"))
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
    assert_same(state, loaded)


# -- partial loads -----------------------------------------------------------------------------


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


# -- verification ------------------------------------------------------------------------------


async def test_every_byte_flip_and_truncation_is_detected() -> None:
    state = {
        "w": torch.arange(64, dtype=torch.float32),
        "b": torch.ones(8, dtype=torch.bfloat16),
        "step": 3,
    }
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await (await asyncstore.save(state, (store, "good"), compression=None))
        data = await store.get("good")
        assert len(data) < 4096
        for position in range(len(data)):
            damaged = bytearray(data)
            damaged[position] ^= 0x01
            await store.put("bad", bytes(damaged))
            with pytest.raises(IntegrityError):
                await asyncstore.load((store, "bad"))
        for length in range(0, len(data), 7):
            await store.put("short", data[:length])
            with pytest.raises(IntegrityError):
                await asyncstore.load((store, "short"))


async def test_damaged_chunk_names_tensor_chunk_and_url(tmp_path: Path) -> None:
    state = {"model": {"layer.weight": torch.randn(4096)}}
    path = tmp_path / "d.ckpt"
    await (await asyncstore.save(state, path, compression=None, chunk_bytes=4096))
    data = bytearray(path.read_bytes())
    async with asyncstore.open_store(tmp_path) as store:
        manifest = await read_manifest((store, "d.ckpt"))
    assert manifest is not None
    chunk = manifest.storages[0].chunks[2]
    data[chunk.offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        IntegrityError,
        match=r"d\.ckpt: chunk 2 of tensor 'model\.layer\.weight'",
    ):
        await asyncstore.load(path)


# -- safety ------------------------------------------------------------------------------------


class Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


async def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    await (await asyncstore.save({"w": torch.ones(2), "x": Exploit(str(marker))}, path))
    with pytest.raises(UnsafeCheckpoint, match=r"(posix|os)\.system"):
        await asyncstore.load(path)
    assert not marker.exists()
    # The same payload in a torch.save file is refused too (torch's own weights_only).
    torch.save({"x": Exploit(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpoint):
        await asyncstore.load(tmp_path / "evil.pt")
    assert not marker.exists()
    # Trusted: weights_only=False runs it, as torch.load would.
    await asyncstore.load(path, weights_only=False)
    assert marker.exists()


async def test_safe_globals_allow_a_named_class(tmp_path: Path) -> None:
    path = tmp_path / "od.ckpt"
    state = {"opt": OrderedDict(a=torch.ones(1)), "frac": complex(1, 2), "big": 10**30}
    await (await asyncstore.save(state, path))
    assert_same(state, await asyncstore.load(path))


# -- staging and the pipeline ------------------------------------------------------------------


async def test_second_save_allocates_nothing_and_small_pools_stream(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(100_000) for i in range(8)}  # 3.2 MB
    first = await (
        await asyncstore.save(state, tmp_path / "1.ckpt", chunk_bytes=256 * 1024, staging_bytes=MiB)
    )
    pool = staging_pool(256 * 1024)
    allocated = pool.allocated
    assert 0 < pool.allocated_bytes <= MiB  # the budget held while 3.2 MB streamed through
    await (
        await asyncstore.save(state, tmp_path / "2.ckpt", chunk_bytes=256 * 1024, staging_bytes=MiB)
    )
    assert pool.allocated == allocated
    assert first.raw_bytes > 3 * MiB
    assert_same(state, await asyncstore.load(tmp_path / "2.ckpt"))


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
        ({"metadata": {1: "a"}}, "str keys"),
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


# -- crashes and outages -----------------------------------------------------------------------

WRITER = """
import sys, time, torch
from asyncstore.torch import save
target, options = sys.argv[1], eval(sys.argv[2])
gen = torch.Generator().manual_seed(int(sys.argv[3]))
state = {f"w{i}": torch.randn(2_000_000, generator=gen) for i in range(4)}
print("ready", flush=True)
save(state, target, compression="zstd", level=3, chunk_bytes=1 << 20, store_options=options)
print("saved", flush=True)
"""


def expected_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(2_000_000, generator=gen) for i in range(4)}


def kill_during_save(target: str, options: dict[str, Any], seed: int, delay: float) -> bool:
    """Start a save in a subprocess, SIGKILL it ``delay`` s after it is ready; True if it
    finished first."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, target, repr(options), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    return "saved" in out


@pytest.mark.parametrize("kind", ["local", "s3"])
async def test_sigkill_mid_save_leaves_old_or_new(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "s3":
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        options = s3_options(server)
        target = f"s3://{BUCKET}/{unique('kill')}/ckpt"
    else:
        options, target = {}, str(tmp_path / "ckpt")
    rng = random.Random(5)
    outcomes = set()
    killed_mid_save = 0
    for attempt, delay in enumerate([0.0, 0.05, 0.1, 0.2, 0.4]):
        finished = await anyio.to_thread.run_sync(
            kill_during_save, target, options, attempt, delay + rng.uniform(0.0, 0.05)
        )
        killed_mid_save += not finished
        try:
            loaded = await asyncstore.load(target, store_options=options)
        except NotFound:
            assert not finished
            outcomes.add("absent")
            continue
        # Never a partial checkpoint: what is there is one whole save, verified.
        matches = [
            seed
            for seed in range(attempt + 1)
            if all(torch.equal(loaded[k], v) for k, v in expected_state(seed).items())
        ]
        assert matches, "the checkpoint matches none of the saves"
        outcomes.add("new" if matches[-1] == attempt else "old")
        if finished:
            assert matches[-1] == attempt
    assert killed_mid_save >= 1
    # The next save cleans up what a killed one left: temp files, or unfinished uploads.
    final = {"done": torch.ones(3)}
    await (await asyncstore.save(final, target, store_options=options))
    assert_same(final, await asyncstore.load(target, store_options=options))
    if kind == "s3":
        prefix = target.removeprefix(f"s3://{BUCKET}/")
        assert server.list_multipart_uploads(BUCKET, prefix) == []
    else:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert outcomes


async def test_server_stopped_mid_save(tmp_path: Path) -> None:
    server = SeaweedFS(data_dir=tmp_path / "sw")
    server.start()
    try:
        server.create_bucket("ckpt")
        options = s3_options(server, retry_base_delay=0.01, retry_max_delay=0.05, max_attempts=3)
        state = {f"w{i}": torch.randn(1_500_000) for i in range(4)}  # 24 MB: several parts
        handle = await asyncstore.save(
            state, "s3://ckpt/run/step.ckpt", compression=None, store_options=options
        )
        server.stop(timeout=2.0)
        with pytest.raises(StoreUnavailable):
            await handle
    finally:
        server.stop(timeout=2.0)
    again = SeaweedFS(data_dir=tmp_path / "sw")
    again.start()
    try:
        with pytest.raises(NotFound):
            await asyncstore.load("s3://ckpt/run/step.ckpt", store_options=s3_options(again))
    finally:
        again.stop(timeout=2.0)


# -- the torch adapters ------------------------------------------------------------------------


def test_torch_adapters_round_trip(tmp_path: Path) -> None:
    from asyncstore.torch import load, save, save_async

    model = torch.nn.Linear(16, 4)
    state = model.state_dict()
    result = save(state, tmp_path / "a.ckpt")
    assert result.stored_bytes == (tmp_path / "a.ckpt").stat().st_size
    assert_same(dict(state), dict(load(tmp_path / "a.ckpt")))
    future = save_async(state, str(tmp_path / "b.ckpt"))
    assert future.result(timeout=60).storages == 2
    buffer = io.BytesIO()
    save(state, buffer)
    buffer.seek(0)
    assert_same(dict(state), dict(load(buffer, map_location="cpu")))
    torch.save(state, tmp_path / "plain.pt")
    assert_same(dict(state), dict(load(tmp_path / "plain.pt")))
    with pytest.raises(InvalidArgument, match="map_location"):
        load(tmp_path / "a.ckpt", map_location=lambda s, loc: s)


def test_pickle_protocol_of_structure_is_plain_pickle(tmp_path: Path) -> None:
    # The structure stays readable with the standard library, given the storages.
    from asyncstore.checkpoint._pickle import pickle_structure

    data, storages, entries = pickle_structure({"a": torch.ones(2), "b": 1})
    assert entries == {"a": [0], "b": []}
    assert len(storages) == 1
    seen = []

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            seen.append(pid)
            return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                wrap_storage=storages[0].storage, dtype=torch.float32, _internal=True
            )

    assert torch.equal(Reader(io.BytesIO(data)).load()["a"], torch.ones(2))
    assert seen == [("storage", 0, "float32")]


def test_staging_is_kept_across_event_loops(tmp_path: Path) -> None:
    # Scripts often run each save in its own asyncio.run(): the pool outlives the loop.
    state = {f"w{i}": torch.randn(50_000) for i in range(4)}
    chunk = 128 * 1024

    async def save_once(name: str) -> None:
        await (await asyncstore.save(state, tmp_path / name, chunk_bytes=chunk))

    asyncio.run(save_once("a.ckpt"))
    allocated = staging_pool(chunk).allocated
    asyncio.run(save_once("b.ckpt"))
    assert staging_pool(chunk).allocated == allocated > 0


@pytest.mark.parametrize("width", [2, 4, 8])
def test_byte_shuffle_matches_its_definition(width: int) -> None:
    from asyncstore.checkpoint import _format as fmt

    rng = random.Random(width)
    for size in (0, 1, width - 1, width, width + 1, 1000, 4099, 65_536 + 3):
        data = rng.randbytes(size)
        shuffled = fmt.shuffle(memoryview(bytearray(data)), width)
        whole = size - size % width
        # Byte k of every element, for k = 0 .. width-1; then the tail as it was.
        assert (
            bytes(shuffled)
            == b"".join(data[:whole][k::width] for k in range(width)) + (data[whole:])
        )
        restored = bytearray(size)
        fmt.unshuffle(shuffled, width, memoryview(restored))
        assert bytes(restored) == data


class FailingFile(io.RawIOBase):
    """A file whose writes fail after a few, as a full disk does."""

    def __init__(self, good_writes: int) -> None:
        self.writes = 0
        self.good_writes = good_writes

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes > self.good_writes:
            raise OSError("No space left on device")
        return len(memoryview(data))


async def test_failed_saves_give_their_staging_back() -> None:
    # Writes failing while the snapshot still needs slabs: every slab must come back, or
    # later saves with the same pool would wait for ever.
    state = {f"t{i}": torch.randn(1024) for i in range(64)}  # 64 x 4 KiB, 2 slabs of budget
    options: dict[str, Any] = {"chunk_bytes": 4096, "staging_bytes": 8192, "compression": None}

    async def save(target: Any) -> None:
        await (await asyncstore.save(state, target, **options))

    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            await asyncio.wait_for(save(FailingFile(3)), 30)
    pool = staging_pool(4096)
    assert len(pool._free) == pool.allocated
    target = io.BytesIO()
    await asyncio.wait_for(save(target), 30)
    target.seek(0)
    assert_same(state, await asyncstore.load(target))


async def test_many_small_tensors_load_from_a_local_file(tmp_path: Path) -> None:
    # More chunks in one span than one preadv call takes (1024 on Linux).
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(1100)}
    await (await asyncstore.save(state, tmp_path / "many.ckpt", compression=None))
    assert_same(state, await asyncstore.load(tmp_path / "many.ckpt"))


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


class HookedParameter:
    """Pickles as a parameter carrying a backward hook, as a crafted file could."""

    def __reduce__(self) -> tuple[Any, ...]:
        hooks = OrderedDict({0: bytearray})
        return (torch._utils._rebuild_parameter, (torch.ones(1), True, hooks))


async def test_backward_hooks_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "hooked.ckpt"
    await (await asyncstore.save({"p": HookedParameter()}, path))
    with pytest.raises(UnsafeCheckpoint, match="backward hooks"):
        await asyncstore.load(path)


def rewrite_manifest(blob: bytes, edit: Any) -> bytes:
    """The checkpoint with its manifest edited and every checksum over it redone."""
    import msgspec
    import xxhash

    from asyncstore.checkpoint import _format as fmt

    footer = fmt.decode_footer(blob[-fmt.FOOTER_SIZE :], "test")
    assert footer is not None
    start, end = footer.manifest_offset, footer.manifest_offset + footer.manifest_length
    manifest = edit(fmt._manifest_decoder.decode(blob[start:end]))
    manifest = msgspec.structs.replace(manifest, digest=fmt.digest_of(manifest))
    encoded = fmt.encode_manifest(manifest)
    new_footer = fmt.Footer(1, 0, start, len(encoded), xxhash.xxh3_64_intdigest(encoded))
    return blob[:start] + encoded + fmt.encode_footer(new_footer)


async def test_forged_manifests_are_integrity_errors() -> None:
    # Checksums over a manifest can be recomputed by whoever forges one: the loader checks
    # that it describes the object consistently before allocating or reading anything.
    import msgspec

    replace = msgspec.structs.replace

    def storage(**changes: Any) -> Any:
        return lambda m: replace(m, storages=[replace(m.storages[0], **changes)])

    def chunk(**changes: Any) -> Any:
        def edit(m: Any) -> Any:
            first = m.storages[0]
            chunks = [replace(first.chunks[0], **changes)]
            return replace(m, storages=[replace(first, chunks=chunks)])

        return edit

    edits = [
        storage(nbytes=-8),
        storage(nbytes=12),
        storage(location="no-such-device"),
        chunk(offset=-100),
        chunk(offset=10**12),
        chunk(raw=-16),
        chunk(codec="lz4"),
        lambda m: replace(m, structure=replace(m.structure, raw=-1)),
        lambda m: replace(m, entries={"a": [99]}),
    ]
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await (await asyncstore.save({"a": torch.arange(4.0)}, (store, "good"), compression=None))
        good = await store.get("good")
        for edit in edits:
            await store.put("forged", rewrite_manifest(good, edit))
            with pytest.raises(IntegrityError):
                await asyncstore.load((store, "forged"))


def test_giving_a_slab_back_survives_a_closed_waiting_loop() -> None:
    from asyncstore.checkpoint import StagingPool

    pool = StagingPool(4096, pinned=False)
    pool.set_budget(4096)
    slab = asyncio.run(pool.acquire())  # the whole budget, in use
    loop = asyncio.new_event_loop()
    waiting = loop.create_task(pool.acquire())
    loop.run_until_complete(asyncio.sleep(0.01))  # it now waits for a slab
    loop.close()  # closed without cancelling it
    pool.release(slab)  # must not raise into the save giving it back
    assert len(pool._free) == 1
    assert not waiting.done()
    waiting._log_destroy_pending = False  # type: ignore[attr-defined]  # abandoned on purpose


async def test_local_saves_go_around_the_page_cache(tmp_path: Path) -> None:
    # Slabs hold each chunk at its file offset modulo 4096, so an uncompressed save to a
    # local file goes to the device straight from staging memory, bar a few partial blocks.
    state = {f"w{i}": torch.randn(1000 + 37 * i) for i in range(40)}
    state["big"] = torch.randn(3 << 20)
    handle = await asyncstore.save(
        state, tmp_path / "a.ckpt", compression=None, chunk_bytes=1 << 20
    )
    result = await handle
    assert result.direct_bytes >= result.stored_bytes - 16 * 4096
    loaded = await asyncstore.load(tmp_path / "a.ckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("priority", ["low", "normal"])
async def test_encoding_runs_at_the_priority_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, priority: str
) -> None:
    # Checksums and compression run on threads a training step's threads always win
    # against, unless the caller asks otherwise; the snapshot runs at normal priority.
    from asyncstore.checkpoint._pipeline import SaveJob
    from asyncstore.checkpoint._staging import Copier

    seen: dict[str, set[int]] = {"encode": set(), "copy": set()}

    def own() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    encode, copy = SaveJob._encode_sync, Copier._copy

    def spying_encode(self: Any, segment: Any) -> Any:
        seen["encode"].add(own())
        return encode(self, segment)

    def spying_copy(segment: Any) -> None:
        seen["copy"].add(own())
        copy(segment)

    monkeypatch.setattr(SaveJob, "_encode_sync", spying_encode)
    monkeypatch.setattr(Copier, "_copy", staticmethod(spying_copy))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    state = {"w": torch.randn(1 << 16)}
    await (await asyncstore.save(state, tmp_path / "p.ckpt", priority=priority))  # type: ignore[arg-type]
    assert seen["encode"] == ({19} if priority == "low" else {base})
    assert seen["copy"] == {base}
    with pytest.raises(InvalidArgument, match="priority='urgent'"):
        await asyncstore.save(state, tmp_path / "p.ckpt", priority="urgent")  # type: ignore[arg-type]


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
    assert_same(old, await asyncstore.load(tmp_path / "latest.ckpt"))
    assert replaced
    assert_same(new, await asyncstore.load(tmp_path / "latest.ckpt"))


async def test_a_manifest_asking_for_more_memory_than_there_is_is_refused() -> None:
    # A zstd chunk may claim any raw size up to what zstd can expand its stored bytes to:
    # the load refuses before allocating, rather than being killed by the OOM killer (or
    # allocating terabytes of swap).
    from asyncstore.checkpoint._format import ZSTD_MAX_RATIO
    from asyncstore.checkpoint._reader import available_memory

    from .forge import Forged, ForgedStorage, StorageRef, forge, rebuild, write_pickle

    available = available_memory()
    assert available is not None  # Linux: /proc/meminfo
    huge = available + (1 << 30)
    stored = os.urandom(huge // ZSTD_MAX_RATIO + 4096)  # incompressible: stored as big
    structure = write_pickle({"a": rebuild(StorageRef(0), 0, [huge], [1])})
    blob = forge(
        Forged(structure, [ForgedStorage(stored, codec="zstd", raw=huge)], entries={"a": [0]})
    )
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await store.put("forged", blob)
        with pytest.raises(UnsafeCheckpoint, match=r"needs [\d,.]+ GiB .* keys="):
            await asyncstore.load((store, "forged"))


async def test_storages_are_cut_to_fill_each_slab(tmp_path: Path) -> None:
    # Six 768 KiB tensors in slabs of about 1 MiB: cutting a storage where a slab ends
    # fills five slabs instead of taking one each (a quarter of the staging memory saved).
    from asyncstore.checkpoint import staging_pool

    chunk = (1 << 20) + 12288
    pool = staging_pool(chunk)
    pool.trim()
    state = {f"t{i}": torch.randn(196_608) for i in range(6)}
    await (await asyncstore.save(state, tmp_path / "cut.ckpt", chunk_bytes=chunk, compression=None))
    assert pool.allocated == -(-6 * 196_608 * 4 // chunk) == 5
    manifest = await read_manifest(tmp_path / "cut.ckpt")
    sizes = [[c.raw for c in s.chunks] for s in manifest.storages]
    assert any(len(s) == 2 for s in sizes)  # some storages span two slabs
    assert all(sum(s) == 196_608 * 4 for s in sizes)
    assert_same(state, await asyncstore.load(tmp_path / "cut.ckpt"))
    pool.trim()


async def test_reserve_allocates_ahead_of_the_first_save(tmp_path: Path) -> None:
    from asyncstore.checkpoint import staging_pool

    chunk = (1 << 20) + 8192
    pool = staging_pool(chunk)
    pool.trim()
    pool.set_budget(3 * chunk)
    pool.reserve(2 * chunk + 1)  # rounds up to whole slabs, within the budget
    assert pool.allocated == 3
    pool.reserve(100 * chunk)  # never beyond the budget
    assert pool.allocated == 3
    state = {"w": torch.randn(3 * chunk // 4 - 1000)}
    await (
        await asyncstore.save(
            state, tmp_path / "r.ckpt", chunk_bytes=chunk, staging_bytes=3 * chunk
        )
    )
    assert pool.allocated == 3  # the save found its slabs ready
    with pytest.raises(InvalidArgument, match="nbytes=-1"):
        pool.reserve(-1)
    pool.trim()


async def test_a_failed_snapshot_copy_fails_the_save_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy into staging failing (a tensor freed under us, a device error) fails the call
    # itself; every slab comes back, no temp file stays, the previous checkpoint is intact.
    from asyncstore.checkpoint._staging import Copier

    chunk = (1 << 16) + 4096
    state = {f"t{i}": torch.randn(10_000) for i in range(40)}  # several slabs
    target = tmp_path / "c.ckpt"
    await (await asyncstore.save(state, target, chunk_bytes=chunk, compression=None))
    copy = Copier._copy
    calls = 0

    def failing_copy(segment: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("copy failed")
        copy(segment)

    monkeypatch.setattr(Copier, "_copy", staticmethod(failing_copy))
    changed = {k: v + 1 for k, v in state.items()}
    with pytest.raises(RuntimeError, match="copy failed"):
        await asyncstore.save(changed, target, chunk_bytes=chunk, compression=None)
    pool = staging_pool(chunk)
    assert pool.allocated > 0
    assert len(pool._free) == pool.allocated
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]
    monkeypatch.undo()
    assert_same(state, await asyncstore.load(target))
    pool.trim()


async def test_sparse_tensors_save_and_load_when_trusted(tmp_path: Path) -> None:
    # A sparse tensor has no storage of its own (its indices and values do): saving one
    # used to fail with a bare NotImplementedError.
    state = {"sparse": torch.eye(4).to_sparse(), "w": torch.ones(3)}
    await (await asyncstore.save(state, tmp_path / "s.ckpt"))
    loaded = await asyncstore.load(tmp_path / "s.ckpt", weights_only=False)
    assert loaded["sparse"].layout == torch.sparse_coo
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(4))
    with pytest.raises(UnsafeCheckpoint, match="_rebuild_sparse_tensor"):
        await asyncstore.load(tmp_path / "s.ckpt")


async def test_a_writer_failing_during_a_short_snapshot_gives_staging_back() -> None:
    # The first write fails (a full disk) while a state of half a slab is being copied: the
    # snapshot then ends without asking for another slab, and must give its slab back, or
    # the next save with this pool waits for ever.
    chunk = (1 << 20) + 20480
    state = {"w": torch.randn(chunk // 8)}
    options: dict[str, Any] = {"chunk_bytes": chunk, "staging_bytes": 2 * chunk}
    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            await asyncio.wait_for(
                (await asyncstore.save(state, FailingFile(0), compression=None, **options)).wait(),
                30,
            )
    pool = staging_pool(chunk)
    assert len(pool._free) == pool.allocated
    target = io.BytesIO()
    await asyncio.wait_for((await asyncstore.save(state, target, **options)).wait(), 30)
    target.seek(0)
    assert_same(state, await asyncstore.load(target))
    pool.trim()


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


async def test_slabs_without_room_to_spare_still_hold_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pinned slabs are exactly chunk_bytes long (CUDA's allocator would double a larger
    # request), so a chunk placed at its file offset modulo 4096 may have to end early.
    # Plain memory of exactly that size stands in for pinned memory here.
    import mmap

    from asyncstore.checkpoint import StagingPool

    def tight(self: StagingPool) -> torch.Tensor:
        return torch.frombuffer(mmap.mmap(-1, self.slab_bytes), dtype=torch.uint8)

    monkeypatch.setattr(StagingPool, "_allocate", tight)
    for chunk in (4096, 12288, 65536 + 4096):
        pool = staging_pool(chunk)
        pool.trim()
        gen = torch.Generator().manual_seed(chunk)
        state = {
            f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate((1, 3000, 9001, 40000))
        }
        path = tmp_path / f"tight-{chunk}.ckpt"
        await (await asyncstore.save(state, path, chunk_bytes=chunk, compression=None))
        assert_same(state, await asyncstore.load(path))
        manifest = await read_manifest(path)
        assert all(c.raw <= chunk for s in manifest.storages for c in s.chunks)
        pool.trim()


async def test_a_directory_at_the_key_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    async with asyncstore.open_store(tmp_path) as store:
        with pytest.raises(NotFound):
            await asyncstore.load((store, "ckpt"))


async def test_saves_cancelled_at_random_moments_give_every_slab_back(tmp_path: Path) -> None:
    # Cancellation can land anywhere in a save: while it waits for a slab (one may arrive
    # in that very moment), while it copies, while it writes. Afterwards every slab is back
    # in the pool, no temp file stays, and the next save works.
    chunk = (1 << 20) + 24576
    state = {f"t{i}": torch.randn(150_000) for i in range(24)}
    pool = staging_pool(chunk)
    rng = random.Random(0)
    for trial in range(20):
        staging = chunk * rng.choice([2, 4, 64])
        task = asyncio.ensure_future(
            asyncstore.save(
                state,
                tmp_path / f"x{trial % 2}.ckpt",
                chunk_bytes=chunk,
                staging_bytes=staging,
                compression=rng.choice([None, "auto"]),
            )
        )
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        try:
            handle = await asyncio.wait_for(asyncio.shield(task), 30)
            if rng.random() < 0.5:
                handle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(handle.wait(), 30)
        except asyncio.CancelledError:
            pass
        assert pool.allocated == len(pool._free), f"trial {trial}"
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith(".ckpt")]
    options: dict[str, Any] = {"chunk_bytes": chunk, "staging_bytes": 4 * chunk}
    await asyncio.wait_for(
        (await asyncstore.save(state, tmp_path / "final.ckpt", **options)).wait(), 30
    )
    assert_same(state, await asyncstore.load(tmp_path / "final.ckpt"))
    pool.trim()


# The sync adapters (asyncstore.torch.save / save_async / load): every bad argument is an
# InvalidArgument naming the parameter, never a bare TypeError.
BAD_SYNC_SAVE: list[tuple[dict[str, Any], str]] = [
    ({"bogus": 1}, "bogus="),
    ({"compresion": "zstd"}, "compresion="),
    ({"compression": "lz4"}, "compression="),
    ({"level": "high"}, "level="),
    ({"chunk_bytes": 0}, "chunk_bytes="),
    ({"staging_bytes": -1}, "staging_bytes="),
    ({"exclude": 5}, "exclude="),
    ({"metadata": [1]}, "metadata="),
    ({"priority": "high"}, "priority="),
    ({"store_options": ["fsync"]}, "store_options="),
    ({"store_options": {"fsync": "yes"}}, "fsync="),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_SYNC_SAVE)
def test_sync_save_arguments(tmp_path: Path, kwargs: dict[str, Any], name: str) -> None:
    for save in (asyncstore.torch.save, asyncstore.torch.save_async):
        with pytest.raises(InvalidArgument) as caught:
            save({"w": torch.ones(1)}, tmp_path / "x.ckpt", **kwargs)
        assert name in str(caught.value)
    assert not (tmp_path / "x.ckpt").exists()


BAD_SYNC_LOAD: list[tuple[dict[str, Any], str]] = [
    ({"bogus": 1}, "bogus="),
    ({"weights_only": 1}, "weights_only="),
    ({"keys": "w"}, "keys="),
    ({"keys": 5}, "keys="),
    ({"into": [1]}, "into="),
    ({"safe_globals": 5}, "safe_globals="),
    ({"safe_globals": "collections.OrderedDict"}, "safe_globals="),
    ({"store_options": ["fsync"]}, "store_options="),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_SYNC_LOAD)
def test_sync_load_arguments(tmp_path: Path, kwargs: dict[str, Any], name: str) -> None:
    asyncstore.torch.save({"w": torch.ones(1)}, tmp_path / "x.ckpt")
    with pytest.raises(InvalidArgument) as caught:
        asyncstore.torch.load(tmp_path / "x.ckpt", **kwargs)
    assert name in str(caught.value)


@pytest.mark.parametrize("f", [None, 42, b"/tmp/x.ckpt", ""])
def test_sync_adapters_refuse_bad_targets(f: Any) -> None:
    with pytest.raises(InvalidArgument):
        asyncstore.torch.save({"w": torch.ones(1)}, f)
    with pytest.raises(InvalidArgument):
        asyncstore.torch.load(f)
