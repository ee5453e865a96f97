"""Crafted checkpoints: every checksum right, every trick a hostile file can play.

Each test builds its file byte by byte (``tests/forge.py``), so the only thing between the
file and the caller is the loader's own checks.
"""

from __future__ import annotations

import collections
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
from asyncstore import IntegrityError, InvalidArgument, UnsafeCheckpoint

from ..forge import (
    Build,
    Call,
    Forged,
    ForgedStorage,
    Global,
    StorageRef,
    forge,
    rebuild,
    write_pickle,
    zstd_bomb,
)
from .helpers import load_forged, peak_rss, reset_peak_rss

pytestmark = pytest.mark.anyio

MiB = 1 << 20


def floats(n: int) -> ForgedStorage:
    """A storage of ``n`` float32 values 0, 1, 2, …"""
    return ForgedStorage(bytes(torch.arange(n, dtype=torch.float32).untyped_storage()), "float32")


async def refused_within(blob: bytes, message: str, memory: int) -> None:
    """Loading ``blob`` raises UnsafeCheckpoint matching ``message``, and the process's peak
    resident memory grows by less than ``memory`` meanwhile."""
    reset_peak_rss()
    before = peak_rss()
    with pytest.raises(UnsafeCheckpoint, match=message):
        await load_forged(blob)
    assert peak_rss() - before < memory


# -- views past their storage (item: uninitialised heap memory) ------------------------------


async def test_a_view_past_its_storage_is_refused() -> None:
    # 30,000 floats over 16 bytes: a resizable storage would grow under set_, and the tensor
    # would show whatever the allocator had there.
    blob = forge(
        Forged(write_pickle(rebuild(StorageRef(0, "float32"), 0, [30000], [1])), [floats(4)])
    )
    with pytest.raises(
        UnsafeCheckpoint, match=r"size \(30000,\) reaches byte 120,000 of a storage of 16"
    ):
        await load_forged(blob)


@pytest.mark.parametrize(
    ("offset", "size", "stride"),
    [
        (1, [4], [1]),  # one element past the end
        (0, [2, 3], [3, 1]),  # 6 elements of 4
        (0, [3], [2]),  # stride walks past the end
        (-1, [1], [1]),
        (0, [-1], [1]),
        (0, [2], [-1]),
        (0, [1.5], [1]),
        (0, [2], [1, 1]),
        ("0", [1], [1]),
        (0, [1] * 300, [1] * 300),
    ],
)
async def test_every_view_is_checked_against_its_storage(
    offset: Any, size: list[Any], stride: list[Any]
) -> None:
    tensor = rebuild(StorageRef(0, "float32"), offset, size, stride, plain_size=True)
    blob = forge(Forged(write_pickle(tensor), [floats(4)]))
    with pytest.raises(UnsafeCheckpoint, match="tensor"):
        await load_forged(blob)


async def test_views_inside_their_storage_load_as_torch_load_builds_them() -> None:
    structure = {
        "whole": rebuild(StorageRef(0, "float32"), 0, [4], [1]),
        "tail": rebuild(StorageRef(0, "float32"), 2, [2], [1]),
        "strided": rebuild(StorageRef(0, "float32"), 0, [2, 2], [1, 2]),
        "expanded": rebuild(StorageRef(0, "float32"), 3, [5], [0]),
        "empty far away": rebuild(StorageRef(0, "float32"), 10**6, [0, 7], [1, 1]),
    }
    loaded = await load_forged(forge(Forged(write_pickle(structure), [floats(4)])))
    base = torch.arange(4.0)
    assert torch.equal(loaded["whole"], base)
    assert torch.equal(loaded["tail"], base[2:])
    assert torch.equal(loaded["strided"], base.view(2, 2).t())
    assert torch.equal(loaded["expanded"], torch.full((5,), 3.0))
    assert loaded["empty far away"].shape == (0, 7)


async def test_loaded_storages_cannot_grow(tmp_path: Path) -> None:
    # Storages a load makes are fixed-size, as torch.load's are: a later set_ past the end
    # fails instead of reading freed memory.
    state = {"small": torch.arange(10.0), "large": torch.zeros(MiB)}
    await (await asyncstore.save(state, tmp_path / "c.ckpt"))
    loaded = await asyncstore.load(tmp_path / "c.ckpt")
    for tensor in loaded.values():
        assert not tensor.untyped_storage().resizable()
        with pytest.raises(RuntimeError, match="not resizable"):
            torch.empty(0).set_(tensor.untyped_storage(), 0, (tensor.numel() * 2,), (1,))
    assert torch.equal(loaded["small"], state["small"])


async def test_into_checks_views_too(tmp_path: Path) -> None:
    # into= builds its views over the real storage later: the same check applies there.
    blob = forge(
        Forged(
            write_pickle({"w": rebuild(StorageRef(0, "float32"), 0, [8], [1])}),
            [floats(4)],
            entries={"w": [0]},
        )
    )
    target = torch.zeros(8)
    with pytest.raises(UnsafeCheckpoint, match="reaches byte 32 of a storage of 16"):
        await load_forged(blob, into={"w": target})
    assert torch.equal(target, torch.zeros(8))
    # weights_only=False unpickles with torch's own rebuild, over a placeholder that grows:
    # the view is checked again against the real storage before it is copied.
    with pytest.raises(UnsafeCheckpoint, match="reaches byte 32 of a storage of 16"):
        await load_forged(blob, into={"w": target}, weights_only=False)
    assert torch.equal(target, torch.zeros(8))


# -- state set through BUILD (item: backward hooks) ------------------------------------------


def hooks(callable_: Global) -> Call:
    return Call(Global("collections", "OrderedDict"), [(0, callable_)])


@pytest.mark.parametrize(
    "state",
    [
        (True, None, hooks(Global("torch", "Size"))),  # Tensor.__setstate__ sets the hooks
        (StorageRef(0, "float32"), 0, Call(Global("torch", "Size"), (30000,)), (1,)),  # set_
        {"anything": 1},
    ],
    ids=["backward hooks", "set_ past the storage", "attributes"],
)
async def test_tensor_state_from_the_file_is_refused(state: Any) -> None:
    blob = forge(
        Forged(
            write_pickle(Build(rebuild(StorageRef(0, "float32"), 0, [4], [1]), state)), [floats(4)]
        )
    )
    with pytest.raises(UnsafeCheckpoint, match="sets the state of a Tensor"):
        await load_forged(blob)


async def test_hooks_in_the_rebuild_arguments_are_refused() -> None:
    tensor = rebuild(StorageRef(0, "float32"), 0, [4], [1], hooks=hooks(Global("torch", "Size")))
    with pytest.raises(UnsafeCheckpoint, match="backward hooks"):
        await load_forged(forge(Forged(write_pickle(tensor), [floats(4)])))


async def test_loaded_tensors_carry_no_hooks_and_state_dict_metadata_survives(
    tmp_path: Path,
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    state = model.state_dict()
    await (await asyncstore.save({"model": state}, tmp_path / "m.ckpt"))
    loaded = (await asyncstore.load(tmp_path / "m.ckpt"))["model"]
    assert loaded._metadata == state._metadata  # type: ignore[attr-defined]
    for tensor in loaded.values():
        assert not tensor._backward_hooks
    model.load_state_dict(loaded)


async def test_object_state_is_set_only_on_classes_the_caller_trusts(tmp_path: Path) -> None:
    blob = forge(Forged(write_pickle(Build(Call(Global("builtins", "set")), {"x": 1})), []))
    with pytest.raises(UnsafeCheckpoint, match="sets the state of a set"):
        await load_forged(blob)
    dunder = Build(Call(Global("collections", "OrderedDict")), {"__class__": 1})
    with pytest.raises(UnsafeCheckpoint, match="sets the state of a OrderedDict"):
        await load_forged(forge(Forged(write_pickle(dunder), [])))
    # A class passed in safe_globals keeps its ordinary pickling, state included.
    value = Trusted(7)
    path = tmp_path / "trusted.ckpt"
    await (await asyncstore.save({"v": value}, path))
    with pytest.raises(UnsafeCheckpoint, match="Trusted"):
        await asyncstore.load(path)
    loaded = await asyncstore.load(path, safe_globals=[Trusted])
    assert isinstance(loaded["v"], Trusted)
    assert loaded["v"].n == 7


class Trusted:
    def __init__(self, n: int) -> None:
        self.n = n


# -- sizes claimed by the file (item: allocation before the check) ---------------------------


async def test_a_tiny_file_claiming_a_huge_structure_allocates_nothing() -> None:
    # The review's file: a few hundred bytes whose structure chunk claims 4 GiB decoded.
    for claim in (4 << 30, 1 << 40):
        blob = forge(
            Forged(b"", structure_codec="zstd", structure_raw=claim, structure_stored=zstd_bomb(16))
        )
        assert len(blob) < 300
        await refused_within(blob, "more than zstd can expand", 64 * MiB)


async def test_a_tiny_file_claiming_huge_storages_allocates_nothing() -> None:
    structure = write_pickle({"a": rebuild(StorageRef(0), 0, [4 << 30], [1])})
    for codec in ("zstd", "zstd+shuffle4"):
        storage = ForgedStorage(b"", codec=codec, raw=4 << 30, stored=zstd_bomb(16))
        blob = forge(Forged(structure, [storage], entries={"a": [0]}))
        await refused_within(blob, "more than zstd can expand", 64 * MiB)


async def test_a_zstd_frame_asking_for_a_huge_window_is_refused() -> None:
    # A frame header may ask the decoder for a window of up to 128 MiB whatever it holds; a
    # chunk never needs more window than it has bytes, so a larger one is refused before
    # the decoder allocates it.
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(
        1, window_log=27, write_content_size=False
    )
    packer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    frame = packer.compress(bytes(4096)) + packer.flush()
    assert zstandard.get_frame_parameters(frame).window_size == 1 << 27
    assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == bytes(4096)
    blob = forge(
        Forged(
            write_pickle(rebuild(StorageRef(0), 0, [4096], [1])),
            [ForgedStorage(bytes(4096), codec="zstd", stored=frame, name="w")],
        )
    )
    with pytest.raises(IntegrityError, match="'w' cannot be decoded"):
        await load_forged(blob)


# -- allowed callables turned into amplifiers -------------------------------------------------


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        (Call(Global("builtins", "bytearray"), 1 << 36), "bytearray is built from a int"),
        (
            Call(Global("builtins", "set"), Call(Global("builtins", "range"), 1 << 40)),
            "set is built from a range",
        ),
        (
            Call(Global("torch", "Size"), Call(Global("builtins", "range"), 1 << 40)),
            "Size is built from a range",
        ),
        (
            Call(Global("collections", "OrderedDict"), Call(Global("builtins", "range"), 9)),
            "OrderedDict is built from a range",
        ),
        (Global("torch", "FloatStorage"), "torch.FloatStorage"),
        (Global("builtins", "getattr"), "GLOBAL getattr was not an allowed global"),
    ],
)
async def test_allowed_callables_cannot_amplify(structure: Any, message: str) -> None:
    with pytest.raises(UnsafeCheckpoint, match=message):
        await load_forged(forge(Forged(write_pickle(structure), [])))


def raw_pickle(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


async def test_calls_with_arguments_that_are_not_a_tuple_are_refused() -> None:
    # REDUCE with a range as its arguments: f(*range(2**40)) would build that tuple first.
    body = (
        pickle.GLOBAL
        + b"builtins\ncomplex\n"
        + write_pickle(Call(Global("builtins", "range"), 1 << 40))[2:-1]
        + pickle.REDUCE
    )
    with pytest.raises(UnsafeCheckpoint, match="arguments from a range"):
        await load_forged(forge(Forged(raw_pickle(body), [])))


async def test_copies_of_one_memoised_object_are_bounded() -> None:
    # 1 MiB of bytes, memoised once, then copied by bytearray() 4,000 times: 4 GiB from a
    # pickle of 1 MiB and 40 KB of opcodes.
    big = pickle.BINBYTES + (MiB).to_bytes(4, "little") + bytes(MiB)
    copy = pickle.GLOBAL + b"builtins\nbytearray\n" + pickle.BINGET + b"\x00" + pickle.TUPLE1
    body = big + pickle.BINPUT + b"\x00" + pickle.POP + pickle.MARK
    body += (copy + pickle.REDUCE) * 4000 + pickle.LIST
    await refused_within(forge(Forged(raw_pickle(body), [])), "copy or hash far more", 512 * MiB)


@pytest.mark.parametrize(
    "body",
    [
        pickle.MARK + pickle.INST + b"builtins\nset\n",
        pickle.MARK + pickle.GLOBAL + b"builtins\nset\n" + pickle.OBJ,
        pickle.EXT1 + b"\x01",
        # NEWOBJ: cls.__new__ skips the checks of the wrapped callables.
        pickle.GLOBAL + b"torch\nSize\n" + pickle.EMPTY_TUPLE + pickle.NEWOBJ,
        # Items inserted into a tensor would be writes to its memory.
        write_pickle(rebuild(StorageRef(0, "float32"), 0, [4], [1]))[2:-1]
        + pickle.MARK
        + pickle.BININT1
        + b"\x00"
        + pickle.BININT1
        + b"\x07"
        + pickle.SETITEMS,
    ],
    ids=["INST", "OBJ", "EXT1", "NEWOBJ of a checked callable", "SETITEMS into a tensor"],
)
async def test_opcodes_that_bypass_the_checks_are_refused(body: bytes) -> None:
    with pytest.raises(UnsafeCheckpoint):
        await load_forged(forge(Forged(raw_pickle(body), [floats(4)])))


def test_deeply_nested_keys_are_refused_without_crashing(tmp_path: Path) -> None:
    # A tuple nested a million deep as a dict key: hashing it recurses in C and kills the
    # interpreter (a segfault, not an exception). Run in a child, so that a regression
    # fails this test instead of the whole session.
    body = pickle.EMPTY_DICT + pickle.EMPTY_TUPLE + pickle.TUPLE1 * 1_000_000
    body += pickle.NONE + pickle.SETITEM
    path = tmp_path / "deep.ckpt"
    path.write_bytes(forge(Forged(raw_pickle(body), [])))
    script = textwrap.dedent(
        f"""
        import asyncio, asyncstore
        try:
            asyncio.run(asyncstore.load({str(path)!r}))
        except asyncstore.UnsafeCheckpoint as exc:
            print("refused:", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout
    assert "nests tuples more than" in done.stdout


async def test_plain_values_and_containers_still_load(tmp_path: Path) -> None:
    state = {
        "set": {1, (2, 3)},
        "frozen": frozenset({"a"}),
        "bytes": bytearray(b"xyz"),
        "range": range(0, 10**12, 7),
        "slice": slice(1, None, 2),
        "complex": complex(1, -2),
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "dtype": torch.bfloat16,
        "od": collections.OrderedDict(a=1),
        "nested keys": {(1, (2, (3,))): "ok"},
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    await (await asyncstore.save(state, tmp_path / "plain.ckpt"))
    loaded = await asyncstore.load(tmp_path / "plain.ckpt")
    assert {k: v for k, v in loaded.items() if k != "param"} == {
        k: v for k, v in state.items() if k != "param"
    }
    assert isinstance(loaded["param"], torch.nn.Parameter)


# -- meta tensors: saved as torch saves them, shape and dtype only ---------------------------


@pytest.mark.parametrize(
    "obj",
    [
        torch.empty(3, device="meta"),
        {"model": {"w": torch.empty(3, device="meta")}},
        {"p": torch.nn.Parameter(torch.empty(2, device="meta"))},
        {"model": torch.nn.Linear(2, 2, device="meta").state_dict()},
    ],
)
async def test_meta_tensors_come_back_on_meta(tmp_path: Path, obj: Any) -> None:
    # As torch.save / torch.load: no data saved, the tensors come back on the meta device.
    path = tmp_path / "meta.ckpt"
    await (await asyncstore.save(obj, path))
    loaded = await asyncstore.load(path)
    saved = dict(_tensors(obj))
    back = dict(_tensors(loaded))
    assert saved.keys() == back.keys()
    for name, tensor in back.items():
        assert tensor.is_meta, name
        assert (tensor.shape, tensor.dtype) == (saved[name].shape, saved[name].dtype)
        assert type(tensor) is type(saved[name])


def _tensors(obj: Any, prefix: str = "") -> Any:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}")


# -- map_location (item: the caller's argument blamed on the checkpoint) ---------------------


@pytest.mark.parametrize(
    ("map_location", "message"),
    [
        ("bogus", r"map_location='bogus' is not a device"),
        ({"cpu": "nowhere"}, r"map_location\['cpu'\]='nowhere' is not a device"),
        ({"cpu": 3.5}, r"map_location\['cpu'\]=3.5"),
    ],
)
async def test_a_bad_map_location_is_the_callers_error(
    tmp_path: Path, map_location: Any, message: str
) -> None:
    await (await asyncstore.save({"a": torch.ones(2)}, tmp_path / "ours.ckpt"))
    torch.save({"a": torch.ones(2)}, tmp_path / "theirs.pt")
    for name in ("ours.ckpt", "theirs.pt"):
        with pytest.raises(InvalidArgument, match=message):
            await asyncstore.load(tmp_path / name, map_location=map_location)


@pytest.mark.parametrize(
    ("location", "error", "message"),
    [
        ("meta", IntegrityError, r"gives chunks to .*meta"),
        ("mps", InvalidArgument, "cannot be placed on 'mps'"),
        ("xpu:1", InvalidArgument, "cannot be placed on 'xpu:1'"),
    ],
)
async def test_a_saved_location_without_data_or_backend_is_refused(
    location: str, error: type[Exception], message: str
) -> None:
    blob = forge(
        Forged(
            write_pickle(rebuild(StorageRef(0), 0, [4], [1])),
            [ForgedStorage(bytes(4), location=location)],
        )
    )
    with pytest.raises(error, match=message):
        await load_forged(blob)


async def test_keys_refuse_a_manifest_that_leaves_out_an_entrys_storage() -> None:
    # The manifest's entry list says which storages keys= must read; one that leaves a
    # storage out would hand back a tensor on a placeholder, without its data.
    structure = {
        "w": rebuild(StorageRef(0, "float32"), 0, [4], [1]),
        "nested": {"b": rebuild(StorageRef(1, "float32"), 0, [4], [1])},
    }
    for entries in ({"w": [1], "nested": [1]}, {"w": [0], "nested": []}):
        blob = forge(Forged(write_pickle(structure), [floats(4), floats(4)], entries=entries))
        key = "w" if entries["w"] == [1] else "nested"
        with pytest.raises(IntegrityError, match=f"every storage entry '{key}' uses"):
            await load_forged(blob, keys=[key])
        if key == "nested":
            with pytest.raises(IntegrityError, match="every storage entry 'nested' uses"):
                await load_forged(blob, into={"nested": {}, "w": torch.zeros(4)})


async def test_a_callable_map_location_is_torch_loads_alone(tmp_path: Path) -> None:
    await (await asyncstore.save({"a": torch.ones(2)}, tmp_path / "ours.ckpt"))
    torch.save({"a": torch.ones(2)}, tmp_path / "theirs.pt")
    with pytest.raises(InvalidArgument, match="not a callable"):
        await asyncstore.load(tmp_path / "ours.ckpt", map_location=lambda s, loc: s)
    loaded = await asyncstore.load(tmp_path / "theirs.pt", map_location=lambda s, loc: s)
    assert torch.equal(loaded["a"], torch.ones(2))


async def test_a_bad_device_in_the_checkpoint_is_the_checkpoints_error() -> None:
    blob = forge(
        Forged(
            write_pickle(rebuild(StorageRef(0), 0, [4], [1])),
            [ForgedStorage(bytes(4), location="bogus")],
        )
    )
    with pytest.raises(IntegrityError, match="names a device 'bogus'"):
        await load_forged(blob)
    # ... and a map that covers it is the caller's way out.
    loaded = await load_forged(blob, map_location={"bogus": "cpu"})
    assert torch.equal(loaded, torch.zeros(4, dtype=torch.uint8))


async def test_the_structure_is_unpickled_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The checked unpickler is pure Python: a structure of many tensors must not hold the
    # event loop (a prefetcher or a save may share it).
    import threading

    from asyncstore.checkpoint import _unpickle

    threads: list[threading.Thread] = []
    original = _unpickle.RestrictedUnpickler.load

    def load(self: Any) -> Any:
        threads.append(threading.current_thread())
        return original(self)

    monkeypatch.setattr(_unpickle.RestrictedUnpickler, "load", load)
    await (await asyncstore.save({"a": torch.ones(2)}, tmp_path / "c.ckpt"))
    loaded = await asyncstore.load(tmp_path / "c.ckpt")
    assert torch.equal(loaded["a"], torch.ones(2))
    assert len(threads) == 1
    assert threads[0] is not threading.main_thread()
