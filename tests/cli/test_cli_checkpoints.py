"""The checkpoint verbs of the command line (ls, inspect, verify, cp, prune) on real
checkpoints: single objects, differential runs and a distributed (DCP) run, on local disk
and on SeaweedFS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_saver

import asyncstore.torch
from asyncstore.checkpoint._packfile import TRAILER_SIZE
from asyncstore.cli import main
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import one_line_error


def state(step: int) -> dict[str, Any]:
    # "frozen" never changes (shared by every differential version), "live" does.
    torch.manual_seed(0)
    frozen = torch.randn(64, 32)
    live = torch.full((16, 8), float(step))
    return {"frozen": frozen, "live": live, "step": step}


def make_run(url: str, steps: range, **options: Any) -> None:
    with asyncstore.torch.Checkpointer(url, keep_last=100, **options) as checkpointer:
        for step in steps:
            checkpointer.save(state(step), step).result()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0) -> Any:
    capsys.readouterr()
    assert main([*argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


def test_ls_lists_versions_of_a_run_and_objects_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 4))
    listing = run_json(capsys, ["ls", str(run)])
    assert listing["kind"] == "run"
    versions = listing["versions"]
    assert [v["step"] for v in versions] == [1, 2, 3]
    assert {v["kind"] for v in versions} == {"checkpoint"}
    assert {v["state"] for v in versions} == {"committed"}
    # The full first save stores "frozen"; later ones only what changed.
    assert versions[1]["stored_bytes"] < versions[0]["stored_bytes"]
    assert main(["ls", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "KIND", "SIZE"]
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "3"]
    objects = run_json(capsys, ["ls", str(tmp_path)])
    assert objects["kind"] == "objects"
    keys = {o["key"] for o in objects["objects"]}
    assert "run/step-000000001.ckpt" in keys
    assert any(k.startswith("run/packs/") for k in keys)


def test_inspect_reads_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 4))
    info = run_json(capsys, ["inspect", str(run), "--step", "3"])
    assert info["format"] == 2
    assert info["metadata"]["step"] == 3
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["frozen"]["shape"] == [64, 32]
    assert tensors["frozen"]["dtype"] == "float32"
    assert tensors["frozen"]["nbytes"] == 64 * 32 * 4
    assert tensors["frozen"]["shared_chunks"] == tensors["frozen"]["chunks"] >= 1
    assert tensors["live"]["shape"] == [16, 8]
    assert tensors["live"]["shared_chunks"] == 0  # changed: written by this version
    assert info["raw_bytes"] > info["stored_bytes"]
    newest = run_json(capsys, ["inspect", str(run)])  # no --step: the newest
    assert newest["metadata"]["step"] == 3
    first = run_json(capsys, ["inspect", str(run), "--step", "1"])
    assert all(t["shared_chunks"] == 0 for t in first["tensors"])

    single = tmp_path / "single.ckpt"
    asyncstore.torch.save(state(7), single, metadata={"epoch": 2})
    info = run_json(capsys, ["inspect", str(single)])
    assert info["format"] == 1
    assert info["metadata"] == {"epoch": 2}
    assert info["packs"] == []
    assert info["size"] == single.stat().st_size
    assert main(["inspect", str(single)]) == 0
    out = capsys.readouterr().out
    assert "frozen" in out
    assert "64x32" in out


def test_verify_passes_then_names_each_damaged_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 4))
    single = tmp_path / "single.ckpt"
    asyncstore.torch.save(state(1), single, compression=None)
    assert main(["verify", str(run)]) == 0
    assert "3 of 3 verified" in capsys.readouterr().out
    assert main(["verify", str(single)]) == 0
    capsys.readouterr()

    flip(single, single.stat().st_size // 2)
    assert main(["verify", str(single)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED  {single}" in out
    assert "checksum" in out

    # A byte of step 2's own pack (its "live"; step 3 wrote its own): only step 2 fails.
    (pack,) = (run / "packs").glob("step-000000002-*.pack")
    index_offset = int.from_bytes(pack.read_bytes()[-TRAILER_SIZE:][16:24], "little")
    flip(pack, index_offset - 10)  # in its last chunk, just before the pack's own end
    report = run_json(capsys, ["verify", str(run)], status=1)
    assert report["ok"] is False
    failed = [c["step"] for c in report["checked"] if not c["ok"]]
    assert failed == [2]
    assert "step-000000002" in report["checked"][1]["error"]
    assert main(["verify", str(run), "--step", "3"]) == 0
    capsys.readouterr()
    assert main(["verify", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("FAILED")] == [
        line for line in lines if "step 2 " in line
    ]


def test_prune_deletes_exactly_what_retention_does_not_keep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 8))
    dry = run_json(
        capsys, ["prune", str(run), "--keep-last", "2", "--keep-every", "3", "--dry-run"]
    )
    assert dry == {"dry_run": True, "deleted": [1, 2, 4, 5]}
    assert len(list(run.glob("step-*.ckpt"))) == 7
    assert main(["prune", str(run), "--keep-last", "2", "--keep-every", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "deleted step 1",
        "deleted step 2",
        "deleted step 4",
        "deleted step 5",
    ]
    with asyncstore.torch.Checkpointer(str(run)) as checkpointer:
        assert [v.step for v in checkpointer.versions()] == [3, 6, 7]
        assert checkpointer.prune(keep_last=5) == []
    assert main(["verify", str(run)]) == 0  # the packs they point into stayed
    assert run_json(capsys, ["prune", str(run), "--keep-last", "1"])["deleted"] == [3, 6]


def test_cp_copies_a_differential_version_to_s3_and_verifies_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seaweedfs: SeaweedFS
) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 4))
    target = f"s3://{BUCKET}/{unique('cli-cp')}"
    options = [f"--option={key}={value}" for key, value in s3_options(seaweedfs).items()]
    to_s3 = [option.replace("--option", "--dst-option") for option in options]
    copied = run_json(capsys, ["cp", str(run), target, "--step", "3", *to_s3])
    assert copied["verified"] is True
    assert copied["destination"] == f"{target}/step-000000003.ckpt"
    assert copied["objects"] == 3  # the version and the two packs it points into
    assert main(["verify", target, *options]) == 0
    assert "1 of 1 verified" in capsys.readouterr().out
    assert [v["step"] for v in run_json(capsys, ["ls", target, *options])["versions"]] == [3]
    info = run_json(capsys, ["inspect", f"{target}/step-000000003.ckpt", *options])
    assert info["metadata"]["step"] == 3
    # A single checkpoint, back from S3 to a local directory.
    local = tmp_path / "back"
    local.mkdir()
    url = f"{target}/step-000000003.ckpt"
    assert main(["cp", url, str(local), *options]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["verify", str(local / "step-000000003.ckpt")]) == 0


def test_cp_needs_a_step_for_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 3))
    assert main(["cp", str(run), str(tmp_path / "elsewhere")]) == 1
    one_line_error(capsys, "--step")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_distributed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with asyncstore.torch.Checkpointer(str(run)) as checkpointer:
        for step in (10, 20):
            state_dict_saver.save(
                {"w": torch.randn(32, 16), "b": torch.zeros(5)},
                storage_writer=checkpointer.dcp_writer(step),
            )
    versions = run_json(capsys, ["ls", str(run)])["versions"]
    assert [(v["step"], v["kind"]) for v in versions] == [(10, "dcp"), (20, "dcp")]
    assert main(["verify", str(run)]) == 0
    assert "2 of 2 verified" in capsys.readouterr().out
    info = run_json(capsys, ["inspect", str(run), "--step", "20"])
    assert [item["name"] for item in info["items"]] == ["b", "w"]
    assert "step-000000020.dcp" in info["url"]
    assert [o["name"][:4] for o in info["objects"]] == ["__0_"]
    copied = run_json(capsys, ["cp", str(run), str(tmp_path / "copy"), "--step", "10"])
    assert copied["objects"] == 2  # the rank's object and .metadata
    assert main(["verify", str(tmp_path / "copy")]) == 0
    capsys.readouterr()
    (rank,) = (run / "step-000000020.dcp").glob("__0_*.ckpt")
    flip(rank, rank.stat().st_size // 3)
    assert main(["verify", str(run), "--step", "20"]) == 1
    assert "FAILED  step 20" in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["ls", "inspect", "verify", "prune"])
def test_missing_objects_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str
) -> None:
    argv = [verb, str(tmp_path / "nothing")]
    if verb == "prune":
        argv += ["--keep-last", "1"]
    assert main(argv) == 1
    one_line_error(capsys, "asyncstore: ", "does not exist")


def test_missing_steps_and_s3_objects_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seaweedfs: SeaweedFS
) -> None:
    run = tmp_path / "run"
    make_run(str(run), range(1, 2))
    for verb in ("inspect", "verify"):
        assert main([verb, str(run), "--step", "9"]) == 1
        one_line_error(capsys, "step 9", "does not exist")
    options = [f"--option={key}={value}" for key, value in s3_options(seaweedfs).items()]
    assert main(["verify", f"s3://{BUCKET}/{unique('none')}/x.ckpt", *options]) == 1
    one_line_error(capsys, "does not exist")


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "x", "--step", "-1"],
        ["verify", "x", "--step", "many"],
        ["prune", "x", "--keep-last", "0"],
        ["prune", "x"],
        ["ls", "x", "--option", "novalue"],
        ["cp", "x"],
        ["ls"],
    ],
)
def test_bad_arguments_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "usage:" in err


def test_a_bad_store_option_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", str(tmp_path), "--option", "no_such_option=1"]) == 1
    one_line_error(capsys, "no_such_option")
