"""``weights_only=True`` on asyncstore's own files follows torch's rules: what torch's
allow-list loads (sparse, nested, meta and wrapper-subclass tensors, parameters with Python
attributes, ``Counter``, what ``add_safe_globals`` allows) loads, with torch's error types
and wording; and our own checks still refuse what a crafted file could do with them."""

from __future__ import annotations

import collections
import datetime
import pickle
import zoneinfo
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import asyncstore
import asyncstore.torch
from asyncstore import UnsafeCheckpoint

from ..forge import Call, Forged, ForgedStorage, Global, StorageRef, forge, rebuild, write_pickle
from .helpers import load_forged

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings(
        "ignore:Sparse CSR tensor support is in beta state:UserWarning",
        "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
        "ignore:Sparse invariant checks are implicitly disabled:UserWarning",
    ),
]


def round_trip(obj: Any, path: Path, **load_options: Any) -> Any:
    asyncstore.torch.save(obj, path)
    return asyncstore.torch.load(path, **load_options)


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr", "bsc"])
def test_sparse_tensors_load_with_weights_only(tmp_path: Path, layout: str) -> None:
    dense = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 3.0]])
    sparse = {
        "coo": dense.to_sparse(),
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((1, 2)),
        "bsc": dense.to_sparse_bsc((1, 2)),
    }[layout]
    loaded = round_trip({"s": sparse}, tmp_path / "s.ckpt", weights_only=True)["s"]
    assert loaded.layout == sparse.layout
    assert torch.equal(loaded.to_dense(), dense)


def sparse_coo(indices: list[list[int]], size: tuple[int, ...], coalesced: bool) -> bytes:
    # A COO tensor whose indices and values lie in storages 0 and 1 of a forged file.
    count = len(indices[0])
    flat = [i for row in indices for i in row]
    structure = Call(
        Global("torch._utils", "_rebuild_sparse_tensor"),
        Call(Global("torch.serialization", "_get_layout"), "torch.sparse_coo"),
        (
            rebuild(StorageRef(0, "int64"), 0, [len(indices), count], [count, 1]),
            rebuild(StorageRef(1, "float32"), 0, [count], [1]),
            Call(Global("torch", "Size"), size),
            coalesced,
        ),
    )
    index_bytes = torch.tensor(flat, dtype=torch.int64).numpy().tobytes()
    value_bytes = torch.ones(count).numpy().tobytes()
    return forge(
        Forged(
            write_pickle(structure),
            [
                ForgedStorage(index_bytes, dtype="int64", name="i", id=0),
                ForgedStorage(value_bytes, dtype="float32", name="v", id=1),
            ],
        )
    )


async def test_a_genuine_forged_sparse_tensor_loads() -> None:
    # The forging itself is right: the same tensor with its indices inside its shape loads.
    loaded = await load_forged(sparse_coo([[0, 1], [2, 3]], (2, 4), coalesced=True))
    assert torch.equal(loaded.to_dense(), torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 1.0]]))


@pytest.mark.parametrize(
    ("indices", "size", "coalesced"),
    [
        ([[0, 5], [0, 0]], (2, 4), False),  # a row past the shape: a write out of bounds
        ([[0, 1], [0, 9]], (2, 4), False),
        ([[0, -1], [0, 0]], (2, 4), False),
        ([[1, 0], [0, 0]], (2, 4), True),  # claims coalesced, is not sorted
    ],
)
async def test_sparse_indices_outside_the_shape_are_refused(
    indices: list[list[int]], size: tuple[int, ...], coalesced: bool
) -> None:
    # torch validates sparse tensors only when invariant checks are switched on; a crafted
    # index would make later operations touch memory outside the values.
    with pytest.raises(UnsafeCheckpoint, match="sparse tensor is not valid"):
        await load_forged(sparse_coo(indices, size, coalesced))


def test_nested_tensors_load_with_weights_only(tmp_path: Path) -> None:
    nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    loaded = round_trip(nested, tmp_path / "n.ckpt", weights_only=True)
    assert loaded.is_nested
    assert [t.tolist() for t in loaded.unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]


async def test_a_nested_tensor_past_its_buffer_is_refused() -> None:
    # Two components of sizes 3 and 1 over a buffer of 4 floats, the second at offset 1000.
    def ints(values: list[int], id: int) -> ForgedStorage:
        data = torch.tensor(values, dtype=torch.int64).numpy().tobytes()
        return ForgedStorage(data, dtype="int64", name=f"s{id}", id=id)

    structure = Call(
        Global("torch._utils", "_rebuild_nested_tensor"),
        rebuild(StorageRef(0, "float32"), 0, [4], [1]),
        rebuild(StorageRef(1, "int64"), 0, [2, 1], [1, 1]),
        rebuild(StorageRef(2, "int64"), 0, [2, 1], [1, 1]),
        rebuild(StorageRef(3, "int64"), 0, [2], [1]),
    )
    storages = [floats4(), ints([3, 1], 1), ints([1, 1], 2), ints([0, 1000], 3)]
    with pytest.raises(UnsafeCheckpoint, match="nested tensor is not valid"):
        await load_forged(forge(Forged(write_pickle(structure), storages)))


def test_wrapper_subclasses_load_once_allowed(tmp_path: Path) -> None:
    t = TwoTensor(torch.randn(2, 3), torch.randn(2, 3))  # type: ignore[no-untyped-call]
    path = tmp_path / "two.ckpt"
    asyncstore.torch.save({"t": t}, path)
    with pytest.raises(
        pickle.UnpicklingError,
        match=r"Unsupported global: GLOBAL torch\.testing\._internal\.two_tensor\.TwoTensor",
    ):
        asyncstore.torch.load(path, weights_only=True)
    with torch.serialization.safe_globals([TwoTensor]):
        loaded = asyncstore.torch.load(path, weights_only=True)["t"]
    assert type(loaded) is TwoTensor
    assert torch.equal(loaded.a, t.a)
    assert torch.equal(loaded.b, t.b)
    # The same through asyncstore's own keyword.
    assert type(asyncstore.torch.load(path, safe_globals=[TwoTensor])["t"]) is TwoTensor


async def test_a_wrapper_subclass_not_allowed_is_refused_even_if_named_directly() -> None:
    # _rebuild_wrapper_subclass is allowed; the class it builds must be one the caller allowed.
    structure = Call(
        Global("torch._utils", "_rebuild_wrapper_subclass"),
        Global("torch", "Tensor"),
        Global("torch", "float32"),
        Call(Global("torch", "Size"), (2,)),
        (1,),
        0,
        Call(Global("torch.serialization", "_get_layout"), "torch.strided"),
        "cpu",
        False,
    )
    with pytest.raises(UnsafeCheckpoint, match="a type not allowed"):
        await load_forged(forge(Forged(write_pickle(structure))))


def test_parameters_and_tensors_keep_their_python_attributes(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    setattr(param, "foo", "foo")  # noqa: B010 (a new attribute the type does not declare)
    setattr(param, "pi", 3.14)  # noqa: B010
    loaded = round_trip(param, tmp_path / "p.ckpt", weights_only=True)
    assert isinstance(loaded, torch.nn.Parameter)
    assert (getattr(loaded, "foo"), getattr(loaded, "pi")) == ("foo", 3.14)  # noqa: B009


async def test_a_parameters_state_cannot_set_what_the_class_defines() -> None:
    structure = Call(
        Global("torch._utils", "_rebuild_parameter_with_state"),
        rebuild(StorageRef(0, "float32"), 0, [4], [1]),
        True,
        Call(Global("collections", "OrderedDict")),
        {"grad": None},
    )
    blob = forge(Forged(write_pickle(structure), [ForgedStorage(bytes(16), "float32")]))
    with pytest.raises(UnsafeCheckpoint, match="state sets 'grad'"):
        await load_forged(blob)


def test_meta_tensors_without_storage_load(tmp_path: Path) -> None:
    # torch pickles a meta tensor with no storage at all (_rebuild_meta_tensor_no_storage).
    structure = Call(
        Global("torch._utils", "_rebuild_meta_tensor_no_storage"),
        Global("torch", "float16"),
        (20000, 320000),
        (320000, 1),
        False,
    )
    path = tmp_path / "meta.ckpt"
    path.write_bytes(forge(Forged(write_pickle(structure))))
    loaded = asyncstore.torch.load(path, weights_only=True)
    assert loaded.is_meta
    assert loaded.shape == (20000, 320000)
    assert loaded.dtype == torch.float16


def test_counter_and_protocol_2_bytes_load(tmp_path: Path) -> None:
    state = {"counts": collections.Counter(a=2, b=1), "blob": b"\x00\xff", "t": torch.ones(2)}
    path = tmp_path / "p2.ckpt"
    asyncstore.torch.save(state, path, pickle_protocol=2)  # bytes via _codecs.encode
    loaded = asyncstore.torch.load(path, weights_only=True)
    assert loaded["counts"] == state["counts"]
    assert type(loaded["counts"]) is collections.Counter
    assert loaded["blob"] == b"\x00\xff"


async def test_codecs_encode_takes_only_latin1() -> None:
    structure = Call(Global("_codecs", "encode"), "eJw=", "base64")
    with pytest.raises(UnsafeCheckpoint, match="encodes a str as 'base64'"):
        await load_forged(forge(Forged(write_pickle(structure))))


def test_datetimes_with_zoneinfo_load_once_their_globals_are_allowed(tmp_path: Path) -> None:
    data: dict[str, Any] = {
        "a": torch.tensor([1, 2, 3]),
        "b": datetime.datetime(2025, 1, 1, 12, 0, tzinfo=zoneinfo.ZoneInfo(key="UTC")),
    }
    path = tmp_path / "dt.ckpt"
    asyncstore.torch.save(data, path)
    allowed: list[Any] = [datetime.datetime, getattr, zoneinfo.ZoneInfo]
    with (
        torch.serialization.safe_globals(allowed),
        pytest.raises(pickle.UnpicklingError, match=r"_unpickle.*zoneinfo\.ZoneInfo"),
    ):
        asyncstore.torch.load(path)
    # A method bound to a C type has no __module__: it is allowed by its pickled path.
    unpickle = zoneinfo.ZoneInfo._unpickle  # type: ignore[attr-defined]
    with torch.serialization.safe_globals([*allowed, unpickle]):
        loaded = asyncstore.torch.load(path)
    assert loaded["b"] == data["b"]
    assert torch.equal(loaded["a"], data["a"])


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (print, r"Weights only load failed\. Unsupported global: GLOBAL print was not an allowed"),
        (
            collections.ChainMap,
            r"add_safe_globals\(\[collections\.ChainMap\]\)` or .* to allowlist",
        ),
    ],
)
def test_refusals_are_worded_as_torchs(tmp_path: Path, obj: Any, message: str) -> None:
    path = tmp_path / "x.ckpt"
    asyncstore.torch.save({"x": obj}, path)
    with pytest.raises(pickle.UnpicklingError, match=message) as caught:
        asyncstore.torch.load(path, weights_only=True)
    assert isinstance(caught.value, UnsafeCheckpoint)
    assert str(path) in str(caught.value)  # and which file it was


async def test_crafted_refusals_say_torchs_words_and_ours() -> None:
    blob = forge(
        Forged(write_pickle(rebuild(StorageRef(0, "float32"), 0, [30000], [1])), [floats4()])
    )
    with pytest.raises(UnsafeCheckpoint) as caught:
        await load_forged(blob)
    text = str(caught.value)
    assert "Weights only load failed: a tensor of size (30000,) reaches byte 120,000" in text
    assert "file an issue with the following so that we can make `weights_only=True`" in text


def floats4() -> ForgedStorage:
    return ForgedStorage(torch.arange(4.0).numpy().tobytes(), dtype="float32")


def test_njt_names_the_modules_to_import(tmp_path: Path) -> None:
    # Nested jagged tensors need torch.nested and torch._dynamo imported first (they register
    # their classes with add_safe_globals); without them, torch's message says so.
    structure = Call(Global("torch.nested._internal.nested_tensor", "_rebuild_njt"), {})
    path = tmp_path / "njt.ckpt"
    path.write_bytes(forge(Forged(write_pickle(structure))))
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(
            pickle.UnpicklingError, match=r"``torch\.nested`` and ``torch\._dynamo`` must be"
        ):
            asyncstore.torch.load(path, weights_only=True)
    finally:
        torch.serialization.add_safe_globals(saved)
