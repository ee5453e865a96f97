"""``asyncstore.torch.save`` / ``load`` as drop-ins for ``torch.save`` / ``torch.load``: every
keyword of theirs is accepted and does what it means (or what docs/checkpoints.md says it
means for asyncstore's format), and errors are of types a handler written for torch's
catches."""

from __future__ import annotations

import collections
import io
import mmap
import pickle
import threading
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore._loop import run_sync
from asyncstore.checkpoint._load import _reading
from asyncstore.errors import IntegrityError, InvalidArgument, UnsafeCheckpoint

MAGIC = b"ASYNCKPT"


class Point:
    """A class ``weights_only=True`` refuses."""

    def __init__(self, x: int) -> None:
        self.x = x


def recording_module() -> tuple[types.ModuleType, list[str]]:
    """A pickle module whose Pickler and Unpickler note their use (as dill would be used)."""
    used: list[str] = []

    class Pickler(pickle.Pickler):
        def dump(self, obj: Any) -> None:
            used.append("dump")
            super().dump(obj)

    class Unpickler(pickle.Unpickler):
        def __init__(self, file: Any, **kwargs: Any) -> None:
            used.append(f"unpickler {sorted(kwargs.items())}")
            super().__init__(file, **kwargs)

    module = types.ModuleType("recording_pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    return module, used


def structure_of(path: Path) -> bytes:
    """The pickled structure of the asyncstore checkpoint at ``path``."""

    async def read() -> bytes:
        async with _reading(path, None) as (_, reader):
            assert reader is not None
            return await reader.structure()

    return run_sync(read())


@pytest.fixture
def state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "step": 7}


# --- torch.save's keywords -------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 5])
def test_pickle_protocol_is_the_structures(
    tmp_path: Path, state: dict[str, Any], protocol: int
) -> None:
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save(state, path, pickle_protocol=protocol)
    assert structure_of(path)[:2] == bytes([pickle.PROTO[0], protocol])
    loaded = asyncstore.torch.load(path)
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"] == 7


def test_the_default_protocol_is_four(tmp_path: Path, state: dict[str, Any]) -> None:
    asyncstore.torch.save(state, tmp_path / "a.ckpt")
    assert structure_of(tmp_path / "a.ckpt")[:2] == b"\x80\x04"


@pytest.mark.parametrize("protocol", [1, 99, "4", True])
def test_a_bad_pickle_protocol_is_refused(tmp_path: Path, protocol: Any) -> None:
    with pytest.raises(InvalidArgument, match=f"pickle_protocol={protocol!r}"):
        asyncstore.torch.save({}, tmp_path / "a.ckpt", pickle_protocol=protocol)
    assert not (tmp_path / "a.ckpt").exists()


def test_pickle_module_pickles_and_unpickles(tmp_path: Path, state: dict[str, Any]) -> None:
    module, used = recording_module()
    path = tmp_path / "a.ckpt"
    state["point"] = Point(3)
    asyncstore.torch.save(state, path, pickle_module=module)
    assert "dump" in used
    # As torch.load: a pickle_module means weights_only=False unless it is asked for.
    loaded = asyncstore.torch.load(path, pickle_module=module, encoding="latin1")
    assert "unpickler [('encoding', 'latin1')]" in used
    assert loaded["point"].x == 3
    assert torch.equal(loaded["w"], state["w"])
    with pytest.raises(InvalidArgument, match=r"pickle_module=.*weights_only=True"):
        asyncstore.torch.load(path, pickle_module=module, weights_only=True)


def test_a_pickle_modules_own_errors_come_back_as_they_are(
    tmp_path: Path, state: dict[str, Any]
) -> None:
    class Throwing(pickle.Unpickler):
        def load(self) -> Any:
            raise RuntimeError("rumpelstiltskin")

    module = types.ModuleType("throwing")
    module.Unpickler = Throwing  # type: ignore[attr-defined]
    asyncstore.torch.save(state, tmp_path / "a.ckpt")
    with pytest.raises(RuntimeError, match="rumpelstiltskin"):
        asyncstore.torch.load(tmp_path / "a.ckpt", pickle_module=module, weights_only=False)


def test_a_pickle_module_without_its_classes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="has no Pickler"):
        asyncstore.torch.save({}, tmp_path / "a.ckpt", pickle_module=types.ModuleType("x"))
    asyncstore.torch.save({}, tmp_path / "a.ckpt")
    with pytest.raises(InvalidArgument, match="has no Unpickler"):
        asyncstore.torch.load(
            tmp_path / "a.ckpt", pickle_module=types.ModuleType("x"), weights_only=False
        )


@pytest.mark.parametrize("zipfile_flag", [True, False])
@pytest.mark.parametrize("byteorder_flag", [True, False])
def test_torchs_container_flags_write_our_format(
    tmp_path: Path, state: dict[str, Any], zipfile_flag: bool, byteorder_flag: bool
) -> None:
    # Both choose between torch's own containers: asyncstore's format is written either way
    # (docs/checkpoints.md says so), and loads back.
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save(
        state,
        path,
        _use_new_zipfile_serialization=zipfile_flag,
        _disable_byteorder_record=byteorder_flag,
    )
    assert path.read_bytes()[:8] == MAGIC
    assert torch.equal(asyncstore.torch.load(path)["w"], state["w"])


@pytest.mark.parametrize("name", ["_use_new_zipfile_serialization", "_disable_byteorder_record"])
def test_torchs_container_flags_are_checked(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidArgument, match=f"{name}='yes'"):
        asyncstore.torch.save({}, tmp_path / "a.ckpt", **{name: "yes"})  # type: ignore[arg-type]


def test_save_async_takes_torchs_keywords(tmp_path: Path, state: dict[str, Any]) -> None:
    future = asyncstore.torch.save_async(state, tmp_path / "a.ckpt", pickle_protocol=2)
    future.result()
    assert structure_of(tmp_path / "a.ckpt")[:2] == b"\x80\x02"


# --- torch.load's keywords -------------------------------------------------------------


def test_weights_only_none_means_true(tmp_path: Path) -> None:
    asyncstore.torch.save({"p": Point(1)}, tmp_path / "a.ckpt")
    with pytest.raises(UnsafeCheckpoint):
        asyncstore.torch.load(tmp_path / "a.ckpt", weights_only=None)
    assert asyncstore.torch.load(tmp_path / "a.ckpt", weights_only=False)["p"].x == 1


def test_torchs_force_variables_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncstore.torch.save({"p": Point(1)}, tmp_path / "a.ckpt")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeCheckpoint):
        asyncstore.torch.load(tmp_path / "a.ckpt", weights_only=False)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(InvalidArgument, match="both set"):
        asyncstore.torch.load(tmp_path / "a.ckpt")
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        assert asyncstore.torch.load(tmp_path / "a.ckpt")["p"].x == 1
    # A caller's explicit choice stands against TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.
    with pytest.raises(UnsafeCheckpoint):
        asyncstore.torch.load(tmp_path / "a.ckpt", weights_only=True)


def test_unpickler_keywords_are_checked(tmp_path: Path) -> None:
    # encoding= decodes Python 2 str objects, which asyncstore's structure never holds (the
    # recording module above shows it reaching the unpickler); unknown ones are refused.
    asyncstore.torch.save({"s": "é"}, tmp_path / "a.ckpt")
    assert asyncstore.torch.load(tmp_path / "a.ckpt", encoding="ascii")["s"] == "é"
    with pytest.raises(InvalidArgument, match=r"unknown option.*bogus="):
        asyncstore.torch.load(tmp_path / "a.ckpt", bogus=1)  # type: ignore[call-arg]


def _mapped(path: Path) -> bool:
    """Whether this process has ``path`` mapped into its memory."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.fixture
def big() -> torch.Tensor:
    return torch.randn(256, 1024)  # 1 MiB of random floats: incompressible, stored raw


def test_mmap_maps_raw_storages(tmp_path: Path, big: torch.Tensor) -> None:
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save({"w": big, "b": torch.ones(3)}, path, compression=None)
    loaded = asyncstore.torch.load(path, mmap=True)
    assert _mapped(path)
    assert torch.equal(loaded["w"], big)
    assert torch.equal(loaded["b"], torch.ones(3))
    # A private map: changing the tensor changes neither the file nor a second load.
    loaded["w"][0, 0] = 1234.0
    again = asyncstore.torch.load(path, mmap=True)
    assert torch.equal(again["w"], big)
    del loaded, again
    plain = asyncstore.torch.load(path)
    assert torch.equal(plain["w"], big)


def test_without_mmap_nothing_is_mapped(tmp_path: Path, big: torch.Tensor) -> None:
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save({"w": big}, path, compression=None)
    loaded = asyncstore.torch.load(path)
    assert not _mapped(path)
    assert torch.equal(loaded["w"], big)


def test_mmap_decodes_compressed_storages(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    zeros = torch.zeros(256, 1024)
    asyncstore.torch.save({"z": zeros}, path, compression="zstd")
    assert path.stat().st_size < zeros.nbytes // 10
    loaded = asyncstore.torch.load(path, mmap=True)
    assert torch.equal(loaded["z"], zeros)


def test_mmap_still_verifies(tmp_path: Path, big: torch.Tensor) -> None:
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save({"w": big}, path, compression=None)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        asyncstore.torch.load(path, mmap=True)


def test_mmap_with_shared_maps_writes_to_the_file(tmp_path: Path, big: torch.Tensor) -> None:
    # torch's MAP_SHARED option: a change to the tensor reaches the file, whose checksum then
    # no longer matches (asyncstore's format is verified; torch's is not).
    path = tmp_path / "a.ckpt"
    asyncstore.torch.save({"w": big}, path, compression=None)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        loaded = asyncstore.torch.load(path, mmap=True)
        loaded["w"][0, 0] = 1234.0
    del loaded
    with pytest.raises(IntegrityError, match="checksum"):
        asyncstore.torch.load(path)


def test_mmap_on_a_file_object_maps_its_file(tmp_path: Path, big: torch.Tensor) -> None:
    path = tmp_path / "a.ckpt"
    with path.open("wb") as f:
        f.write(b"some header")
        asyncstore.torch.save({"w": big}, f, compression=None)
    with path.open("rb") as f:
        f.seek(len(b"some header"))
        loaded = asyncstore.torch.load(f, mmap=True)
    assert _mapped(path)
    assert torch.equal(loaded["w"], big)


def test_mmap_needs_a_local_file(big: torch.Tensor) -> None:
    data = io.BytesIO()
    asyncstore.torch.save({"w": big}, data, compression=None)
    data.seek(0)
    with pytest.raises(InvalidArgument, match=r"mmap=True.*not a local file"):
        asyncstore.torch.load(data, mmap=True)


def test_mmap_reaches_torch_for_a_torch_file(tmp_path: Path, big: torch.Tensor) -> None:
    path = tmp_path / "a.pt"
    torch.save({"w": big}, path)
    loaded = asyncstore.torch.load(path, mmap=True)
    assert _mapped(path)
    assert torch.equal(loaded["w"], big)


# --- error types -------------------------------------------------------------------------


def test_invalid_argument_is_also_type_and_value_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        asyncstore.torch.save({}, tmp_path / "a.ckpt", pickle_protocol="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys="):
        asyncstore.torch.load(tmp_path / "a.ckpt", keys="w")


def test_a_weights_only_refusal_is_an_unpickling_error(tmp_path: Path) -> None:
    asyncstore.torch.save({"p": Point(1)}, tmp_path / "a.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="Point"):
        asyncstore.torch.load(tmp_path / "a.ckpt")
    torch.save({"p": Point(1)}, tmp_path / "a.pt")
    with pytest.raises(pickle.UnpicklingError) as caught:
        asyncstore.torch.load(tmp_path / "a.pt")
    assert isinstance(caught.value, UnsafeCheckpoint)


def test_torchs_errors_for_a_torch_file_come_back_as_themselves(tmp_path: Path) -> None:
    # A zip that is not a torch file: torch's own RuntimeError, not an IntegrityError.
    path = tmp_path / "a.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("nothing", b"")
    with pytest.raises(RuntimeError) as caught:
        torch.load(path)
    with pytest.raises(type(caught.value)) as ours:
        asyncstore.torch.load(path)
    assert not isinstance(ours.value, IntegrityError)
    assert str(ours.value) == str(caught.value)


class Unseekable:
    """Reads, but cannot seek (a pipe, a socket's file)."""

    def read(self, size: int = -1) -> bytes:
        return b""


@pytest.mark.parametrize("target", [torch.ones(3), [1, 2], None])
def test_a_target_that_is_no_file_is_an_attribute_error(target: Any) -> None:
    # torch.save and torch.load raise AttributeError for an object without write/read/seek.
    with pytest.raises(AttributeError) as caught:
        asyncstore.torch.save({"w": torch.ones(1)}, target)
    assert isinstance(caught.value, InvalidArgument)
    with pytest.raises(AttributeError, match="readable, seekable"):
        asyncstore.torch.load(target)


def test_an_unseekable_file_is_an_attribute_error_in_torchs_words() -> None:
    with pytest.raises(AttributeError, match="Unseekable") as caught:
        asyncstore.torch.load(Unseekable())
    assert "You can only torch.load from a file that is seekable. Please pre-load" in str(
        caught.value
    )


class ReadintoOnly(io.RawIOBase):
    """A file object over bytes that notes whether read() or readinto() fetched them."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)
        self.calls: list[str] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._data.seek(offset, whence)

    def tell(self) -> int:
        return self._data.tell()

    def readinto(self, buffer: Any) -> int:
        self.calls.append("readinto")
        return self._data.readinto(buffer)

    def read(self, size: int | None = -1) -> bytes:
        self.calls.append("read")
        return self._data.read(size)


def test_a_file_object_is_read_with_readinto(state: dict[str, Any]) -> None:
    # As torch.load does: straight into a buffer, a short readinto continued.
    data = io.BytesIO()
    asyncstore.torch.save(state, data)
    source = ReadintoOnly(data.getvalue())
    loaded = asyncstore.torch.load(source)
    assert source.calls
    assert set(source.calls) == {"readinto"}
    assert torch.equal(loaded["w"], state["w"])


# --- torch's allow-list ------------------------------------------------------------------


def test_torchs_safe_globals_allow_a_class(tmp_path: Path) -> None:
    asyncstore.torch.save({"p": Point(4)}, tmp_path / "a.ckpt")
    with pytest.raises(pickle.UnpicklingError, match=r"GLOBAL .*Point was not an allowed"):
        asyncstore.torch.load(tmp_path / "a.ckpt")
    with torch.serialization.safe_globals([Point]):
        assert asyncstore.torch.load(tmp_path / "a.ckpt")["p"].x == 4
    with torch.serialization.safe_globals([(Point, f"{__name__}.Point")]):
        assert asyncstore.torch.load(tmp_path / "a.ckpt")["p"].x == 4
    torch.serialization.add_safe_globals([Point])
    try:
        assert asyncstore.torch.load(tmp_path / "a.ckpt")["p"].x == 4
    finally:
        torch.serialization.clear_safe_globals()
    with pytest.raises(UnsafeCheckpoint):
        asyncstore.torch.load(tmp_path / "a.ckpt")


class Runs:
    """Pickles as a call of os.system."""

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("true",))


def test_blocked_modules_stay_blocked_when_allowed(tmp_path: Path) -> None:
    import os

    asyncstore.torch.save({"r": Runs()}, tmp_path / "a.ckpt")
    with (
        torch.serialization.safe_globals([os.system]),
        pytest.raises(UnsafeCheckpoint, match="is blocked"),
    ):
        asyncstore.torch.load(tmp_path / "a.ckpt", safe_globals=[os.system])


def test_a_bad_safe_globals_item_is_refused(tmp_path: Path) -> None:
    asyncstore.torch.save({}, tmp_path / "a.ckpt")
    with pytest.raises(InvalidArgument, match="safe_globals item"):
        asyncstore.torch.load(tmp_path / "a.ckpt", safe_globals=[(Point, 3)])


def test_what_torch_refuses_with_runtime_error_is_one(tmp_path: Path) -> None:
    module, _ = recording_module()
    asyncstore.torch.save({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    with pytest.raises(RuntimeError) as caught:
        asyncstore.torch.load(tmp_path / "a.ckpt", pickle_module=module, weights_only=True)
    assert isinstance(caught.value, InvalidArgument)
    # A device this build of torch lacks (the CPU wheel has no XPU backend).
    with pytest.raises(RuntimeError, match="cannot be placed on 'xpu'"):
        asyncstore.torch.load(tmp_path / "a.ckpt", map_location="xpu")


# --- tensors with attributes and tensor subclasses (torch's _rebuild_from_type_v2) -------


class Scaled(torch.Tensor):
    """A tensor subclass, loadable with weights_only=True once allowed."""


def test_a_tensors_attributes_load_with_weights_only(tmp_path: Path) -> None:
    w = torch.ones(3)
    w.scale = 2.5  # type: ignore[attr-defined]
    asyncstore.torch.save({"w": w}, tmp_path / "a.ckpt")
    loaded = asyncstore.torch.load(tmp_path / "a.ckpt")["w"]
    assert torch.equal(loaded, w)
    assert loaded.scale == 2.5


@pytest.mark.parametrize("name", ["data", "grad", "_version", "__class__"])
def test_attributes_the_tensor_class_has_are_refused(tmp_path: Path, name: str) -> None:
    # A crafted state could swap a tensor's data or class: refused before it is set.
    w = torch.ones(3)
    state = {name: torch.zeros(3)}
    payload: tuple[Any, ...] = (
        torch._tensor._rebuild_from_type_v2,
        (
            torch._utils._rebuild_tensor_v2,
            torch.Tensor,
            (w.untyped_storage(), 0, (3,), (1,), False, collections.OrderedDict()),
            state,
        ),
    )

    class Crafted:
        def __reduce__(self) -> tuple[Any, ...]:
            return payload

    asyncstore.torch.save({"w": Crafted()}, tmp_path / "a.ckpt")
    with pytest.raises(UnsafeCheckpoint, match="state sets"):
        asyncstore.torch.load(tmp_path / "a.ckpt")


def test_a_tensor_subclass_loads_once_allowed(tmp_path: Path) -> None:
    t = torch.arange(4.0).as_subclass(Scaled)
    asyncstore.torch.save({"t": t}, tmp_path / "a.ckpt")
    with pytest.raises(UnsafeCheckpoint, match="Scaled"):
        asyncstore.torch.load(tmp_path / "a.ckpt")
    with torch.serialization.safe_globals([Scaled]):
        loaded = asyncstore.torch.load(tmp_path / "a.ckpt")["t"]
    assert type(loaded) is Scaled
    assert torch.equal(loaded.as_subclass(torch.Tensor), torch.arange(4.0))


def test_torch_tensor_is_never_called(tmp_path: Path) -> None:
    class Allocates:
        def __reduce__(self) -> tuple[Any, ...]:
            return (torch.Tensor, (2**40,))

    asyncstore.torch.save({"a": Allocates()}, tmp_path / "a.ckpt")
    with pytest.raises(UnsafeCheckpoint, match=r"torch\.Tensor"):
        asyncstore.torch.load(tmp_path / "a.ckpt")


def _local_function() -> Any:
    def local() -> None:
        pass

    return local


@pytest.mark.parametrize(
    "make", [_local_function, threading.Lock, lambda: lambda: 0], ids=["local", "lock", "lambda"]
)
def test_an_unpicklable_object_raises_what_torch_save_raises(tmp_path: Path, make: Any) -> None:
    # torch.save lets pickle's error out: AttributeError (a local object), TypeError (a
    # lock), PicklingError (a lambda pickle cannot look up).
    obj = make()
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)) as caught:
        torch.save({"x": obj}, io.BytesIO())
    torch_type = type(caught.value)
    with pytest.raises(torch_type) as ours:
        asyncstore.torch.save({"x": obj}, tmp_path / "x.ckpt")
    assert isinstance(ours.value, asyncstore.Unpicklable)
    assert isinstance(ours.value, asyncstore.UnsafeCheckpoint)
    assert not (tmp_path / "x.ckpt").exists()
