"""DCP's format conversions for asyncstore's layout (``asyncstore.torch.dcp_to_torch_save`` /
``torch_save_to_dcp``, and ``asyncstore import``): round trips locally and on a real S3
server (SeaweedFS), a 2-rank sharded save converted to the same file as torch's own
``dcp_to_torch_save`` writes from DCP's layout, a run's versions by step, atomicity when the
commit fails, and bad arguments; all in processes without a process group, as DCP's own."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as torch_dcp_to_torch_save

import asyncstore
import asyncstore.torch
from asyncstore import IntegrityError, InvalidArgument, NotFound, StoreUnavailable, UnsafeCheckpoint
from asyncstore.checkpoint import inspect
from asyncstore.cli import main
from asyncstore.testing import FaultProxy, SeaweedFS
from asyncstore.torch import Checkpointer, dcp_to_torch_save, torch_save_to_dcp
from asyncstore.torch.dcp import StorageReader

from ..conftest import BUCKET, s3_options, unique
from ..helpers import assert_same
from ..ranks import SHARDED_SAVE_SCRIPT, spawn_ranks, wait_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Opaque:
    """A class of the test's own: weights_only=True refuses it."""


def a_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "weight": torch.randn(33, 7, generator=g),
            "half": torch.randn(5, 5, generator=g).to(torch.bfloat16),
            "ids": torch.arange(11, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
        },
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
        "step": 42,
        "name": "run-1",
        "blob": io.BytesIO(b"train state"),
    }


def same_as_saved(got: dict[str, Any], want: dict[str, Any]) -> None:
    blob = got.pop("blob")
    assert blob.getvalue() == want["blob"].getvalue()
    assert_same(got, {k: v for k, v in want.items() if k != "blob"})


def test_round_trip_through_our_layout(where: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    place, options = where
    state = a_state()
    source = tmp_path / "model.pt"
    torch.save(state, source)

    url = torch_save_to_dcp(source, f"{place}/ckpt", store_options=options)
    assert url.endswith("/ckpt")
    # dcp.load through the plugin, into a template of other values.
    template = a_state()
    template["model"] = {k: torch.zeros_like(v) for k, v in template["model"].items()}
    template["step"], template["blob"] = 0, io.BytesIO()
    state_dict_loader.load(template, storage_reader=StorageReader(url, store_options=options))
    same_as_saved(template, state)

    # Back to a torch.save file, in the same store (the checkpoint's options reach it).
    out = dcp_to_torch_save(url, f"{place}/back.pt", store_options=options)
    back = asyncstore.torch.load(out, weights_only=False, store_options=options)
    same_as_saved(back, state)
    # A file torch reads itself, equal to the source: the conversions lose nothing.
    local = tmp_path / "local.pt"
    dcp_to_torch_save(url, local, store_options=options)
    same_as_saved(torch.load(local, weights_only=False), state)

    # And again from the store's file to a second checkpoint.
    again = torch_save_to_dcp(out, f"{place}/again", store_options=options)
    dcp_to_torch_save(again, tmp_path / "again.pt", store_options=options)
    same_as_saved(torch.load(tmp_path / "again.pt", weights_only=False), state)


def test_two_ranks_sharded_save_converts_as_torchs_own(
    run_url: tuple[str, dict[str, Any] | None], tmp_path: Path
) -> None:
    run, options = run_url
    plain = tmp_path / "plain"
    argv = [run, json.dumps(options or {}), str(plain), "300"]
    # The same state saved by 2 gloo ranks, sharded: through a Checkpointer (our layout),
    # and with DCP's own FileSystemWriter.
    wait_ranks(spawn_ranks(SHARDED_SAVE_SCRIPT, 2, *argv), timeout=180)
    torch_dcp_to_torch_save(plain, tmp_path / "reference.pt")
    want = torch.load(tmp_path / "reference.pt", weights_only=True)

    # A run's version by step, and its directory directly: the same file.
    by_step = tmp_path / "by_step.pt"
    dcp_to_torch_save(run, by_step, step=300, store_options=options)
    assert_same(torch.load(by_step, weights_only=True), want)
    direct = tmp_path / "direct.pt"
    dcp_to_torch_save(f"{run}/step-000000300.dcp", direct, store_options=options)
    assert_same(torch.load(direct, weights_only=True), want)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(want["model"]["rows"], torch.randn(64, 16, generator=g))

    # Back into the run as another version, with a Checkpointer: it loads whole again.
    with Checkpointer(run, store_options=options) as ckpt:
        url = torch_save_to_dcp(direct, ckpt, step=400)
        assert url.endswith("/step-000000400.dcp")
        assert [v.step for v in ckpt.versions()] == [300, 400]
        dcp_to_torch_save(ckpt, tmp_path / "400.pt", step=400)
    assert_same(torch.load(tmp_path / "400.pt", weights_only=True), want)


def test_a_failed_commit_leaves_the_checkpoint_there_whole(
    seaweedfs: SeaweedFS, proxy: FaultProxy, tmp_path: Path
) -> None:
    options = s3_options(seaweedfs, endpoint_url=proxy.url, max_attempts=2, retry_base_delay=0.01)
    prefix = unique("fmt")
    url = f"s3://{BUCKET}/{prefix}/ckpt"
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    torch.save({"w": torch.full((64,), 1.0)}, old)
    torch.save({"w": torch.full((64,), 2.0)}, new)
    torch_save_to_dcp(old, url, store_options=options)

    # A rank object's put fails; then the commit's (.metadata's).
    for match in ("PUT ", f"PUT /{BUCKET}/{prefix}/ckpt/.metadata"):
        proxy.fail_next(10, match=match)
        with pytest.raises(StoreUnavailable):
            torch_save_to_dcp(new, url, store_options=options)
        assert proxy.failed > 0
        proxy.fail_next(0)
        proxy.failed = 0
        back = {"w": torch.zeros(64)}
        state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
        assert torch.equal(back["w"], torch.full((64,), 1.0))


def test_damaged_or_missing_sources_leave_the_file_there(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    torch.save({"w": torch.randn(128, 128)}, source)
    ckpt = tmp_path / "ckpt"
    torch_save_to_dcp(source, ckpt)
    out = tmp_path / "out.pt"
    out.write_bytes(b"what was there")

    (rank,) = ckpt.glob("__0_*.ckpt")
    data = bytearray(rank.read_bytes())
    data[len(data) // 3] ^= 0xFF
    rank.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rank.name):
        dcp_to_torch_save(ckpt, out)
    with pytest.raises(NotFound, match="no complete DCP checkpoint"):
        dcp_to_torch_save(tmp_path / "nothing", out)
    with pytest.raises(NotFound, match="no distributed version of step 5"):
        dcp_to_torch_save(tmp_path, out, step=5)
    assert out.read_bytes() == b"what was there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.pt", "out.pt"]


def test_weights_only_and_bad_arguments(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3), "mine": Opaque()}, source)
    # DCP's default loads it (as torch's torch_save_to_dcp does); weights_only=True refuses.
    ckpt = torch_save_to_dcp(source, tmp_path / "ckpt")
    with pytest.raises(UnsafeCheckpoint):
        torch_save_to_dcp(source, tmp_path / "other", weights_only=True)
    assert not (tmp_path / "other").exists()
    with pytest.raises(UnsafeCheckpoint, match="'mine'"):
        dcp_to_torch_save(ckpt, tmp_path / "out.pt", weights_only=True)
    dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    assert isinstance(torch.load(tmp_path / "out.pt", weights_only=False)["mine"], Opaque)

    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(InvalidArgument, match="holds a list, not a state dict"):
        torch_save_to_dcp(tmp_path / "list.pt", tmp_path / "ckpt2")
    with pytest.raises(InvalidArgument, match="torch_save_path"):
        dcp_to_torch_save(ckpt, f"{tmp_path}/dir/")
    with pytest.raises(InvalidArgument, match="step=-1"):
        dcp_to_torch_save(ckpt, tmp_path / "x.pt", step=-1)
    with pytest.raises(InvalidArgument, match="weights_only='yes'"):
        torch_save_to_dcp(source, ckpt, weights_only="yes")  # type: ignore[arg-type]
    with Checkpointer(tmp_path / "run") as run:
        with pytest.raises(InvalidArgument, match="needs step="):
            torch_save_to_dcp(source, run)
        with pytest.raises(InvalidArgument, match="has its own"):
            dcp_to_torch_save(run, tmp_path / "x.pt", step=1, store_options={})


class Bar:
    """What a progress bar is to the conversions: ``reset(total=)`` and ``update(n)``."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.done = 0

    def reset(self, total: int | None = None) -> None:
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n


def test_progress_and_save_config(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    words = b"".join(b"token%d " % (i % 50) for i in range(40960))
    state = {"w": torch.ones(1024), "text": torch.frombuffer(bytearray(words), dtype=torch.uint8)}
    tensor_bytes = 4096 + len(words)
    torch.save(state, source)

    bar = Bar()
    raw = torch_save_to_dcp(
        source, tmp_path / "raw", save_config=asyncstore.SaveConfig(compression=None), progress=bar
    )
    assert (bar.total, bar.done) == (2 * tensor_bytes, 2 * tensor_bytes)  # read, then written
    packed = torch_save_to_dcp(
        source, tmp_path / "packed", save_config=asyncstore.SaveConfig(compression="zstd")
    )

    def codecs(url: str) -> set[str]:
        ranks = sorted(Path(url.removeprefix("file://")).glob("__*.ckpt"))
        assert ranks
        return {t.codec for r in ranks for t in asyncio.run(inspect(str(r))).tensors}

    assert codecs(raw) == {"raw"}
    assert "zstd" in codecs(packed)

    bar = Bar()
    dcp_to_torch_save(raw, tmp_path / "out.pt", progress=bar)
    assert (bar.total, bar.done) == (tensor_bytes, tensor_bytes)
    assert_same(torch.load(tmp_path / "out.pt", weights_only=True), state)

    with pytest.raises(InvalidArgument, match="progress=<object"):
        dcp_to_torch_save(raw, tmp_path / "x.pt", progress=object())
    with pytest.raises(InvalidArgument, match="save_config=\\{'level': 3\\}"):
        torch_save_to_dcp(source, tmp_path / "y", save_config={"level": 3})  # type: ignore[arg-type]
    with (
        Checkpointer(tmp_path / "run") as run,
        pytest.raises(InvalidArgument, match="saves with its own"),
    ):
        torch_save_to_dcp(source, run, step=1, save_config=asyncstore.SaveConfig())
    assert not (tmp_path / "x.pt").exists()
    assert not (tmp_path / "y").exists()


def test_export_to_a_store_of_its_own_options(tmp_path: Path) -> None:
    src = tmp_path / "state.ckpt"
    state = {"w": torch.arange(6.0)}
    asyncstore.torch.save(state, src)
    # dst_store_options are the destination's: a bad one there is refused by name, while
    # store_options alone (the source's) are taken for both.
    with pytest.raises(InvalidArgument, match="max_inflight"):
        asyncstore.torch.export(src, tmp_path / "x.pt", dst_store_options={"max_inflight": 0})
    assert not (tmp_path / "x.pt").exists()
    url = asyncstore.torch.export(
        src, tmp_path / "out.pt", store_options={"fsync": True}, dst_store_options={"fsync": False}
    )
    assert url.endswith("/out.pt")
    assert_same(torch.load(tmp_path / "out.pt", weights_only=True), state)


def test_the_import_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 9}
    source = tmp_path / "model.pt"
    torch.save(state, source)
    run = tmp_path / "run"
    assert main(["import", str(source), str(run), "--step", "9", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["dst"].endswith("/run/step-000000009.dcp")
    assert main(["export", str(run), str(tmp_path / "out.pt"), "--step", "9"]) == 0
    assert_same(torch.load(tmp_path / "out.pt", weights_only=True), state)

    assert main(["import", str(source), str(tmp_path / "dir")]) == 0
    assert "imported" in capsys.readouterr().out
    assert_same(dcp_to_torch_save_loaded(tmp_path / "dir", tmp_path), state)

    # weights_only=True on the command line: a file with classes of its own is refused.
    torch.save({"w": torch.ones(1), "blob": io.BytesIO(b"x")}, tmp_path / "odd.pt")
    assert main(["import", str(tmp_path / "odd.pt"), str(tmp_path / "odd")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncstore: ")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "odd").exists()


def dcp_to_torch_save_loaded(ckpt: Path, tmp_path: Path) -> Any:
    out = tmp_path / "loaded.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=True)
