"""``save(..., format="torch")``: the file ``torch.save`` writes, byte for byte, written
through asyncstore's stores (paths, ``file://``, S3, ``(store, key)``, file objects),
atomically, with the same snapshot contract as asyncstore's own format."""

from __future__ import annotations

import asyncio
import collections
import io
import os
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import asyncstore
import asyncstore.torch
from asyncstore.checkpoint import _torchformat
from asyncstore.errors import InvalidArgument, StoreError, StoreUnavailable, UnsafeCheckpoint
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import MiB, s3_options, unique
from ..helpers import assert_same_bytes

pytestmark = pytest.mark.anyio

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def state() -> dict[str, Any]:
    """A state dict as training code saves one: shared storages and views, every common
    dtype, a Parameter, an OrderedDict with torch's _metadata, and plain values."""
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    weights: collections.OrderedDict[str, Any] = collections.OrderedDict(
        weight=torch.nn.Parameter(torch.randn(4, 3)),
        bias=torch.zeros(4),
    )
    weights._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "base": base,
        "view": base[2:, 3:],  # a view into base's storage, not contiguous
        "transposed": base.t(),
        "tied": base,  # the same tensor twice
        "model": weights,
        "dtypes": {str(d): (torch.arange(10) % 2).to(d) for d in DTYPES},
        "step": 1200,
        "lr": 3e-4,
        "name": "run-7",
        "history": [1.5, 1.25, None, (True, b"x")],
    }


def torch_bytes(obj: Any, **kwargs: Any) -> bytes:
    """What ``torch.save`` writes for ``obj`` into a file object."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    return buffer.getvalue()


def assert_sharing(loaded: dict[str, Any]) -> None:
    """The views and the tied entry share ``base``'s storage, as they did when saved."""
    pointer = loaded["base"].untyped_storage().data_ptr()
    for key in ("view", "transposed", "tied"):
        assert loaded[key].untyped_storage().data_ptr() == pointer, key


async def test_the_file_is_torch_save_bytes_and_both_loads_read_it(tmp_path: Path) -> None:
    obj = state()
    path = tmp_path / "step-1.pt"
    result = await (await asyncstore.save(obj, path, format="torch"))
    data = path.read_bytes()
    assert data == torch_bytes(obj)
    for loaded in (
        torch.load(path, weights_only=True),
        torch.load(io.BytesIO(data), weights_only=False),
        await asyncstore.load(path),
    ):
        assert_same_bytes(loaded, obj)
        assert_sharing(loaded)
        assert isinstance(loaded["model"]["weight"], torch.nn.Parameter)
    # The result tells what was written.
    archive = zipfile.ZipFile(path)
    storages = [n for n in archive.namelist() if "/data/" in n]
    pickled = archive.getinfo("archive/data.pkl").file_size
    assert result.url == path.as_uri()
    assert result.storages == len(storages) == 3 + len(DTYPES)  # base, weight, bias, dtypes
    assert result.raw_bytes == pickled + sum(archive.getinfo(n).file_size for n in storages)
    assert result.stored_bytes == len(data)
    assert result.digest == xxhash.xxh3_64_hexdigest(data)
    assert (result.chunks, result.compressed_storages, result.skipped_bytes) == (0, 0, 0)
    assert 0 <= result.snapshot_seconds <= result.total_seconds


async def test_pickle_keywords_pass_to_torch(tmp_path: Path) -> None:
    obj = state()
    used: list[int] = []

    class Pickler(pickle.Pickler):
        def dump(self, value: Any) -> None:
            used.append(1)
            super().dump(value)

    module = types.ModuleType("recording_pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    path = tmp_path / "p.pt"
    await (await asyncstore.save(obj, path, format="torch", pickle_protocol=4))
    assert path.read_bytes() == torch_bytes(obj, pickle_protocol=4)
    await (await asyncstore.save(obj, path, format="torch", pickle_module=module))
    assert used == [1]
    assert path.read_bytes() == torch_bytes(obj, pickle_module=module)
    with pytest.raises(InvalidArgument, match="pickle_protocol=1"):
        await asyncstore.save(obj, path, format="torch", pickle_protocol=1)
    with pytest.raises(InvalidArgument, match="has no Pickler"):
        await asyncstore.save(obj, path, format="torch", pickle_module=types)


async def test_a_change_after_the_call_does_not_reach_the_file(tmp_path: Path) -> None:
    # Larger than a piece: the write goes on in several, well after the call returned.
    big = torch.arange(6 * MiB, dtype=torch.float32)  # 24 MiB
    obj: dict[str, Any] = {"big": big, "small": torch.ones(3), "names": ["a", "b"]}
    expected = torch_bytes(obj)
    path = tmp_path / "snap.pt"
    handle = await asyncstore.save(obj, path, format="torch")
    assert not handle.done()  # nothing written yet: the write runs in the background
    big.fill_(-1.0)
    obj["small"].add_(5)
    obj["names"].append("c")
    obj["late"] = torch.zeros(1)
    result = await handle
    assert path.read_bytes() == expected
    assert result.stored_bytes == len(expected)


async def test_a_state_larger_than_staging_bytes_is_written_before_the_call_returns(
    tmp_path: Path,
) -> None:
    # The snapshot copies at most staging_bytes; past it, the caller's own tensors are
    # written, and the call returns only once they are.
    first = torch.full((5 * MiB,), 1.0)  # 20 MiB: copied
    second = torch.full((5 * MiB,), 2.0)  # 20 MiB more: past a 32 MiB budget
    obj = {"first": first, "second": second}
    expected = torch_bytes(obj)
    path = tmp_path / "large.pt"
    handle = await asyncstore.save(obj, path, format="torch", staging_bytes=32 * MiB)
    assert handle.done()
    first.zero_()
    second.zero_()
    result = await handle
    assert path.read_bytes() == expected
    assert result.snapshot_seconds == result.total_seconds  # the caller waited for it all


async def test_a_failure_midway_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    old = torch_bytes({"old": torch.ones(2)})
    path.write_bytes(old)

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise TypeError("this object refuses to be pickled")

    with pytest.raises(UnsafeCheckpoint, match="refuses to be pickled"):
        await asyncstore.save({"a": torch.randn(1000), "b": Unpicklable()}, path, format="torch")
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["model.pt"]  # no temp file left behind


async def test_a_cancelled_save_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    old = torch_bytes({"old": torch.ones(2)})
    path.write_bytes(old)
    obj = {"big": torch.randn(16 * MiB)}  # 64 MiB: eight pieces
    handle = await asyncstore.save(obj, path, format="torch")
    await asyncio.sleep(0)  # the write has started
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["model.pt"]
    # The target is free again: the next save to it goes through.
    await (await asyncstore.save(obj, path, format="torch"))
    assert path.read_bytes() == torch_bytes(obj)


async def test_a_failing_store_leaves_the_old_object(
    seaweedfs: SeaweedFS, fresh_bucket: str, proxy: FaultProxy
) -> None:
    options = s3_options(seaweedfs, endpoint_url=proxy.url, max_attempts=2, retry_base_delay=0.01)
    url = f"s3://{fresh_bucket}/run/model.pt"
    old = {"old": torch.ones(2)}
    await (await asyncstore.save(old, url, format="torch", store_options=options))
    obj = {"big": torch.randn(4 * MiB)}  # 16 MiB: a multipart upload of 5 MiB parts
    proxy.fail_next(10, status=500, match="partNumber=2")
    handle = await asyncstore.save(obj, url, format="torch", store_options=options)
    with pytest.raises((StoreUnavailable, StoreError)):
        await handle
    proxy.reset()
    async with asyncstore.open_store(f"s3://{fresh_bucket}", **options) as store:
        assert await store.get("run/model.pt") == torch_bytes(old)
        assert [info.key async for info in store.list("")] == ["run/model.pt"]
    assert seaweedfs.list_multipart_uploads(fresh_bucket, "run/") == []  # none left behind


async def test_every_kind_of_target(
    run_url: tuple[str, dict[str, Any] | None], tmp_path: Path
) -> None:
    url, options = run_url
    obj = state()
    expected = torch_bytes(obj)
    key = f"{unique('t')}/model.pt"
    # A URL or path, and a (store, key) pair of the same store.
    await (await asyncstore.save(obj, f"{url}/{key}", format="torch", store_options=options))
    async with asyncstore.open_store(url, **(options or {})) as store:
        assert await store.get(key) == expected
        await (await asyncstore.save(obj, (store, "pair.pt"), format="torch"))
        data = await store.get("pair.pt")
    assert data == expected
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert_same_bytes(loaded, obj)
    assert_sharing(loaded)


async def test_file_urls_and_file_objects(tmp_path: Path) -> None:
    obj = state()
    expected = torch_bytes(obj)
    target = tmp_path / "my dir" / "a b.pt"
    target.parent.mkdir()
    await (await asyncstore.save(obj, target.as_uri(), format="torch"))
    assert target.read_bytes() == expected
    # A file object: written where it stands, after what it holds, as torch.save does.
    buffer = io.BytesIO()
    buffer.write(b"header")
    result = await (await asyncstore.save(obj, buffer, format="torch"))
    assert buffer.getvalue() == b"header" + expected
    assert result.stored_bytes == len(expected)
    buffer.seek(len(b"header"))
    assert_same_bytes(torch.load(buffer, weights_only=True), obj)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("compression", "zstd"),
        ("level", 3),
        ("chunk_bytes", 8 * MiB),
        ("exclude", ["*.embed*"]),
        ("metadata", {"step": 1}),
    ],
)
async def test_options_torch_format_has_no_place_for_are_refused(
    tmp_path: Path, option: str, value: Any
) -> None:
    path = tmp_path / "x.pt"
    with pytest.raises(InvalidArgument, match=rf"format='torch' with {option}="):
        await asyncstore.save({"a": torch.ones(1)}, path, format="torch", **{option: value})
    with pytest.raises(InvalidArgument, match=rf"{option}="):
        asyncstore.torch.save({"a": torch.ones(1)}, path, format="torch", **{option: value})
    assert not path.exists()


async def test_defaults_and_no_compression_are_accepted_and_a_bad_format_refused(
    tmp_path: Path,
) -> None:
    obj = {"a": torch.ones(3)}
    path = tmp_path / "x.pt"
    await (
        await asyncstore.save(
            obj, path, format="torch", compression=None, level=1, exclude=(), metadata={}
        )
    )
    assert path.read_bytes() == torch_bytes(obj)
    with pytest.raises(InvalidArgument, match=r"format='pt'"):
        await asyncstore.save(obj, path, format="pt")  # type: ignore[arg-type]


def test_the_sync_functions_forward_format(tmp_path: Path) -> None:
    obj = state()
    path = tmp_path / "sync.pt"
    asyncstore.torch.save(obj, path, format="torch")
    assert path.read_bytes() == torch_bytes(obj)
    other = tmp_path / "async.pt"
    future = asyncstore.torch.save_async(obj, other, format="torch")
    result = future.result()
    assert other.read_bytes() == torch_bytes(obj)
    assert result.stored_bytes == other.stat().st_size
    assert_same_bytes(asyncstore.torch.load(other), obj)


@pytest.mark.parametrize(
    "keyword",
    [{"_use_new_zipfile_serialization": False}, {"_disable_byteorder_record": True}],
)
def test_torch_keywords_that_would_change_the_file_are_refused(
    tmp_path: Path, keyword: dict[str, bool]
) -> None:
    # They choose torch's legacy format or leave out its byte-order record: format="torch"
    # writes neither, and says so rather than writing something else.
    with pytest.raises(InvalidArgument, match=f"{next(iter(keyword))}=.*format='torch'"):
        asyncstore.torch.save(state(), tmp_path / "x.pt", format="torch", **keyword)  # type: ignore[arg-type]
    assert not (tmp_path / "x.pt").exists()
    asyncstore.torch.save(state(), tmp_path / "y.ckpt", **keyword)  # type: ignore[arg-type]
    assert (tmp_path / "y.ckpt").exists()  # asyncstore's format: accepted, as documented


async def test_skip_data_set_by_the_caller_is_honoured(tmp_path: Path) -> None:
    obj = state()
    path = tmp_path / "skipped.pt"
    with torch.serialization.skip_data():
        expected = torch_bytes(obj)
        handle = await asyncstore.save(obj, path, format="torch")
    await handle
    assert path.read_bytes() == expected
    loaded = torch.load(path, weights_only=True)
    assert loaded["base"].shape == obj["base"].shape
    assert not loaded["base"].any()  # the storages' places hold zeros
    assert expected != torch_bytes(obj)


def test_skip_data_reaches_the_sync_functions(tmp_path: Path) -> None:
    # They run the save on asyncstore's loop thread: the caller's skip_data() is carried.
    obj = state()
    path = tmp_path / "skipped.pt"
    with torch.serialization.skip_data():
        expected = torch_bytes(obj)
        asyncstore.torch.save(obj, path, format="torch")
    assert path.read_bytes() == expected


async def test_fake_tensors_save_as_torch_saves_them(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {"w": torch.randn(64, 32), "b": torch.zeros(32)}
    path = tmp_path / "fake.pt"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        expected = torch_bytes(fake)
        handle = await asyncstore.save(fake, path, format="torch")
    await handle
    assert path.read_bytes() == expected
    loaded = torch.load(path, weights_only=True)
    assert loaded["w"].shape == (64, 32)
    assert type(loaded["w"]) is torch.Tensor


def test_only_the_callers_host_storages_are_copied() -> None:
    # Known host storages (a state dict's) are copied; a storage torch made itself (a
    # device tensor's copy on the host) is kept; when the object is more than containers
    # of tensors, every storage is copied.
    held = torch.ones(4)
    fresh = torch.zeros(4).untyped_storage()
    walked = _torchformat._held_storages({"a": [held, (1, "x")], "b": held[1:]})
    assert walked == frozenset({held.untyped_storage()._cdata})
    records = _torchformat._Records(walked, budget=1 << 20)
    records.write_record("data/0", held.untyped_storage(), 16)
    records.write_record("data/1", fresh, 16)
    copy, kept = (record.data for record in records.records)
    assert copy.data_ptr() != held.data_ptr()
    assert kept is fresh
    assert records.copied == 16

    class Box:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    assert _torchformat._held_storages({"a": Box(held)}) is None
    with_attribute = torch.ones(2)
    with_attribute.scale = torch.ones(1)  # type: ignore[attr-defined]
    assert _torchformat._held_storages([with_attribute]) is None
    records = _torchformat._Records(None, budget=1 << 20)
    records.write_record("data/0", fresh, 16)
    assert records.records[0].data is not fresh
