"""The ``torch.distributed.checkpoint`` plugin against what a hostile or unlucky user does: a
cached plan, crafted values and metadata, a commit or a close at the wrong time, views."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from asyncstore import IntegrityError, InvalidArgument
from asyncstore.torch.dcp import StorageReader, StorageWriter

from .helpers import load_small, small

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- what a hostile or unlucky user does -------------------------------------------------------


def test_a_cached_plan_never_writes_over_the_committed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's plan caching reuses an earlier save's plan: the objects must still be new.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from asyncstore.torch import _dcpwriter as plugin

    url = str(tmp_path / "ckpt")
    writer = StorageWriter(url)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    state_dict_saver.save({"w": torch.full((4,), 1.0)}, storage_writer=writer, planner=planner)

    async def crash(*args: Any) -> None:
        raise OSError("killed before its .metadata")

    with monkeypatch.context() as patched:
        patched.setattr(plugin, "_commit", crash)
        with pytest.raises(CheckpointException):
            state_dict_saver.save(
                {"w": torch.full((4,), 2.0)}, storage_writer=writer, planner=planner
            )
    back = {"w": torch.zeros(4)}
    state_dict_loader.load(back, storage_reader=StorageReader(url))
    assert torch.equal(back["w"], torch.full((4,), 1.0))  # the committed save, untouched


def _rank_object(url: str) -> tuple[Path, dict[str, torch.Tensor]]:
    import asyncstore.torch

    (path,) = Path(url).glob("__0_*.ckpt")
    return path, asyncstore.torch.load(path)


def test_a_crafted_value_cannot_run_code_or_read_past_its_bytes(tmp_path: Path) -> None:
    import io as _io

    import asyncstore.torch
    from asyncstore import UnsafeCheckpoint

    url = str(tmp_path / "ckpt")
    state_dict_saver.save({"w": torch.ones(3), "note": {"a": 1}}, storage_writer=StorageWriter(url))
    path, entries = _rank_object(url)
    (entry,) = [k for k, v in entries.items() if v.dtype == torch.uint8]
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    buffer = _io.BytesIO()
    torch.save(Payload(), buffer)
    entries[entry] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    asyncstore.torch.save(entries, path)
    target: dict[str, Any] = {"w": torch.zeros(3), "note": {"a": 0}}
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(target, storage_reader=StorageReader(url, weights_only=True))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, UnsafeCheckpoint)
    assert "weights_only=False" in str(error)
    assert "'note.a'" in str(error)  # the state's key, not the object's entry number
    assert not marker.exists()

    # One byte of storage claiming to be a million: refused, nothing read past it.
    entries[entry] = torch.zeros(1, dtype=torch.uint8).expand(1_000_000)
    asyncstore.torch.save(entries, path)
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(target, storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "should be a value's bytes" in str(error)

    # A tensor of another dtype than .metadata says: refused, not converted.
    entries[entry] = torch.frombuffer(bytearray(b"x"), dtype=torch.uint8)
    (tensor_entry,) = [k for k, v in entries.items() if v.dtype == torch.float32]
    entries[tensor_entry] = torch.ones(3, dtype=torch.float64)
    asyncstore.torch.save(entries, path)
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load({"w": torch.zeros(3)}, storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "does not hold the tensors" in str(error)
    path.unlink()
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load({"w": torch.zeros(3)}, storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "lost a rank's shards" in str(error)


def test_a_commit_removes_only_what_the_replaced_checkpoint_named(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    state_dict_saver.save({"w": torch.ones(3)}, storage_writer=StorageWriter(str(url)))
    (first,) = url.glob("__0_*.ckpt")
    # Another save into the same directory, still writing: its object is not ours to take.
    other = url / "__1_00112233445566aa.ckpt"
    other.write_bytes(b"another save's shard, in flight")
    state_dict_saver.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(str(url)))
    assert not first.exists()  # the replaced checkpoint's object went
    assert other.exists()
    assert len(list(url.glob("__0_*.ckpt"))) == 1


def test_a_step_still_being_written_is_not_a_leftover(tmp_path: Path) -> None:
    import gc as _gc

    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        slow = ckpt.dcp_writer(1)  # its save is still writing when step 2 commits
        (run / "step-000000001.dcp").mkdir(parents=True)
        shard = run / "step-000000001.dcp" / "__0_0123456789abcdef.ckpt"
        shard.write_bytes(b"step 1's shard, being written")
        state_dict_saver.save(small(2), storage_writer=ckpt.dcp_writer(2))
        assert shard.exists()
        del slow  # that save gave up: what it wrote is a leftover now
        _gc.collect()
        state_dict_saver.save(small(3), storage_writer=ckpt.dcp_writer(3))
        assert not shard.exists()


def test_a_checkpointer_closed_before_the_commit_still_reports_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    ckpt = Checkpointer(run)
    writer = ckpt.dcp_writer(1)
    ckpt.close()  # too early: the save below has not committed yet
    with caplog.at_level("WARNING", logger="asyncstore.checkpoint"):
        state_dict_saver.save(small(1), storage_writer=writer)  # no error: it is saved
    assert "could not run retention" in caplog.text
    with Checkpointer(run) as again:
        assert load_small(again, 1)["step"] == 1


def test_a_view_is_saved_without_the_storage_around_it(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    big = torch.randn(1000, 1000)  # 4 MB
    state_dict_saver.save({"w": big[5:7]}, storage_writer=StorageWriter(str(url)))
    (rank_object,) = url.glob("__0_*.ckpt")
    assert rank_object.stat().st_size < 100_000
    back = {"w": torch.zeros(2, 1000)}
    state_dict_loader.load(back, storage_reader=StorageReader(str(url)))
    assert torch.equal(back["w"], big[5:7])
    with pytest.raises(InvalidArgument, match="checkpoint_id="):
        StorageWriter("/")


def test_metadata_of_python_3_11_early_enum_pickles_loads_and_getattr_stays_refused(
    tmp_path: Path,
) -> None:
    # Python 3.11.0-3.11.3 pickle an enum member as getattr(cls, name): what Debian 12's
    # python3 (3.11.2) writes into every .metadata. Reproduced here whatever this
    # interpreter's own form is, with a pickler that writes enums that way.
    import enum
    import io

    from torch.distributed.checkpoint.metadata import TensorProperties

    from asyncstore.checkpoint._distributed import MAGIC, decode_metadata
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        state_dict_saver.save(small(1), storage_writer=ckpt.dcp_writer(1))
    metadata = decode_metadata((run / "step-000000001.dcp" / ".metadata").read_bytes(), "m")

    def framed(value: Any, swap: Any) -> bytes:
        class EarlyPickler(pickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, enum.Enum) and not isinstance(obj, torch.dtype):
                    return swap(obj)
                return NotImplemented

        out = io.BytesIO()
        EarlyPickler(out, protocol=4).dump(value)
        body = out.getvalue()
        return MAGIC + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body

    early = framed(metadata, lambda member: (getattr, (type(member), member.name)))
    assert b"getattr" in early
    assert decode_metadata(early, "m") == metadata
    for target, name in (
        (None, "__class__"),  # the enum's class, but not one of its members
        (None, "mro"),
        (TensorProperties, "__init__"),  # a class the metadata holds, but no enum
    ):
        crafted = framed(
            metadata, lambda member, t=target, n=name: (getattr, (t or type(member), n))
        )
        with pytest.raises(IntegrityError, match="not a member of a DCP metadata enum"):
            decode_metadata(crafted, "m")
