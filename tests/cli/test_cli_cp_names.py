"""``asyncstore cp SRC DST`` names the copy as ``cp`` and ``aws s3 cp`` do: DST is the copy's
own name unless it is a directory (it ends with ``/``, or it is an existing local directory,
or on S3 objects exist under ``DST/``). A differential checkpoint copied under a new name
still finds its packs (their keys are relative to its directory, not to its name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncstore.torch
from asyncstore.checkpoint import read_manifest
from asyncstore.cli import main
from asyncstore.stores import open_store
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique

STEP3 = "step-000000003.ckpt"


def state(step: int) -> dict[str, Any]:
    # "frozen" is written once, into a pack the later differential versions point into.
    torch.manual_seed(0)
    return {"frozen": torch.randn(64, 32), "live": torch.full((16, 8), float(step)), "step": step}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A differential run of three versions: step 3 points into packs, by relative keys."""
    directory = tmp_path / "run"
    with asyncstore.torch.Checkpointer(str(directory), keep_last=100) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(state(step), step).result()
    # Packs, pointed into by keys relative to the version's directory: what a copy under
    # another name must keep working.
    manifest = anyio.run(read_manifest, str(directory / STEP3))
    assert manifest.packs
    assert all(pack.startswith("packs/") for pack in manifest.packs)
    return directory


def same_state(loaded: dict[str, Any], step: int) -> None:
    expected = state(step)
    assert loaded["step"] == step
    assert torch.equal(loaded["frozen"], expected["frozen"])
    assert torch.equal(loaded["live"], expected["live"])


def test_local_destination_is_the_name_unless_a_directory(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    source = str(run / STEP3)
    # A new name: written as that file, its packs beside it.
    assert main(["cp", source, str(out / "renamed.ckpt")]) == 0, capsys.readouterr().err
    assert (out / "renamed.ckpt").is_file()
    assert not (out / STEP3).exists()
    assert (out / "packs").is_dir()
    same_state(asyncstore.torch.load(str(out / "renamed.ckpt")), 3)
    assert main(["verify", str(out / "renamed.ckpt")]) == 0
    # An existing directory, and a path ending with '/': the copy keeps its name there.
    assert main(["cp", source, str(out)]) == 0
    same_state(asyncstore.torch.load(str(out / STEP3)), 3)
    assert main(["cp", source, f"{tmp_path / 'new'}/"]) == 0
    same_state(asyncstore.torch.load(str(tmp_path / "new" / STEP3)), 3)
    assert sorted(p.name for p in out.iterdir()) == ["packs", "renamed.ckpt", STEP3]
    # An existing file is replaced, as cp replaces it.
    assert main(["cp", str(run / "step-000000001.ckpt"), str(out / "renamed.ckpt")]) == 0
    same_state(asyncstore.torch.load(str(out / "renamed.ckpt")), 1)


def test_s3_destination_is_the_name_unless_it_ends_with_a_slash_or_holds_objects(
    run: Path, seaweedfs: SeaweedFS, capsys: pytest.CaptureFixture[str]
) -> None:
    options = s3_options(seaweedfs)
    to_s3 = [f"--dst-option={key}={value}" for key, value in options.items()]
    prefix = f"s3://{BUCKET}/{unique('cp-names')}"
    source = str(run / STEP3)

    def keys() -> list[str]:
        async def listed() -> list[str]:
            async with open_store(prefix, **options) as store:
                return [info.key async for info in store.list()]

        return anyio.run(listed)

    assert main(["cp", source, f"{prefix}/renamed.ckpt", *to_s3]) == 0, capsys.readouterr().err
    loaded = asyncstore.torch.load(f"{prefix}/renamed.ckpt", store_options=options)
    same_state(loaded, 3)
    listed = keys()
    assert "renamed.ckpt" in listed
    assert STEP3 not in listed
    assert any(key.startswith("packs/") for key in listed)
    # Ending with '/': into that prefix, under the source's name.
    assert main(["cp", source, f"{prefix}/a/", *to_s3]) == 0
    same_state(asyncstore.torch.load(f"{prefix}/a/{STEP3}", store_options=options), 3)
    # No '/', but objects exist under it: a directory too, never an object beside it.
    assert main(["cp", source, f"{prefix}/a", *to_s3]) == 0
    assert f"a/{STEP3}" in keys()
    assert "a" not in keys()
    assert main(["verify", f"{prefix}/a/{STEP3}", *[o.replace("--dst-", "--") for o in to_s3]]) == 0
