"""The DCP plugin as a drop-in for DCP's ``FileSystemWriter``/``FileSystemReader``:
``overwrite=False``, the reader's default loading what DCP's loads (by DCP's rules), and
``validate_checkpoint_id`` answering only for what the plugin can open; locally and on a
real S3 server (SeaweedFS)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from asyncstore import InvalidArgument, UnsafeCheckpoint
from asyncstore.torch.dcp import StorageReader, StorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _failure(raised: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, BaseException)
    return error


def test_overwrite_false_refuses_an_existing_checkpoint_and_keeps_it(
    where: tuple[str, dict[str, Any]],
) -> None:
    url, options = where
    # Nothing there yet: overwrite=False saves.
    state_dict_saver.save(
        {"w": torch.full((4,), 1.0)},
        storage_writer=StorageWriter(url, store_options=options, overwrite=False),
    )
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as raised:
        state_dict_saver.save(
            {"w": torch.full((4,), 2.0)},
            storage_writer=StorageWriter(url, store_options=options, overwrite=False),
        )
    error = _failure(raised)
    assert isinstance(error, InvalidArgument)
    assert url in str(error)
    assert "overwrite=True" in str(error)
    back = {"w": torch.zeros(4)}
    state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
    assert torch.equal(back["w"], torch.full((4,), 1.0))

    # The default is DCP's: replace it.
    state_dict_saver.save(
        {"w": torch.full((4,), 3.0)}, storage_writer=StorageWriter(url, store_options=options)
    )
    state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
    assert torch.equal(back["w"], torch.full((4,), 3.0))


def test_overwrite_false_is_checked_through_checkpoint_id(tmp_path: Path) -> None:
    writer = StorageWriter(overwrite=False)
    first, second = tmp_path / "a", tmp_path / "b"
    state_dict_saver.save({"w": torch.ones(2)}, storage_writer=writer, checkpoint_id=first)
    state_dict_saver.save({"w": torch.ones(2)}, storage_writer=writer, checkpoint_id=second)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        state_dict_saver.save({"w": torch.ones(2)}, storage_writer=writer, checkpoint_id=first)


def test_overwrite_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgument, match="overwrite='no'"):
        StorageWriter("/tmp/x", overwrite="no")  # type: ignore[arg-type]


class TrainState:
    """A value of the caller's own class, as DCP's e2e test saves one beside its model."""

    def __init__(self, step: int) -> None:
        self.step = step


def _values() -> dict[str, Any]:
    loss = io.BytesIO()
    torch.save(torch.tensor([0.5, 0.25]), loss)
    return {
        "w": torch.arange(6.0),
        "train": {"loss": loss, "lr": np.float64(0.125), "step": np.int64(7)},
        "mine": TrainState(11),
    }


def _template() -> dict[str, Any]:
    return {"w": torch.zeros(6), "train": {"loss": None, "lr": None, "step": None}, "mine": None}


def test_the_default_reader_loads_what_dcp_loads(
    where: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    url, options = where
    state_dict_saver.save(_values(), storage_writer=StorageWriter(url, store_options=options))
    ours: dict[str, Any] = _template()
    state_dict_loader.load(ours, storage_reader=StorageReader(url, store_options=options))

    # DCP's own reader, on DCP's own files, as the reference.
    reference = tmp_path / "torch-reference"
    state_dict_saver.save(_values(), storage_writer=FileSystemWriter(reference))
    theirs: dict[str, Any] = _template()
    state_dict_loader.load(theirs, storage_reader=FileSystemReader(reference))

    for state in (ours, theirs):
        assert torch.equal(state["w"], torch.arange(6.0))
        state["train"]["loss"].seek(0)
        assert torch.equal(torch.load(state["train"]["loss"]), torch.tensor([0.5, 0.25]))
        assert state["train"]["lr"] == np.float64(0.125)
        assert isinstance(state["train"]["step"], np.int64)
        assert isinstance(state["mine"], TrainState)
        assert state["mine"].step == 11


def test_weights_only_refusals_name_the_states_key(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, options = where
    state_dict_saver.save(_values(), storage_writer=StorageWriter(url, store_options=options))
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(
            _template(),
            storage_reader=StorageReader(url, store_options=options, weights_only=True),
        )
    error = _failure(raised)
    assert isinstance(error, UnsafeCheckpoint)
    assert "'mine'" in str(error) or "'train.loss'" in str(error)
    assert "entry" not in str(error)

    # torch's allow-list applies: with the classes allowed, weights_only=True loads.
    with torch.serialization.safe_globals(
        [
            TrainState,
            io.BytesIO,
            np.dtype,
            np.dtypes.Float64DType,
            np.dtypes.Int64DType,
            np._core.multiarray.scalar,  # type: ignore[attr-defined]
        ]
    ):
        back: dict[str, Any] = _template()
        state_dict_loader.load(
            back, storage_reader=StorageReader(url, store_options=options, weights_only=True)
        )
    assert back["mine"].step == 11

    # TORCH_FORCE_WEIGHTS_ONLY_LOAD restricts the default reader as it restricts DCP's.
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(
            {"w": torch.zeros(6), "mine": None},
            storage_reader=StorageReader(url, store_options=options),
        )
    error = _failure(raised)
    assert isinstance(error, UnsafeCheckpoint)
    assert "'mine'" in str(error)


@pytest.mark.parametrize(
    "checkpoint_id",
    [
        "/ckpt/step-1",
        "relative/step-1",
        "file:///ckpt/step-1",
        "memory://scratch/a",
        "s3://bucket/run/step-1",
        "s3://bucket",
        Path("/ckpt/step-1"),
    ],
)
def test_validate_checkpoint_id_accepts_what_open_store_opens(checkpoint_id: Any) -> None:
    assert StorageWriter.validate_checkpoint_id(checkpoint_id)
    assert StorageReader.validate_checkpoint_id(checkpoint_id)


@pytest.mark.parametrize(
    "checkpoint_id",
    [
        "abc://abc.abc",
        "gs://bucket/x",
        "hdfs://node/x",
        "s3://",
        "memory://",
        "",
        "/",
        "file://relative/x",
        42,
        None,
    ],
)
def test_validate_checkpoint_id_refuses_the_rest(checkpoint_id: Any) -> None:
    assert not StorageWriter.validate_checkpoint_id(checkpoint_id)
    assert not StorageReader.validate_checkpoint_id(checkpoint_id)
