"""The demo job that `make demo` runs, end to end on a local directory store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncstore.cli import main


def test_demo_writes_lists_and_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "demo"
    assert main(["demo", "--url", str(target), "--objects", "40", "--size", "1000"]) == 0
    out = capsys.readouterr().out
    assert f"store: file://{target}" in out
    assert "wrote   40 objects of 1000 bytes" in out
    assert "listed  40 objects under demo/" in out
    assert "40 of 40 byte-identical" in out
    assert "wrote and read back 8000 bytes" in out
    assert len(list((target / "demo").iterdir())) == 41


def test_demo_reports_store_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_bytes(b"x")
    assert main(["demo", "--url", str(tmp_path / "file")]) == 1
    assert "is a file" in capsys.readouterr().err


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--objects", "0"])
    assert caught.value.code == 2
    assert "must be positive" in capsys.readouterr().err


def test_python_dash_m(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncstore",
            "demo",
            "--url",
            str(tmp_path / "d"),
            "--objects",
            "5",
            "--size",
            "10",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "5 of 5 byte-identical" in result.stdout
