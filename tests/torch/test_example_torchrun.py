"""examples/train_ddp.py, run as docs/distributed.md tells a user to run it: torchrun, 2 gloo
ranks, DDP, AdamW, StreamingDataset with workers, background saves on the default settings.
One rank is SIGKILLed in the middle of a save, which ends the job; run again, it resumes,
and every loss equals that of a run never interrupted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asyncstore.torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
STEPS = 48  # 1024 samples, 2 ranks, batches of 32, 3 epochs


def torchrun(tmp: Path, name: str, *args: str, fails: bool = False) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(EXAMPLE),
        "--checkpoints",
        str(tmp / name),
        "--data",
        str(tmp / "data"),
        *args,
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    output = done.stdout + done.stderr
    assert (done.returncode != 0) == fails, output
    return output


def losses(output: str) -> list[tuple[int, str]]:
    return [
        (int(step), loss) for step, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)
    ]


@pytest.mark.timeout(900)  # three torchrun jobs of two ranks: about a minute when idle
def test_a_killed_job_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path: Path) -> None:
    reference = dict(losses(torchrun(tmp_path, "straight")))
    assert sorted(reference) == list(range(1, STEPS + 1))

    # Rank 1 dies right after it starts the save of step 20 (in flight, or not yet
    # committed); torchrun stops rank 0. Run again, the job resumes.
    killed = torchrun(tmp_path, "killed", "--kill-at", "20", fails=True)
    assert "exitcode: -9" in killed, killed  # the kill happened, and where
    first = losses(killed)
    assert [step for step, _ in first] == list(range(1, 21))
    output = torchrun(tmp_path, "killed")
    found = re.findall(r"^resumed from step (\d+)$", output, re.M)
    assert len(found) == 1, output
    resumed = int(found[0])
    assert resumed in (15, 20), output  # the newest save that committed whole
    second = losses(output)
    assert [step for step, _ in second] == list(range(resumed + 1, STEPS + 1))
    for step, loss in first + second:
        assert loss == reference[step], (step, loss, reference[step])

    with asyncstore.torch.Checkpointer(tmp_path / "killed") as ckpt:
        assert [(v.step, v.kind) for v in ckpt.versions()] == [
            (35, "dcp"),
            (40, "dcp"),
            (45, "dcp"),
        ]


def test_the_recipe_in_the_docs_is_the_tested_script() -> None:
    # docs/distributed.md shows the heart of examples/train_ddp.py: every line of it must be
    # a line of the script, so that what users copy is what CI runs.
    docs = (EXAMPLE.parents[1] / "docs" / "distributed.md").read_text()
    (recipe,) = re.findall(r"```python\n(# train\.py.*?)```", docs, re.S)
    script = {line.strip() for line in EXAMPLE.read_text().splitlines()}
    shown = [line.strip() for line in recipe.splitlines()[1:] if line.strip()]
    assert len(shown) > 20
    assert [line for line in shown if line not in script] == []
