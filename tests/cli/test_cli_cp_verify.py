"""``asyncstore cp`` never replaces a good destination with a damaged source, and repairs a
damaged destination of the same size: the source is verified first, objects are compared
by checksum (never size alone), and the copy is verified where it lands."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncstore.torch
from asyncstore.checkpoint import read_manifest
from asyncstore.cli import main

STEP3 = "step-000000003.ckpt"


def state(step: int, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"frozen": torch.randn(64, 32), "live": torch.full((16, 8), float(step)), "step": step}


def make_run(directory: Path, seed: int = 0, **options: Any) -> Path:
    with asyncstore.torch.Checkpointer(str(directory), keep_last=100, **options) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state(step, seed), step).result()
    return directory


def flip_inside(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def first_chunk(checkpoint: Path) -> tuple[Path, int]:
    # Where the first chunk of the first tensor lies: its pack (or the object itself).
    manifest = anyio.run(read_manifest, str(checkpoint))
    storage = manifest.storages[0]
    if storage.packs and storage.pack_of(0) >= 0:
        return checkpoint.parent / manifest.packs[storage.pack_of(0)], storage.chunks[0].offset
    return checkpoint, storage.chunks[0].offset


@pytest.mark.parametrize("differential", [True, False], ids=["packed", "whole"])
def test_a_damaged_source_never_replaces_a_good_destination(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], differential: bool
) -> None:
    run = make_run(tmp_path / "run", differential=differential)
    out = tmp_path / "out"
    assert main(["cp", str(run / STEP3), f"{out}/"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    flip_inside(*first_chunk(run / STEP3))
    capsys.readouterr()
    assert main(["cp", str(run / STEP3), f"{out}/"]) == 1
    err = capsys.readouterr().err
    assert "does not verify" in err
    assert "nothing was copied" in err
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert main(["verify", str(out / STEP3)]) == 0


@pytest.mark.parametrize("differential", [True, False], ids=["packed", "whole"])
def test_a_damaged_destination_of_the_same_size_is_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], differential: bool
) -> None:
    run = make_run(tmp_path / "run", differential=differential)
    out = tmp_path / "out"
    assert main(["cp", str(run / STEP3), f"{out}/"]) == 0
    damaged, offset = first_chunk(out / STEP3)
    size = damaged.stat().st_size
    flip_inside(damaged, offset)  # bit rot: same size, same name
    assert damaged.stat().st_size == size
    assert main(["verify", str(out / STEP3)]) == 1
    capsys.readouterr()
    assert main(["cp", str(run / STEP3), f"{out}/"]) == 0, capsys.readouterr().err
    assert main(["verify", str(out / STEP3)]) == 0
    loaded = asyncstore.torch.load(out / STEP3)
    assert torch.equal(loaded["frozen"], state(3)["frozen"])


def test_a_destination_pack_of_the_same_name_but_other_bytes_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run")
    other = make_run(tmp_path / "other", seed=1)
    out = tmp_path / "out"
    assert main(["cp", str(run / STEP3), f"{out}/"]) == 0
    # The destination's packs replaced by packs of another run, renamed to match.
    for pack in anyio.run(read_manifest, str(out / STEP3)).packs:
        stem = pack.rsplit("-", 1)[0]
        (theirs,) = (other / "packs").glob(f"{Path(stem).name}-*.pack")
        shutil.copyfile(theirs, out / pack)
    assert main(["verify", str(out / STEP3)]) == 1
    capsys.readouterr()
    assert main(["cp", str(run / STEP3), f"{out}/"]) == 0, capsys.readouterr().err
    assert main(["verify", str(out / STEP3)]) == 0
