"""The demo job that `make demo` runs, end to end at a small size on a local directory store:
upload, training through the cache and prefetch, checkpoints, a SIGKILL, the resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncstore.cli import main
from asyncstore.cli._demo import _text
from asyncstore.cli._demodata import SAMPLE_BYTES, dataset_prefix, decode, sample, upload
from asyncstore.errors import InvalidArgument
from asyncstore.stores import open_store
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, unique

# 8 steps an epoch; saves at steps 5, 10 and 15, and at the last (16); the first run dies after
# step 12, in the second epoch, so the first epoch completes cold.
SMALL = ["--samples", "200", "--epochs", "2", "--batch-size", "25"]
SMALL += ["--checkpoint-every", "5", "--kill-at-step", "12", "--keep-last", "2"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One run of the demo through ``python -m asyncstore``, and its --json summary."""
    directory = tmp_path_factory.mktemp("demo")
    result = subprocess.run(
        [sys.executable, "-m", "asyncstore", "demo", "--dir", str(directory), *SMALL, "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr
    return directory, json.loads(result.stdout)


def test_the_first_run_is_killed_and_the_second_resumes_from_the_newest_checkpoint(
    demo: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = demo
    assert summary["kill"]["signal"] == "SIGKILL"
    assert summary["kill"]["at_step"] == 12
    # The saves of steps 5 and 10 committed before the kill; nothing was saved at 11 or 12.
    assert summary["kill"]["newest_committed"] == 10
    resume = summary["resume"]
    assert resume["newest_version"] == 10
    assert resume["resumed_from_step"] == 10
    assert (resume["epoch"], resume["samples_skipped_in_epoch"]) == (1, 50)
    assert resume["samples_redone"] == 50  # steps 11 and 12, lost with the killed run
    assert summary["steps"] == {"total": 16, "expected": 16, "in_order": True}
    runs = [(s["run"], s["epoch"], s["killed"]) for s in summary["segments"]]
    assert runs == [(1, 0, False), (1, 1, True), (2, 1, False)]


def test_every_sample_is_trained_on_once_per_epoch_across_the_kill(
    demo: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = demo
    assert summary["exactly_once"] is True
    for epoch in summary["epochs"]:
        assert epoch["samples"] == epoch["unique"] == epoch["expected"] == 200
        assert epoch["duplicates"] == epoch["missing"] == 0


def test_retention_keeps_keep_last_versions_locally_and_in_the_mirror(
    demo: tuple[Path, dict[str, Any]],
) -> None:
    directory, summary = demo
    checkpoints = summary["checkpoints"]
    assert checkpoints["keep_last"] == 2
    assert [(v["step"], v["where"], v["state"]) for v in checkpoints["versions"]] == [
        (15, "both", "committed"),
        (16, "both", "committed"),
    ]
    assert checkpoints["in_mirror"] == [15, 16]
    local = sorted(p.name for p in (directory / "checkpoints").glob("step-*.ckpt"))
    mirrored = sorted(p.name for p in (directory / "store/checkpoints").glob("step-*.ckpt"))
    assert local == mirrored == ["step-000000015.ckpt", "step-000000016.ckpt"]
    assert checkpoints["saves"] == checkpoints["committed"] == 4  # 5, 10; then 15, 16
    assert checkpoints["bytes_written"] > 0
    assert checkpoints["blocking_seconds"] > 0
    assert checkpoints["mirror"] == (directory / "store").as_uri() + "/checkpoints/"


def test_the_warm_epoch_hits_the_cache_and_the_cold_one_reads_the_store(
    demo: tuple[Path, dict[str, Any]],
) -> None:
    _, summary = demo
    cold, _, warm = summary["segments"]
    assert cold["hits"]["store"] == cold["hits"]["gets"] == 200
    assert cold["hit_rate"] == 0.0
    # A new run's workers start with empty memory tiers, but the disk tier is warm.
    assert warm["hits"]["store"] == 0
    assert warm["hit_rate"] == 1.0 > cold["hit_rate"]
    for segment in (cold, warm):
        assert 0.0 <= segment["stall_fraction"] <= 1.0
        assert segment["prefetch_accuracy"] == 1.0
        assert segment["samples_per_second"] > 0


def test_the_text_summary_says_what_happened(demo: tuple[Path, dict[str, Any]]) -> None:
    _, summary = demo
    text = _text(summary)
    assert "run 1 with SIGKILL after step 12 (newest committed checkpoint: step 10)" in text
    assert "run 2 loaded step 10 (the newest version: 10)" in text
    assert "every sample once per epoch (2 epochs of 200)" in text
    assert "keep_last=2: steps 15 (local+mirror), 16 (local+mirror)" in text


@pytest.mark.s3
def test_demo_on_s3_with_url_and_options(
    seaweedfs: SeaweedFS, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{BUCKET}/{unique('demo')}/"
    options = [f"--option={k}={v}" for k, v in seaweedfs.store_options().items()]
    argv = ["demo", "--dir", str(tmp_path), "--url", url, *options, "--json"]
    argv += ["--samples", "100", "--batch-size", "25", "--epochs", "2"]
    argv += ["--checkpoint-every", "2", "--kill-at-step", "5", "--keep-last", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dataset"]["url"] == f"{url}synthetic-100/"
    assert summary["resume"]["resumed_from_step"] == summary["kill"]["newest_committed"] == 4
    assert summary["exactly_once"] is True
    assert summary["checkpoints"]["mirror"] == f"{url}checkpoints/"
    assert summary["checkpoints"]["in_mirror"] == [6, 8]
    assert [v["where"] for v in summary["checkpoints"]["versions"]] == ["both", "both"]


@pytest.mark.anyio
async def test_the_dataset_is_uploaded_once_and_reads_back() -> None:
    async with open_store("memory://demo-dataset") as store:
        first = await upload(store, 3)
        again = await upload(store, 3)
        data = await store.get(dataset_prefix(3) + "00000002.bin")
    assert (first.uploaded, again.uploaded) == (True, False)
    assert first.bytes == 3 * SAMPLE_BYTES
    assert data == sample(2)
    index, label, image = decode("00000002.bin", data)
    assert (index, label, tuple(image.shape)) == (2, 2, (3, 64, 64))
    with pytest.raises(InvalidArgument, match="holds sample 2"):
        decode("00000003.bin", data)


def test_demo_reports_store_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_bytes(b"x")
    assert main(["demo", "--dir", str(tmp_path / "d"), "--url", str(tmp_path / "file")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncstore: ")
    assert "is a file" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--samples", "0"], "0 must be at least 1"),
        (["--epochs", "two"], "'two' is not a whole number"),
        (
            ["--samples", "100", "--batch-size", "50", "--epochs", "1", "--kill-at-step", "2"],
            "--kill-at-step 2: the run has 2 steps",
        ),
        (["--samples", "1", "--epochs", "1"], "too few to kill and resume"),
        (["--s3", "--url", "memory://x"], "give --s3 or --url, not both"),
        (["--option", "region=x"], "--option goes with --url"),
        (["--url", "memory://x", "--option", "region"], "'region' is not key=value"),
    ],
)
def test_demo_rejects_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["demo", *argv])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
