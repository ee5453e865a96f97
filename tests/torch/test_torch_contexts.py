"""torch's thread-local serialization contexts through asyncstore's save and load, which run
on asyncstore's threads: ``torch.serialization.skip_data()`` and ``FakeTensorMode`` of the
caller are honoured as torch honours them; tensors on the meta device save and load as
torch's do; a ``MAP_SHARED`` map is the file's writable home and is not verified."""

from __future__ import annotations

import asyncio
import io
import mmap
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode
from torch.serialization import skip_data

import asyncstore
import asyncstore.checkpoint
import asyncstore.torch
from asyncstore._loop import run_sync
from asyncstore.errors import IntegrityError, InvalidArgument

from ..forge import Forged, ForgedStorage, StorageRef, forge, rebuild, write_pickle

MiB = 1 << 20
BIG = 4 * MiB  # bytes of the large tensor: far more than a load that reads none reads


def state() -> dict[str, torch.Tensor]:
    """A state with a large tensor, views sharing its storage, and a small one."""
    w = torch.randn(BIG // 4).view(1024, -1)
    return {"w": w, "row": w[3], "t": w.t(), "b": torch.arange(5, dtype=torch.int64)}


def target(run: tuple[str, dict[str, Any] | None], name: str) -> tuple[str, dict[str, Any]]:
    """The URL (or path) of checkpoint ``name`` in ``run``, and the options to reach it."""
    url, options = run
    return f"{url}/{name}", {"store_options": options} if options else {}


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


async def _get(url: str, options: dict[str, Any]) -> bytes:
    where, _, key = url.rpartition("/")
    async with asyncstore.open_store(where, **options.get("store_options", {})) as store:
        return await store.get(key)


async def _put(url: str, options: dict[str, Any], data: bytes) -> None:
    where, _, key = url.rpartition("/")
    async with asyncstore.open_store(where, **options.get("store_options", {})) as store:
        await store.put(key, data)


def damage_tensor_bytes(url: str, options: dict[str, Any]) -> None:
    """Flip a byte in the middle of the checkpoint: inside the large tensor's chunks."""
    data = bytearray(run_sync(_get(url, options)))
    data[len(data) // 2] ^= 0xFF
    run_sync(_put(url, options, bytes(data)))


class CountingFile(io.FileIO):
    """A file that counts the bytes read from it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "rb")
        self.bytes_read = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.bytes_read += len(data or b"")
        return data or b""

    def readinto(self, buffer: Any) -> int:
        got = super().readinto(buffer) or 0
        self.bytes_read += got
        return got


# -- skip_data() on save -------------------------------------------------------------------


def test_skip_data_saves_zeros_with_sizes_dtypes_and_views(
    run_url: tuple[str, dict[str, Any] | None],
) -> None:
    url, options = target(run_url, "skip.ckpt")
    saved = state()
    with skip_data():
        result = asyncstore.torch.save(saved, url, **options)
    loaded = asyncstore.torch.load(url, **options)
    for key, tensor in saved.items():
        assert loaded[key].shape == tensor.shape
        assert loaded[key].dtype == tensor.dtype
        assert loaded[key].stride() == tensor.stride()
        assert not loaded[key].any(), key  # zeros, not the tensor's values
    assert shares(loaded["w"], loaded["row"])
    assert shares(loaded["w"], loaded["t"])
    # Zeros compress to almost nothing: a few KiB for 4 MiB.
    assert result.stored_bytes < BIG // 50
    # The context ended with the call, on every thread: the next save has the bytes.
    asyncstore.torch.save(saved, url, **options)
    assert torch.equal(asyncstore.torch.load(url, **options)["w"], saved["w"])


def test_skip_data_never_copies_the_tensors_bytes(tmp_path: Path) -> None:
    saved = state()
    with skip_data():
        asyncstore.torch.save(saved, tmp_path / "raw.ckpt", compression=None)
        future = asyncstore.torch.save_async(saved, tmp_path / "async.ckpt", compression=None)
    future.result()
    marker = bytes(saved["w"][0, :16].view(torch.uint8).tolist())
    for name in ("raw.ckpt", "async.ckpt"):
        data = (tmp_path / name).read_bytes()
        assert len(data) > BIG  # stored raw: every byte of it is there, as zeros
        assert marker not in data
        assert not asyncstore.torch.load(tmp_path / name)["w"].any()


@pytest.mark.anyio
async def test_skip_data_of_an_async_save_is_read_on_the_callers_thread(tmp_path: Path) -> None:
    saved = state()
    with skip_data():
        handle = await asyncstore.save(saved, tmp_path / "a.ckpt")
    await handle
    loaded = await asyncstore.load(tmp_path / "a.ckpt")
    assert loaded["w"].shape == saved["w"].shape
    assert not loaded["w"].any()
    await (await asyncstore.save(saved, tmp_path / "b.ckpt"))
    assert torch.equal((await asyncstore.load(tmp_path / "b.ckpt"))["w"], saved["w"])


@pytest.mark.anyio
async def test_skip_data_is_read_before_a_save_waits_for_its_target(tmp_path: Path) -> None:
    # A second save to one target waits for the first to commit; the caller's skip_data()
    # is read when it calls, not when the wait ends (by then the context is gone).
    path = tmp_path / "one.ckpt"
    saved = state()
    first = await asyncstore.save(saved, path)
    with skip_data():
        waiting = asyncio.ensure_future(asyncstore.save(saved, path))
        await asyncio.sleep(0)  # it has started, and waits behind the first
    await first
    await (await waiting)
    loaded = await asyncstore.load(path)
    assert loaded["w"].shape == saved["w"].shape
    assert not loaded["w"].any()


def test_skip_data_refuses_a_nested_tensor_as_torch_does(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
        nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with (
        skip_data(),
        pytest.raises(RuntimeError, match="Cannot serialize nested tensor under skip_data"),
    ):
        asyncstore.torch.save({"n": nested}, tmp_path / "n.ckpt")
    with (
        skip_data(),
        pytest.raises(InvalidArgument, match=r"under torch\.serialization\.skip_data"),
    ):
        asyncstore.torch.save(nested, tmp_path / "n.ckpt")
    assert not (tmp_path / "n.ckpt").exists()


def test_skip_data_warns_for_a_meta_tensor_as_torch_does(tmp_path: Path) -> None:
    with (
        skip_data(),
        pytest.warns(UserWarning, match="meta device under skip_data context manager is a no-op"),
    ):
        asyncstore.torch.save({"m": torch.empty(2, 3, device="meta")}, tmp_path / "m.ckpt")
    loaded = asyncstore.torch.load(tmp_path / "m.ckpt")
    assert loaded["m"].is_meta
    assert loaded["m"].shape == (2, 3)


def test_skip_data_materializes_fake_tensors_as_zeros(tmp_path: Path) -> None:
    mode = FakeTensorMode()
    with mode:
        w = torch.randn(64, 32)
        state = {"w": w, "view": w.view(-1), "row": w[1]}
    converted = FakeTensorConverter().from_real_tensor(mode, torch.randn(4))
    state["converted"] = converted
    with skip_data(materialize_fake_tensors=True):
        asyncstore.torch.save(state, tmp_path / "fake.ckpt")
    loaded = asyncstore.torch.load(tmp_path / "fake.ckpt")
    assert type(loaded["w"]) is torch.Tensor
    assert loaded["w"].device.type == "cpu"
    assert loaded["w"].shape == (64, 32)
    assert not loaded["w"].any()
    assert shares(loaded["w"], loaded["view"])
    assert shares(loaded["w"], loaded["row"])
    assert torch.equal(loaded["converted"], torch.zeros(4))
    # Without materialize_fake_tensors, a FakeTensor cannot be pickled (as with torch).
    with skip_data(), pytest.raises(asyncstore.UnsafeCheckpoint, match="cannot be saved"):
        asyncstore.torch.save({"w": w}, tmp_path / "fake2.ckpt")


def test_fake_tensor_mode_on_save_saves_the_real_bytes_as_torch_does(tmp_path: Path) -> None:
    saved = state()
    with FakeTensorMode():
        asyncstore.torch.save(saved, tmp_path / "a.ckpt")
        torch.save(saved, tmp_path / "a.pt")
    for name in ("a.ckpt", "a.pt"):
        assert torch.equal(asyncstore.torch.load(tmp_path / name)["w"], saved["w"])


# -- skip_data() and FakeTensorMode on load ------------------------------------------------


def test_skip_data_load_reads_and_checks_no_tensor_byte(
    run_url: tuple[str, dict[str, Any] | None],
) -> None:
    url, options = target(run_url, "a.ckpt")
    saved = state()
    asyncstore.torch.save(saved, url, **options)
    damage_tensor_bytes(url, options)
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        asyncstore.torch.load(url, **options)
    with skip_data():
        loaded = asyncstore.torch.load(url, **options)
    for key, tensor in saved.items():
        assert loaded[key].shape == tensor.shape
        assert loaded[key].dtype == tensor.dtype
        assert not loaded[key].any()
    assert shares(loaded["w"], loaded["row"])
    assert shares(loaded["w"], loaded["t"])
    loaded["w"][0, 0] = 1.0  # real memory, the caller's to fill
    assert loaded["row"].shape == (BIG // 4 // 1024,)


def test_fake_tensor_mode_load_builds_fake_tensors_from_our_files(
    run_url: tuple[str, dict[str, Any] | None],
) -> None:
    url, options = target(run_url, "a.ckpt")
    saved = state()
    asyncstore.torch.save(saved, url, **options)
    damage_tensor_bytes(url, options)  # read, it would fail its checksum
    mode = FakeTensorMode()
    with mode:
        loaded = asyncstore.torch.load(url, **options)
    for key, tensor in saved.items():
        assert isinstance(loaded[key], FakeTensor)
        assert loaded[key].fake_mode is mode
        assert loaded[key].shape == tensor.shape
        assert loaded[key].dtype == tensor.dtype
        assert loaded[key].device == torch.device("cpu")
        assert loaded[key].untyped_storage().device.type == "meta"  # nothing allocated


@pytest.mark.parametrize("context", ["skip_data", "fake"])
def test_loads_under_a_context_read_almost_nothing(tmp_path: Path, context: str) -> None:
    saved = state()
    asyncstore.torch.save(saved, tmp_path / "a.ckpt")
    torch.save(saved, tmp_path / "a.pt")
    for name in ("a.ckpt", "a.pt"):
        with CountingFile(tmp_path / name) as whole:
            asyncstore.torch.load(whole)
        with (
            CountingFile(tmp_path / name) as counted,
            skip_data() if context == "skip_data" else FakeTensorMode(),
        ):
            loaded = asyncstore.torch.load(counted)
        assert whole.bytes_read >= BIG
        assert counted.bytes_read < BIG // 8, (name, counted.bytes_read)
        assert loaded["w"].shape == saved["w"].shape
        if context == "fake":
            assert isinstance(loaded["w"], FakeTensor)
        else:
            assert type(loaded["w"]) is torch.Tensor


@pytest.mark.anyio
async def test_async_load_honours_the_callers_contexts(tmp_path: Path) -> None:
    saved = state()
    await (await asyncstore.save(saved, tmp_path / "a.ckpt"))
    damage_tensor_bytes(str(tmp_path / "a.ckpt"), {})
    with skip_data():
        zeros = await asyncstore.load(tmp_path / "a.ckpt")
    assert not zeros["w"].any()
    with FakeTensorMode():
        fake = await asyncstore.load(tmp_path / "a.ckpt", keys=["w", "b"])
    assert isinstance(fake["w"], FakeTensor)
    assert list(fake) == ["w", "b"]
    with pytest.raises(IntegrityError):
        await asyncstore.load(tmp_path / "a.ckpt")  # the contexts ended with their blocks


def test_into_is_refused_under_a_context_that_reads_nothing(tmp_path: Path) -> None:
    asyncstore.torch.save({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    into = {"w": torch.zeros(4)}
    for context in (skip_data, FakeTensorMode):
        with context(), pytest.raises(InvalidArgument, match="into= fills tensors"):
            asyncstore.torch.load(tmp_path / "a.ckpt", into=into)
    assert not into["w"].any()


def test_map_location_meta_reads_nothing(tmp_path: Path) -> None:
    saved = state()
    asyncstore.torch.save(saved, tmp_path / "a.ckpt")
    damage_tensor_bytes(str(tmp_path / "a.ckpt"), {})
    loaded = asyncstore.torch.load(tmp_path / "a.ckpt", map_location="meta")
    assert loaded["w"].is_meta
    assert loaded["t"].shape == saved["t"].shape


# -- meta tensors and storages -------------------------------------------------------------


@pytest.mark.parametrize("weights_only", [True, False])
def test_meta_tensors_save_and_load_on_meta(
    run_url: tuple[str, dict[str, Any] | None], weights_only: bool
) -> None:
    url, options = target(run_url, "meta.ckpt")
    model = torch.nn.Conv2d(2000, 32000, kernel_size=3, device="meta")  # 2.3 GB if real
    saved: dict[str, Any] = {"model": model.state_dict(), "real": torch.arange(3.0)}
    result = asyncstore.torch.save(saved, url, **options)
    assert result.stored_bytes < MiB
    loaded = asyncstore.torch.load(url, weights_only=weights_only, **options)
    assert loaded["model"]["weight"].is_meta
    assert loaded["model"]["weight"].shape == model.weight.shape
    assert torch.equal(loaded["real"], saved["real"])
    only = asyncstore.torch.load(url, keys=["model"], **options)
    assert only["model"]["bias"].is_meta


def test_into_refuses_a_saved_meta_tensor_before_changing_anything(tmp_path: Path) -> None:
    saved = {"a": torch.ones(3), "m": torch.empty(3, device="meta")}
    asyncstore.torch.save(saved, tmp_path / "m.ckpt")
    torch.save(saved, tmp_path / "m.pt")
    for name in ("m.ckpt", "m.pt"):
        into = {"a": torch.zeros(3), "m": torch.zeros(3)}
        with pytest.raises(InvalidArgument, match=r"into\['m'\]: the checkpoint holds a tensor"):
            asyncstore.torch.load(tmp_path / name, into=into)
        assert not into["a"].any()


def test_meta_storages_have_a_size_and_no_chunks(tmp_path: Path) -> None:
    path = tmp_path / "s.ckpt"
    storage = torch.UntypedStorage(1 << 30, device="meta")  # type: ignore[no-untyped-call]
    asyncstore.torch.save({"s": storage, "t": torch.ones(2)}, path)
    manifest = run_sync(asyncstore.checkpoint.read_manifest(path))
    (meta,) = [s for s in manifest.storages if s.location == "meta"]
    assert meta.nbytes == 1 << 30
    assert meta.chunks == ()
    assert manifest.raw_bytes < MiB
    run_sync(asyncstore.checkpoint.verify(path))
    for mapped in (False, True):
        loaded = asyncstore.torch.load(path, mmap=mapped, weights_only=False)
        back = loaded["s"]
        if isinstance(back, torch.storage.TypedStorage):
            back = back._untyped_storage
        assert back.device.type == "meta"
        assert back.nbytes() == 1 << 30
        assert torch.equal(loaded["t"], torch.ones(2))


@pytest.mark.anyio
async def test_the_manifest_allows_no_chunks_to_meta_storages_only() -> None:
    structure = write_pickle({"t": rebuild(StorageRef(0, "float32"), 0, [4], [1])})
    for location, outcome in (("meta", None), ("cpu", "do not add up to its size")):
        blob = forge(Forged(structure, [ForgedStorage(b"", "float32", location, nbytes=16)]))
        async with asyncstore.open_store(f"memory://meta-{location}") as store:
            await store.put("k", blob)
            if outcome is None:
                assert (await asyncstore.load((store, "k")))["t"].is_meta
            else:
                with pytest.raises(IntegrityError, match=outcome):
                    await asyncstore.load((store, "k"))


# -- MAP_SHARED ----------------------------------------------------------------------------


def test_a_map_shared_load_is_the_files_writable_home(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    saved = torch.nn.Linear(300, 500).state_dict()
    asyncstore.torch.save(saved, path, compression=None)
    # MAP_PRIVATE: changes stay in memory, and the file still verifies.
    private = asyncstore.torch.load(path, mmap=True)
    private["weight"][0, 0] = 0.0
    again = asyncstore.torch.load(path, mmap=True)
    assert torch.equal(again["weight"], saved["weight"])
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        shared = asyncstore.torch.load(path, mmap=True)
        shared["weight"][0, 0] = 0.0
        shared["bias"][:] = 7.0
        seen = asyncstore.torch.load(path, mmap=True)  # not verified: the caller's bytes
    assert seen["weight"][0, 0].item() == 0.0
    assert torch.equal(seen["bias"], shared["bias"])
    assert torch.equal(seen["weight"][1:], saved["weight"][1:])
    # Anything else verifies, and finds the file changed.
    for mapped in (False, True):
        with pytest.raises(IntegrityError, match="does not match its checksum"):
            asyncstore.torch.load(path, mmap=mapped)
    with pytest.raises(IntegrityError):
        run_sync(asyncstore.checkpoint.verify(path))


def test_the_default_mmap_option_is_read_on_the_callers_thread(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save({"w": torch.ones(64)}, path, compression=None)
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
    try:
        asyncstore.torch.load(path, mmap=True)["w"][0] = 5.0
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    assert os.path.getsize(path) > 0
    with pytest.raises(IntegrityError):
        asyncstore.torch.load(path, mmap=True)  # MAP_PRIVATE again: verified
