"""docs/first-hour.md, run as a user runs it: every shell command of the page in order, in an
empty directory, with the page's Python files written out as they stand.

The dev server starts from the page's command (on a free port rather than 8333), and the
environment is what the server printed for the user to export. The first ``python
train.py`` is killed with SIGKILL (the whole process group: the DataLoader workers too)
after it prints ``step 140``; the second resumes it. The last command trains the same run
without a stop, and every loss the killed and the resumed run printed must be its loss at
the same step, to the last digit.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "first-hour.md"
KILL_AFTER = "step 140 "
TIMEOUT = 300


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def commands() -> list[str]:
    return [
        line.strip()
        for block in blocks("sh")
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def write_files(directory: Path) -> list[str]:
    """The page's Python files (blocks that start with ``# NAME.py: ...``), written out."""
    names = []
    for block in blocks("python"):
        match = re.match(r"# (\w+\.py):", block)
        assert match is not None, f"a Python block of {PAGE.name} names no file: {block[:60]!r}"
        (directory / match.group(1)).write_text(block)
        names.append(match.group(1))
    return names


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The page's server command, started in ``tmp_path``; yields the exports it printed."""
    (command,) = [c for c in commands() if c.startswith("asyncstore server")]
    argv = [*shlex.split(command), "--port", "0"]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=environment({}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if "Stop with Ctrl-C" in line:
                break
        text = "".join(printed)
        exports = dict(re.findall(r"^\s*export (AWS_\w+)=(\S+)$", text, flags=re.M))
        assert exports, f"{command!r} printed no exports:\n{text}"
        # The page shows the same lines, but for the port.
        shown = dict(re.findall(r"^\s*export (AWS_\w+)=(\S+)$", "".join(blocks("text")), re.M))
        assert shown.keys() == exports.keys()
        for name, value in shown.items():
            if name != "AWS_ENDPOINT_URL":
                assert exports[name] == value, name
        yield exports
    finally:
        proc.send_signal(signal.SIGTERM)  # the server stops SeaweedFS and exits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def environment(exports: dict[str, str]) -> dict[str, str]:
    """A user's shell: this interpreter's ``python`` and ``asyncstore`` first on PATH, no
    AWS settings but those exported from the server's instructions."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **exports}


def run(command: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        shlex.split(command),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def run_and_kill(command: str, cwd: Path, env: dict[str, str]) -> str:
    """Run ``command`` until it prints a line starting with KILL_AFTER, then SIGKILL it and
    every process it started."""
    with subprocess.Popen(
        shlex.split(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        assert proc.stdout is not None
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if line.startswith(KILL_AFTER):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        status = proc.wait(timeout=TIMEOUT)
    assert status == -signal.SIGKILL, f"{command!r} ended before the kill:\n{''.join(printed)}"
    return "".join(printed)


def losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)}


def epochs(output: str) -> dict[int, tuple[int, float, int]]:
    """Each epoch line: samples, hit rate, samples read from S3."""
    found = re.findall(
        r"^epoch (\d+): (\d+) samples, hit rate (\S+), (\d+) read from S3", output, re.M
    )
    return {int(e): (int(n), float(rate), int(s3)) for e, n, rate, s3 in found}


def test_the_first_hour_walkthrough_runs_as_written(tmp_path: Path, server: dict[str, str]) -> None:
    assert write_files(tmp_path) == ["upload.py", "train.py"]
    env = environment(server)
    out: dict[str, str] = {}
    trains = 0
    for command in commands():
        if command.startswith("asyncstore server"):
            continue  # running: the fixture started it
        if command == "python train.py":
            trains += 1
            if trains == 1:
                out["killed"] = run_and_kill(command, tmp_path, env)
                continue
            out["resumed"] = run(command, tmp_path, env)
            continue
        out[command] = run(command, tmp_path, env)
    assert trains == 2  # train, then resume

    assert out["python upload.py"] == "uploaded 3000 samples\n"

    # The killed run: a cold first epoch, every sample read from S3 once, by two workers.
    killed, resumed = out["killed"], out["resumed"]
    assert epochs(killed) == {0: (3000, 0.0, 3000)}
    assert max(losses(killed)) == 140

    # The resumed run starts from a checkpoint taken before the kill, in epoch 1, and reads
    # nothing from S3 again: the samples are in ./cache.
    match = re.match(r"resumed at step (\d+)\n", resumed)
    assert match is not None, resumed
    start = int(match.group(1))
    assert start in (100, 125), resumed  # 125 unless its save had not committed by step 140
    assert epochs(resumed) == {1: (3000 - (start - 100) * 30, 1.0, 0), 2: (3000, 1.0, 0)}
    assert min(losses(resumed)) == start + 10 - start % 10
    assert max(losses(resumed)) == 300

    # The page's inspection commands.
    listing = out["asyncstore ls s3://runs/first-hour"]
    steps = [int(line.split()[0]) for line in listing.splitlines()[1:]]
    assert steps == [250, 275, 300]  # keep_last=3
    assert "3 of 3 verified" in out["asyncstore verify s3://runs/first-hour"]
    (check,) = [c for c in out if c.startswith("python -c")]
    assert out[check] == "['data', 'model', 'optim', 'step']\n"
    assert (tmp_path / "model.pt").is_file()

    # Exact resume: the run without a stop printed the same loss at every step.
    (straight,) = [out[c] for c in out if c.startswith("python train.py ")]
    reference = losses(straight)
    assert sorted(reference) == list(range(10, 301, 10))
    for name, output in (("killed", killed), ("resumed", resumed)):
        printed = losses(output)
        assert printed, name
        assert {step: reference[step] for step in printed} == printed, name
