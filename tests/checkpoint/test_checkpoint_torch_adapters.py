"""The sync adapters: ``asyncstore.torch.save``, ``save_async`` and ``load``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import InvalidArgument

from .helpers import assert_same_storage_layout

pytestmark = pytest.mark.anyio


def test_torch_adapters_round_trip(tmp_path: Path) -> None:
    from asyncstore.torch import load, save, save_async

    model = torch.nn.Linear(16, 4)
    state = model.state_dict()
    result = save(state, tmp_path / "a.ckpt")
    assert result.stored_bytes == (tmp_path / "a.ckpt").stat().st_size
    assert_same_storage_layout(dict(state), dict(load(tmp_path / "a.ckpt")))
    future = save_async(state, str(tmp_path / "b.ckpt"))
    assert future.result(timeout=60).storages == 2
    buffer = io.BytesIO()
    save(state, buffer)
    buffer.seek(0)
    assert_same_storage_layout(dict(state), dict(load(buffer, map_location="cpu")))
    torch.save(state, tmp_path / "plain.pt")
    assert_same_storage_layout(dict(state), dict(load(tmp_path / "plain.pt")))
    with pytest.raises(InvalidArgument, match="map_location"):
        load(tmp_path / "a.ckpt", map_location=lambda s, loc: s)


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


def test_adapter_docstrings_name_every_option() -> None:
    # The sync adapters forward their options as they are; each docstring lists them all,
    # and a new option of asyncstore.save or asyncstore.load must be added there too.
    from asyncstore.checkpoint._load import LoadOptions
    from asyncstore.checkpoint._save import SaveOptions

    for func, options in (
        (asyncstore.torch.save, SaveOptions),
        (asyncstore.torch.load, LoadOptions),
    ):
        doc = func.__doc__ or ""
        missing = [name for name in options.__optional_keys__ if f"``{name}``" not in doc]
        assert not missing, f"{func.__name__}'s docstring omits {missing}"
