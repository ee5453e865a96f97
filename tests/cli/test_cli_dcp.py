"""The command line on distributed (DCP) checkpoints: ``export`` writes the whole state as
DCP's own ``dcp_to_torch_save`` does, ``inspect`` shows the state's names; on a version that
two gloo ranks wrote with sharded and replicated tensors and plain values, to a local run
and to an S3 run."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncstore.torch
from asyncstore.cli import main

from ..helpers import assert_same
from ..ranks import SHARDED_SAVE_SCRIPT, spawn_ranks, wait_ranks
from .helpers import one_line_error

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEP = 300


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Any:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def option_args(options: dict[str, Any] | None) -> list[str]:
    return [arg for k, v in (options or {}).items() for arg in ("-o", f"{k}={v}")]


def test_export_and_inspect_of_a_version_two_ranks_wrote(
    run_url: tuple[str, dict[str, Any] | None],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run, options = run_url
    plain = tmp_path / "plain"
    argv = [run, json.dumps(options or {}), str(plain), str(STEP)]
    wait_ranks(spawn_ranks(SHARDED_SAVE_SCRIPT, 2, *argv), timeout=180)
    opts = option_args(options)

    reference = tmp_path / "reference.pt"
    dcp_to_torch_save(plain, reference)
    want = torch.load(reference, weights_only=True)
    out = tmp_path / "exported.pt"
    done = run_json(capsys, ["export", run, str(out), "--step", str(STEP), *opts])
    assert done["dst"].endswith("/exported.pt")
    got = torch.load(out, weights_only=True)  # the state allows it: no class of ours
    assert_same(got, want)
    # Whole: the shards of both ranks, un-sharded.
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 16, generator=g)
    assert torch.equal(got["model"]["rows"], rows)
    assert got["data"] == {"rank0": {"consumed": 1000}, "rank1": {"consumed": 1001}}
    assert got["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)

    # The version's directory, named directly, exports the same.
    again = tmp_path / "again.pt"
    version = f"{run}/step-{STEP:09d}.dcp"
    assert main(["export", version, str(again), *opts]) == 0
    assert_same(torch.load(again, weights_only=True), want)
    assert capsys.readouterr().err == ""  # no progress bar when stderr is not a terminal

    # inspect: the state's names, not DCP's item indices.
    info = run_json(capsys, ["inspect", run, "--step", str(STEP), *opts])
    names = set(FileSystemReader(str(plain)).read_metadata().state_dict_metadata)
    assert {item["name"] for item in info["items"]} == names
    assert "model.rows" in names
    assert "0" not in names
    by_name = {item["name"]: item for item in info["items"]}
    objects = info["objects"]
    assert [o["rank"] for o in objects] == [0, 1]
    first, second = (o["name"] for o in objects)
    assert by_name["model.rows"] | {"ranks": None} == {
        "name": "model.rows",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [64, 16],
        "nbytes": 64 * 16 * 4,
        "chunks": 2,
        "ranks": None,
    }
    assert by_name["model.rows"]["ranks"] == {first: 32 * 16 * 4, second: 32 * 16 * 4}
    bias = by_name["model.bias"]
    assert (bias["shape"], bias["chunks"], sum(bias["ranks"].values())) == ([16], 1, 64)
    step = by_name["optim.state.rows.step"]
    assert (step["dtype"], step["shape"], step["nbytes"]) == ("float32", [], 4)
    value = by_name["step"]
    assert (value["kind"], value["shape"], value["dtype"]) == ("value", None, None)
    assert value["nbytes"] > 0
    assert sum(value["ranks"].values()) == value["nbytes"]
    assert set(by_name["data.rank1.consumed"]["ranks"]) == {second}  # each rank's own
    assert sum(o["items"] for o in objects) == len(names) + 2  # two shards of each split
    assert info["format"] == "dcp"
    assert info["size"] > sum(o["size"] for o in objects)  # .metadata too
    if options is None:
        directory = Path(run) / f"step-{STEP:09d}.dcp"
        assert info["size"] == sum(p.stat().st_size for p in directory.iterdir())
        assert [o["size"] for o in objects] == [
            (directory / n).stat().st_size for n in (first, second)
        ]
    # The same as text: one line per name, with shapes and the bytes of each rank.
    capsys.readouterr()
    assert main(["inspect", version, *opts]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if line.startswith("model.rows "))
    assert line.split() == [
        "model.rows",
        "tensor",
        "float32",
        "64x16",
        "4096",
        "2",
        "0:2048",
        "1:2048",
    ]


def small_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run with one distributed version (one process), and the rank object's path."""
    run = tmp_path / "run"
    torch.manual_seed(1)
    state = {"w": torch.randn(256, 256), "step": 7}
    with asyncstore.torch.Checkpointer(str(run)) as checkpointer:
        state_dict_saver.save(state, storage_writer=checkpointer.dcp_writer(7))
    (rank,) = (run / "step-000000007.dcp").glob("__0_*.ckpt")
    return run, rank


def test_bad_sources_are_one_line_errors_and_leave_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, rank = small_run(tmp_path)
    out = tmp_path / "out.pt"
    assert main(["export", str(run), str(out), "--step", "8"]) == 1
    one_line_error(capsys, "step 8", "does not exist")
    assert main(["export", str(run), str(out)]) == 1
    one_line_error(capsys, "--step", "7")
    assert not out.exists()

    # A damaged rank object: export fails naming it, and what DST held stays.
    out.write_bytes(b"what was there")
    data = bytearray(rank.read_bytes())
    data[len(data) // 3] ^= 0xFF  # in the tensor's bytes, not the manifest
    rank.write_bytes(bytes(data))
    assert main(["export", str(run), str(out), "--step", "7"]) == 1
    one_line_error(capsys, rank.name)
    assert out.read_bytes() == b"what was there"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == ["out.pt"]
    # inspect reads no tensor data: it describes the version all the same.
    info = run_json(capsys, ["inspect", str(run), "--step", "7"])
    assert [item["name"] for item in info["items"]] == ["step", "w"]

    # A rank object gone: both fail, naming it.
    rank.unlink()
    assert main(["export", str(rank.parent), str(out)]) == 1
    one_line_error(capsys, rank.name, "lost a rank's shards")
    assert main(["inspect", str(rank.parent)]) == 1
    one_line_error(capsys, rank.name, "missing")
    assert out.read_bytes() == b"what was there"


def test_a_single_object_version_exports_with_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with asyncstore.torch.Checkpointer(str(run)) as checkpointer:
        checkpointer.save({"w": torch.arange(6.0), "step": 2}, 2).result()
    out = tmp_path / "out.pt"
    assert main(["export", str(run), str(out), "--step", "2"]) == 0
    assert "(torch.save)" in capsys.readouterr().out
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["w"], torch.arange(6.0))
    assert got["step"] == 2


def test_export_shows_progress_on_a_terminal(tmp_path: Path) -> None:
    run, _ = small_run(tmp_path)
    out = tmp_path / "out.pt"
    leader, follower = pty.openpty()
    # A terminal of 100 columns (a new one has none, and a bar of no width prints nothing).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    seen = b""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncstore", "export", str(run), str(out), "--step", "7"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=follower,
        )
        os.close(follower)
        follower = -1
        # Read the terminal as the command writes it: what is left unread when it exits
        # may be dropped with the terminal.
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the command exited: its end of the terminal is closed
                break
            if not chunk:
                break
            seen += chunk
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    assert proc.returncode == 0, seen
    assert b"exported" in stdout
    assert b"exporting" in seen
    assert b"256k" in seen.replace(b" ", b"") or b"256K" in seen.replace(b" ", b"")
