"""What new users hit in their first hour with checkpoints: ``into=`` with the usual nested
checkpoint shape, a save handle dropped when ``asyncio.run`` ends, moving a checkpoint back
to a plain ``torch.save`` file, and one form for digests."""

from __future__ import annotations

import asyncio
import collections
import gc
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import InvalidArgument

from .helpers import assert_same

pytestmark = pytest.mark.anyio


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        optim.step()
    return model, optim


# -- into= fills nested containers ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ours", "torch.save"])
async def test_into_fills_a_nested_state_dict_in_place(tmp_path: Path, kind: str) -> None:
    model, optim = _trained()
    state = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "step": 12,
        "pair": (torch.ones(3), "tag"),
        "history": [torch.full((2,), 5.0), 0.5],
        "deep": {"a": {"b": {"c": torch.arange(6.0).reshape(2, 3)}}},
    }
    path = tmp_path / "state.ckpt"
    if kind == "ours":
        await (await asyncstore.save(state, path))
    else:
        torch.save(state, path)
    fresh = _model()
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.5)
    history: list[Any] = [torch.zeros(2), 0.0]
    deep = torch.zeros(2, 3)
    pair_tensor = torch.zeros(3)
    into: dict[str, Any] = {
        "model": fresh.state_dict(),
        "optim": fresh_optim.state_dict(),
        "step": 0,
        "pair": (pair_tensor, ""),
        "history": history,
        "deep": {"a": {"b": {"c": deep}}},
    }
    pointers = {k: v.data_ptr() for k, v in into["model"].items()}
    result = await asyncstore.load(path, into=into)
    assert result is into
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key  # the model itself changed
        assert into["model"][key].data_ptr() == pointers[key]
    assert into["step"] == 12
    assert into["history"] is history
    assert torch.equal(history[0], torch.full((2,), 5.0))
    assert history[1] == 0.5
    assert torch.equal(deep, torch.arange(6.0).reshape(2, 3))
    assert into["pair"][0] is pair_tensor
    assert torch.equal(pair_tensor, torch.ones(3))
    assert into["pair"][1] == "tag"
    # The optimizer's state (empty in a fresh one) comes from the checkpoint, whole.
    fresh_optim.load_state_dict(into["optim"])
    saved = optim.state_dict()
    assert into["optim"]["param_groups"][0]["lr"] == 0.01
    for index, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(into["optim"]["state"][index][name], value), (index, name)


@pytest.mark.parametrize("kind", ["ours", "torch.save"])
async def test_into_mismatch_names_the_full_path(tmp_path: Path, kind: str) -> None:
    state = {"model": _model().state_dict(), "step": 3, "lists": [torch.ones(2)]}
    path = tmp_path / "state.ckpt"
    if kind == "ours":
        await (await asyncstore.save(state, path))
    else:
        torch.save(state, path)
    wrong = _model().state_dict()
    wrong["0.weight"] = torch.zeros(3, 3)
    untouched = wrong["2.weight"].clone()
    with pytest.raises(InvalidArgument, match=r"into\['model'\]\['0\.weight'\] is \(3, 3\)"):
        await asyncstore.load(path, into={"model": wrong, "step": 0})
    assert torch.equal(wrong["2.weight"], untouched)  # nothing filled before the check
    half = _model().state_dict()
    half["2.bias"] = half["2.bias"].to(torch.float64)
    with pytest.raises(InvalidArgument, match=r"into\['model'\]\['2\.bias'\].*float64"):
        await asyncstore.load(path, into={"model": half})
    with pytest.raises(InvalidArgument, match=r"into\['lists'\]\[0\] is \(3,\)"):
        await asyncstore.load(path, into={"lists": [torch.zeros(3)]})
    with pytest.raises(InvalidArgument, match=r"into\['step'\] is a tensor, but .* int"):
        await asyncstore.load(path, into={"step": torch.zeros(1)})
    with pytest.raises(InvalidArgument, match=r"into\['model'\] has entries \['extra'\]"):
        await asyncstore.load(path, into={"model": {"extra": torch.zeros(1)}})
    with pytest.raises(InvalidArgument, match=r"into\['step'\] is a dict holding tensors"):
        await asyncstore.load(path, into={"step": {"w": torch.zeros(1)}})


async def test_into_nested_reads_one_storage_at_a_time_straight_into_targets(
    tmp_path: Path,
) -> None:
    from asyncstore.checkpoint._reader import ChunkReader

    state = {"model": {"a": torch.randn(1000), "b": torch.randn(2000)}, "step": 1}
    path = tmp_path / "direct.ckpt"
    await (await asyncstore.save(state, path))
    direct: list[str] = []
    read_into = ChunkReader.read_into

    async def spy(self: ChunkReader, places: list[tuple[Any, memoryview]]) -> None:
        direct.extend(entry.name for entry, _ in places)
        await read_into(self, places)

    into: dict[str, Any] = {"model": {"a": torch.zeros(1000), "b": torch.zeros(2000)}}
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(ChunkReader, "read_into", spy)
        await asyncstore.load(path, into=into)
    assert len(direct) == 2
    assert torch.equal(into["model"]["a"], state["model"]["a"])  # type: ignore[index]
    assert torch.equal(into["model"]["b"], state["model"]["b"])  # type: ignore[index]


async def test_into_passes_through_the_sync_load_and_the_checkpointer(tmp_path: Path) -> None:
    model, optim = _trained()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 4}
    asyncstore.torch.save(state, tmp_path / "sync.ckpt")
    fresh = _model()
    asyncstore.torch.load(tmp_path / "sync.ckpt", into={"model": fresh.state_dict(), "step": 0})
    assert torch.equal(fresh.state_dict()["0.weight"], model.state_dict()["0.weight"])
    other = _model()
    async with asyncstore.Checkpointer(tmp_path / "run") as ckpt:
        await (await ckpt.save(state, 4))
        into: dict[str, Any] = {"model": other.state_dict(), "step": 0}
        await ckpt.load(into=into)
    assert into["step"] == 4
    assert torch.equal(other.state_dict()["2.bias"], model.state_dict()["2.bias"])


async def test_into_keeps_ordered_dicts_and_replaces_plain_values(tmp_path: Path) -> None:
    state = {"cfg": collections.OrderedDict(lr=0.1, names=["a"]), "w": [torch.ones(2)]}
    await (await asyncstore.save(state, tmp_path / "c.ckpt"))
    cfg: dict[str, Any] = collections.OrderedDict(lr=0.0, names=[])
    into: dict[str, Any] = {"cfg": cfg, "w": None}
    await asyncstore.load(tmp_path / "c.ckpt", into=into)
    assert into["cfg"] is cfg
    assert cfg == {"lr": 0.1, "names": ["a"]}
    assert torch.equal(into["w"][0], torch.ones(2))


# -- a save nobody awaited is loud -------------------------------------------------------------


def test_a_save_not_awaited_before_asyncio_run_ends_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"w": torch.randn(1_000_000)}
    path = tmp_path / "dropped.ckpt"

    async def train() -> None:
        await asyncstore.save(state, path, compression="zstd")  # the handle is not awaited

    with (
        caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"),
        pytest.warns(ResourceWarning, match="dropped.ckpt.*await the handle"),
    ):
        asyncio.run(train())
    dropped = [r for r in caplog.records if r.name == "asyncstore.checkpoint"]
    assert len(dropped) == 1, caplog.text
    assert dropped[0].levelno == logging.WARNING
    assert str(path) in dropped[0].getMessage()
    assert "await the save's handle" in dropped[0].getMessage()
    assert list(tmp_path.iterdir()) == []  # nothing committed, no temp file left


def test_a_checkpointer_save_not_awaited_before_asyncio_run_ends_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def train() -> None:
        ckpt = asyncstore.Checkpointer(tmp_path, keep_last=2)
        await ckpt.save({"w": torch.randn(1_000_000)}, 5)  # neither awaited nor closed

    with (
        caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"),
        pytest.warns(ResourceWarning),  # the handle, and the checkpointer left open
    ):
        asyncio.run(train())
        gc.collect()
    dropped = [r.getMessage() for r in caplog.records if r.name == "asyncstore.checkpoint"]
    assert any("step-000000005.ckpt" in m and "await" in m for m in dropped), caplog.text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step-")] == []


async def test_a_save_cancelled_through_its_handle_or_awaited_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
        handle = await asyncstore.save({"w": torch.randn(1_000_000)}, tmp_path / "c.ckpt")
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        await (await asyncstore.save({"w": torch.ones(2)}, tmp_path / "ok.ckpt"))
    assert [r for r in caplog.records if r.name == "asyncstore.checkpoint"] == []


# -- back to torch.save: export ----------------------------------------------------------------


def _nested_state() -> dict[str, Any]:
    model, optim = _trained()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 9, "tag": "x"}


def test_export_writes_a_file_torch_load_reads(tmp_path: Path) -> None:
    state = _nested_state()
    src = tmp_path / "state.ckpt"
    asyncstore.torch.save(state, src)
    with pytest.raises(Exception, match=r"(?i)pickle|zip|magic|archive"):
        torch.load(src, weights_only=True)  # what users hit before exporting
    dst = tmp_path / "out" / "state.pt"
    url = asyncstore.torch.export(src, dst)
    assert url.endswith("/out/state.pt")
    assert_same(torch.load(dst, weights_only=True), state)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["state.pt"]  # no temp file
    # Any store URL, and the file replaced whole.
    memory = f"memory://export-{id(state)}"
    asyncstore.torch.export(src, f"{memory}/again.pt")
    asyncstore.torch.export(src, f"{memory}/again.pt")

    async def fetch() -> bytes:
        async with asyncstore.open_store(memory) as store:
            return await store.get("again.pt")

    data = asyncio.run(fetch())
    assert_same(torch.load(io.BytesIO(data), weights_only=True), state)


def test_export_refuses_what_it_cannot_export(tmp_path: Path) -> None:
    with pytest.raises(asyncstore.NotFound):
        asyncstore.torch.export(tmp_path / "missing.ckpt", tmp_path / "x.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(asyncstore.IntegrityError, match="not an asyncstore checkpoint"):
        asyncstore.torch.export(tmp_path / "plain.pt", tmp_path / "x.pt")
    with pytest.raises(InvalidArgument, match="file object"):
        asyncstore.torch.export(tmp_path / "plain.pt", io.BytesIO())
    assert not (tmp_path / "x.pt").exists()


def test_the_export_verb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncstore.cli import main

    state = _nested_state()
    asyncstore.torch.save(state, tmp_path / "state.ckpt")
    assert main(["export", str(tmp_path / "state.ckpt"), str(tmp_path / "state.pt")]) == 0
    assert "state.pt" in capsys.readouterr().out
    assert_same(torch.load(tmp_path / "state.pt", weights_only=True), state)
    assert main(["export", str(tmp_path / "nope.ckpt"), str(tmp_path / "nope.pt")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("asyncstore: ")
    assert "nope.ckpt" in err
    assert not (tmp_path / "nope.pt").exists()


# -- digests: one form ---------------------------------------------------------------------------


def test_every_user_facing_digest_is_the_same_hex_string(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncstore.checkpoint import inspect, read_manifest
    from asyncstore.cli import main

    path = tmp_path / "d.ckpt"
    result = asyncstore.torch.save({"w": torch.randn(1000)}, path)
    assert isinstance(result.digest, str)
    assert len(result.digest) == 16
    int(result.digest, 16)
    info = asyncio.run(inspect(path))
    assert info.digest == result.digest
    manifest = asyncio.run(read_manifest(path))
    assert f"{manifest.digest:016x}" == result.digest  # the file keeps its int
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == result.digest
    assert main(["inspect", str(path)]) == 0
    assert f"digest      {result.digest}" in capsys.readouterr().out


def test_a_misspelt_option_gets_the_closest_name() -> None:
    from asyncstore import open_store

    with pytest.raises(
        InvalidArgument, match=r"unknown option 'endpoint' \(did you mean 'endpoint_url'\?\)"
    ):
        open_store("s3://bucket/prefix", endpoint="http://127.0.0.1:8333")
    with pytest.raises(InvalidArgument, match=r"'part_byte' \(did you mean 'part_bytes'\?\)"):
        open_store("s3://bucket/prefix", part_byte=5)


def test_torch_messages_are_quoted_without_terminal_codes(tmp_path: Path) -> None:
    import pathlib

    from asyncstore import UnsafeCheckpoint

    path = tmp_path / "plain.pt"
    torch.save({"odd": pathlib.PurePosixPath("/x")}, path)  # a global weights_only refuses
    with pytest.raises(UnsafeCheckpoint) as raised:
        asyncstore.torch.load(path)
    message = str(raised.value)
    assert "\x1b" not in message  # torch bolds part of its message for terminals
    assert "do those steps only if you trust the source" in message
