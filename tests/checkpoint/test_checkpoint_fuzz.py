"""The checkpoint reader against generated hostile files.

Two generators, each with every checksum recomputed, so that only the loader's own checks
stand between the file and the caller:

- structures (pickles) built from the globals ``weights_only=True`` allows, plus forbidden
  ones, with any offsets, sizes, strides, dtypes, storage ids, hooks and state;
- manifests of a real checkpoint with any field changed: sizes, offsets, codecs, dtypes,
  locations, ids, entries.

Every case must either load, and then give exactly what the reference gives (``torch.load``
with ``weights_only=True`` on the same pickle and bytes in a ``torch.save`` zip file, or the
saved object for a manifest edit), or raise an asyncstore error; never another exception,
never more than a bounded amount of memory, never for longer than a bounded time.
"""

from __future__ import annotations

import io
import math
import os
import time
import zipfile
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import asyncstore
from asyncstore import AsyncStoreError
from asyncstore.checkpoint import _format as fmt

from ..conftest import unique
from ..forge import Build, Call, Forged, ForgedStorage, Global, Pid, StorageRef, forge, write_pickle
from .helpers import peak_rss, reset_peak_rss, rewrite_manifest

pytestmark = pytest.mark.anyio

MiB = 1 << 20
MEMORY_BOUND = 256 * MiB  # peak resident memory a load of a file of a few KB may add
TIME_BOUND = 10.0  # seconds one such load may take, on a loaded 2-core machine

# The dtypes the generator gives storages, with torch.save's legacy storage class for each.
STORAGE_CLASSES = {
    "float32": "FloatStorage",
    "float64": "DoubleStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
}
# What weights_only=True loads beyond torch.load's list; the reference is given them too.
EXTRAS: list[Any] = [range, slice, frozenset]

# ASYNCSTORE_FUZZ_EXAMPLES=5000 for a longer hunt than the suite's.
settings_ = settings(
    max_examples=int(os.environ.get("ASYNCSTORE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- the reference: the same pickle and bytes as a torch.save file -----------------------------


def torch_pids(obj: Any, storages: list[tuple[str, bytes]], records: dict[str, bytes]) -> Any:
    """``obj`` with every :class:`StorageRef` to a known storage turned into torch.save's
    persistent id ``("storage", torch.XStorage, key, "cpu", numel)``.

    torch.load gives every reference to one key the dtype of the first, whereas a
    reference of ours carries its own (views of one storage as two dtypes), so each
    (storage, dtype) pair gets a record of its own, holding the same bytes."""

    def convert(item: Any) -> Any:
        return torch_pids(item, storages, records)

    if isinstance(obj, StorageRef):
        known = type(obj.id) is int and 0 <= obj.id < len(storages)
        if not known or obj.dtype not in STORAGE_CLASSES:
            return obj  # ours refuses these; left as they are, torch.load refuses them too
        data = storages[obj.id][1]
        numel = len(data) // getattr(torch, obj.dtype).itemsize
        key = f"{obj.id}-{obj.dtype}"
        records[key] = data[: numel * getattr(torch, obj.dtype).itemsize]
        return Pid(("storage", Global("torch", STORAGE_CLASSES[obj.dtype]), key, "cpu", numel))
    if isinstance(obj, Call):
        return Call(convert(obj.func), *(convert(a) for a in obj.args))
    if isinstance(obj, Build):
        return Build(convert(obj.obj), convert(obj.state))
    if isinstance(obj, tuple):
        return tuple(convert(a) for a in obj)
    if isinstance(obj, list):
        return [convert(a) for a in obj]
    if isinstance(obj, dict):
        return {k: convert(v) for k, v in obj.items()}
    return obj


def torch_file(obj: Any, storages: list[tuple[str, bytes]]) -> bytes:
    records: dict[str, bytes] = {}
    body = write_pickle(torch_pids(obj, storages, records), plain_protocol=2)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", body)
        for key, data in records.items():
            archive.writestr(f"archive/data/{key}", data)
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/byteorder", "little")
    return out.getvalue()


def reference_load(data: bytes) -> Any:
    with torch.serialization.safe_globals(EXTRAS):
        return torch.load(io.BytesIO(data), weights_only=True)


def same(a: Any, b: Any, path: str = "") -> None:
    """Assert that two loaded objects are the same, tensors by value and layout."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.requires_grad,
        ), path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            same(a[key], b[key], f"{path}.{key}")
        assert getattr(a, "__dict__", {}).keys() == getattr(b, "__dict__", {}).keys(), path
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


# -- generated structures ----------------------------------------------------------------------

ints = st.one_of(st.integers(-2, 40), st.sampled_from([2**31, 2**40, 2**63, -(2**63)]))
hashable = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.text(max_size=4),
    st.binary(min_size=1, max_size=4),
)
plain = st.one_of(hashable, st.floats(allow_nan=False))


@st.composite
def tensors(draw: st.DrawFn, storages: list[tuple[str, bytes]]) -> Call:
    sid = draw(st.integers(-1, len(storages)))
    if 0 <= sid < len(storages) and draw(st.integers(0, 9)):
        dtype = storages[sid][0]
    else:
        dtype = draw(st.sampled_from([*STORAGE_CLASSES, "not_a_dtype", "Tensor", "qint8"]))
    ndim = draw(st.integers(0, 3))
    size = tuple(draw(st.lists(ints, min_size=ndim, max_size=ndim)))
    stride = tuple(draw(st.lists(ints, min_size=ndim, max_size=ndim)))
    if draw(st.booleans()):
        # Half of them contiguous views that may fit: the rest are anything at all.
        known = 0 <= sid < len(storages) and isinstance(getattr(torch, dtype, None), torch.dtype)
        count = len(storages[sid][1]) // getattr(torch, dtype).itemsize if known else 4
        size = (draw(st.integers(0, count + 1)),)
        stride = (1,)
    offset = draw(st.one_of(st.integers(0, 3), ints))
    hooks: Any = Call(Global("collections", "OrderedDict"))
    if not draw(st.integers(0, 9)):
        hooks = Call(Global("collections", "OrderedDict"), [(0, Global("torch", "Size"))])
    size_arg: Any = Call(Global("torch", "Size"), size) if draw(st.booleans()) else size
    args = [StorageRef(sid, dtype), offset, size_arg, stride, draw(st.booleans()), hooks]
    tensor = Call(Global("torch._utils", "_rebuild_tensor_v2"), *args)
    if not draw(st.integers(0, 4)):
        return Call(
            Global("torch._utils", "_rebuild_parameter"), tensor, draw(st.booleans()), hooks
        )
    return tensor


def leaves(storages: list[tuple[str, bytes]]) -> st.SearchStrategy[Any]:
    big = st.sampled_from([2**40, 10**12, -1])
    return st.one_of(
        plain,
        tensors(storages),
        st.builds(
            lambda d: Call(Global("torch", "Size"), tuple(d)),
            st.lists(st.integers(0, 9), max_size=3),
        ),
        st.builds(
            lambda n: Call(Global("torch", "Size"), Call(Global("builtins", "range"), n)), big
        ),
        st.just(Call(Global("torch", "device"), "cpu")),
        st.sampled_from([Global("torch", name) for name in ("float32", "bfloat16", "int8")]),
        st.builds(
            lambda b: Call(Global("builtins", "bytearray"), b), st.binary(min_size=1, max_size=8)
        ),
        st.builds(lambda n: Call(Global("builtins", "bytearray"), n), big),
        st.builds(
            lambda a, b: Call(Global("builtins", "complex"), a, b),
            st.floats(-9, 9),
            st.floats(-9, 9),
        ),
        st.builds(lambda a, b: Call(Global("builtins", "range"), a, b), ints, ints),
        st.builds(lambda a, b: Call(Global("builtins", "slice"), a, b), ints, ints),
        st.builds(
            lambda items: Call(Global("builtins", "set"), items), st.lists(hashable, max_size=4)
        ),
        st.builds(
            lambda n: Call(Global("builtins", "set"), Call(Global("builtins", "range"), n)), big
        ),
        st.builds(
            lambda items: Call(Global("builtins", "frozenset"), items),
            st.lists(hashable, max_size=4),
        ),
        st.sampled_from(
            [
                Call(Global("os", "system"), "echo crafted"),
                Call(Global("builtins", "eval"), "1"),
                Global("torch", "FloatStorage"),
                Call(Global("torch", "load"), "x"),
            ]
        ),
    )


def structures(storages: list[tuple[str, bytes]]) -> st.SearchStrategy[Any]:
    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        keys = st.text(max_size=3)
        return st.one_of(
            st.lists(children, min_size=1, max_size=4),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.dictionaries(keys, children, min_size=1, max_size=4),
            st.builds(
                lambda d: Call(Global("collections", "OrderedDict"), list(d.items())),
                st.dictionaries(keys, children, min_size=1, max_size=3),
            ),
            st.builds(
                lambda d, m: Build(Call(Global("collections", "OrderedDict"), list(d.items())), m),
                st.dictionaries(keys, children, min_size=1, max_size=3),
                st.sampled_from([{"_metadata": {"": {"version": 1}}}, {"__class__": 1}, [1]]),
            ),
            st.builds(Build, children, children),
        )

    return st.recursive(leaves(storages), extend, max_leaves=12)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Any, list[tuple[str, bytes]]]:
    storages = []
    for dtype in draw(st.lists(st.sampled_from(list(STORAGE_CLASSES)), max_size=3)):
        count = draw(st.integers(0, 12))
        values = torch.arange(count).to(getattr(torch, dtype))
        storages.append((dtype, bytes(values.untyped_storage()) if count else b""))
    return draw(structures(storages)), storages


async def load_bounded(blob: bytes, **options: Any) -> tuple[Any, BaseException | None]:
    """Load ``blob``; returns (object, None) or (None, the error), checking memory and time."""
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await store.put("k", blob)
        reset_peak_rss()
        before = peak_rss()
        start = time.monotonic()
        try:
            loaded = await asyncstore.load((store, "k"), **options)
        except AsyncStoreError as exc:
            reason = str(exc).removeprefix(f"memory://{store.url.split('://')[1]}/k")
            if currently_in_test_context():
                event(f"refused: {type(exc).__name__}: {reason.lstrip(': ')[:50]}")
            return None, exc
        else:
            if currently_in_test_context():
                event("loaded")
            return loaded, None
        finally:
            assert time.monotonic() - start < TIME_BOUND
            assert peak_rss() - before < MEMORY_BOUND


@given(case=cases())
@settings_
async def test_generated_structures_load_as_torch_load_does_or_are_refused(
    case: tuple[Any, list[tuple[str, bytes]]],
) -> None:
    structure, storages = case
    forged = [ForgedStorage(data, dtype) for dtype, data in storages]
    blob = forge(Forged(write_pickle(structure), forged))
    loaded, error = await load_bounded(blob)
    if error is not None:
        return
    # It loaded: the reference must load the same bytes and pickle to the same object.
    same(loaded, reference_load(torch_file(structure, storages)))


# -- generated manifests -----------------------------------------------------------------------

SAVED = {
    "w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
    "half": torch.arange(32, dtype=torch.float16),
    "step": 7,
}

numbers = st.one_of(
    st.integers(-2, 600),
    st.sampled_from([2**31, 2**40, 2**63 - 1, -(2**63), 10**12]),
)
strings = st.sampled_from(
    [
        *fmt.CODECS,
        "lz4",
        "",
        "float32",
        "int8",
        "bfloat16",
        "cpu",
        "cuda:0",
        "meta",
        "mps",
        "xpu:1",
        "bogus",
    ]
)
CHUNK_FIELDS = {"offset": numbers, "stored": numbers, "raw": numbers, "codec": strings}
CHUNK_FIELDS |= {"stored_xxh3": numbers, "raw_xxh3": numbers}
STORAGE_FIELDS = {"id": numbers, "nbytes": numbers, "dtype": strings}
STORAGE_FIELDS |= {"location": strings, "name": strings}


def field_edits(kind: str, fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    return st.one_of(
        [
            st.tuples(st.just(kind), st.integers(0, 5), st.just(name), value)
            for name, value in fields.items()
        ]
    )


def apply(manifest: fmt.Manifest, edits: list[tuple[Any, ...]]) -> fmt.Manifest:
    replace = msgspec.structs.replace
    for edit in edits:
        kind, index, field, value = edit
        storages = list(manifest.storages)
        try:
            if kind == "structure":
                manifest = replace(
                    manifest, structure=replace(manifest.structure, **{field: value})
                )
            elif kind == "storage":
                if not storages:
                    continue
                s = storages[index % len(storages)]
                storages[index % len(storages)] = replace(s, **{field: value})
                manifest = replace(manifest, storages=storages)
            elif kind == "chunk":
                if not storages:
                    continue
                s = storages[index % len(storages)]
                if not s.chunks:
                    continue
                chunks = list(s.chunks)
                chunks[index % len(chunks)] = replace(chunks[index % len(chunks)], **{field: value})
                storages[index % len(storages)] = replace(s, chunks=chunks)
                manifest = replace(manifest, storages=storages)
            elif kind == "entries":
                manifest = replace(
                    manifest, entries={"w": [value] if isinstance(value, int) else []}
                )
            elif kind == "drop" and storages:
                del storages[index % len(storages)]
                manifest = replace(manifest, storages=storages)
        except IndexError:
            continue  # no storage left to edit
    return manifest


edits = st.lists(
    st.one_of(
        field_edits("structure", CHUNK_FIELDS),
        field_edits("storage", STORAGE_FIELDS),
        field_edits("chunk", CHUNK_FIELDS),
        st.tuples(st.just("entries"), st.just(0), st.just(""), numbers),
        st.tuples(st.just("drop"), st.integers(0, 5), st.just(""), st.just(0)),
    ),
    min_size=1,
    max_size=3,
)
options = st.sampled_from(
    [{}, {"keys": ["w"]}, {"into": {"w": torch.zeros(8, 8)}}, {"map_location": "cpu"}]
)


@pytest.fixture(scope="module")
def saved_blob() -> bytes:
    import asyncio

    async def save() -> bytes:
        async with asyncstore.open_store(f"memory://{unique()}") as store:
            handle = await asyncstore.save(SAVED, (store, "good"), compression="zstd")
            await handle
            return await store.get("good")

    return asyncio.run(save())


@given(changes=edits, how=options)
@settings_
async def test_generated_manifests_load_what_was_saved_or_are_refused(
    saved_blob: bytes, changes: list[tuple[Any, ...]], how: dict[str, Any]
) -> None:
    def edit(manifest: fmt.Manifest) -> fmt.Manifest:
        return apply(manifest, changes)

    try:
        blob = rewrite_manifest(saved_blob, edit)
    except OverflowError:
        return  # a value msgpack cannot encode (an int past 64 bits): no file to load
    how = {k: ({"w": torch.zeros(8, 8)} if k == "into" else v) for k, v in how.items()}
    loaded, error = await load_bounded(blob, **how)
    if error is not None:
        return
    # It loaded: the edit changed nothing a load uses (a name, say), so it is what was saved.
    if "into" in how:
        assert loaded is how["into"]
        same(loaded["w"], SAVED["w"])
    elif "keys" in how:
        same(loaded["w"], SAVED["w"])
    else:
        same(loaded, SAVED)


def test_the_reference_loads_the_generators_valid_files() -> None:
    # The oracle itself: a file built from a valid structure loads the same through both.
    import asyncio

    storages = [("float32", bytes(torch.arange(6, dtype=torch.float32).untyped_storage()))]
    tensor = Call(
        Global("torch._utils", "_rebuild_tensor_v2"),
        StorageRef(0, "float32"),
        1,
        Call(Global("torch", "Size"), (2, 2)),
        (2, 1),
        False,
        Call(Global("collections", "OrderedDict")),
    )
    structure = {
        "t": tensor,
        "r": Call(Global("builtins", "range"), 3),
        "s": Call(Global("builtins", "set"), [1]),
    }
    reference = reference_load(torch_file(structure, storages))
    blob = forge(Forged(write_pickle(structure), [ForgedStorage(storages[0][1], "float32")]))
    loaded, error = asyncio.run(load_bounded(blob))
    assert error is None
    same(loaded, reference)
    assert torch.equal(loaded["t"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
