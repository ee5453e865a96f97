"""The command line starts without torch, the S3 client or the checkpoint engine: each test
runs a verb in a fresh interpreter and looks at what it imported. A regression (an eager
import creeping back) fails here, whatever the machine's speed; the time itself is measured
by benchmarks/bench_cli_startup.py.

Also here: ``ls`` lists a run without the checkpoint engine, and must list what
``Checkpointer.versions()`` lists."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
import asyncstore.torch as at
from asyncstore.cli._runs import versions_of

# Imported by the verbs that need them, never at start-up.
HEAVY = ("torch", "aiobotocore", "botocore", "aiohttp", "numpy")

# Runs the command line's main() in this interpreter, then writes the top-level packages
# of every module it imported (and the exit status) to the file named first.
_PROBE = textwrap.dedent(
    """
    import json, sys
    from asyncstore.cli import main
    out, argv = sys.argv[1], sys.argv[2:]
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    tops = sorted({name.split(".")[0] for name in sys.modules})
    with open(out, "w") as f:
        json.dump({"status": status, "modules": tops}, f)
    """
)


def _imported(tmp_path: Path, *argv: str) -> tuple[int, set[str]]:
    """The exit status of ``asyncstore ARGV`` in a fresh interpreter, and the top-level
    packages it imported."""
    out = tmp_path / "probe.json"
    subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), *argv],
        check=True,
        capture_output=True,
        timeout=120,
    )
    found = json.loads(out.read_text())
    return int(found["status"]), set(found["modules"])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A local run: two single-object versions and a distributed one (its directory with
    a ``.metadata``, which is all a listing looks at)."""
    directory = tmp_path / "run"
    with at.Checkpointer(directory) as ckpt:
        for step in (100, 200):
            ckpt.save({"w": torch.full((32, 32), float(step)), "step": step}, step)
    dcp = directory / "step-000000300.dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"listed, never read")
    return directory


def test_help_imports_neither_torch_nor_the_s3_client(tmp_path: Path) -> None:
    status, modules = _imported(tmp_path, "--help")
    assert status == 0
    assert "asyncstore" in modules  # the probe ran the command line
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


@pytest.mark.parametrize("verb", ["ls", "inspect", "verify", "cp", "export", "demo", "bench"])
def test_a_verbs_help_imports_neither(tmp_path: Path, verb: str) -> None:
    status, modules = _imported(tmp_path, verb, "--help")
    assert status == 0
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_ls_of_a_local_run_imports_neither(tmp_path: Path, run_dir: Path) -> None:
    status, modules = _imported(tmp_path, "ls", str(run_dir), "--json")
    assert status == 0
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_ls_of_local_objects_imports_neither(tmp_path: Path) -> None:
    (tmp_path / "objects").mkdir()
    (tmp_path / "objects" / "a.bin").write_bytes(b"x")
    status, modules = _imported(tmp_path, "ls", str(tmp_path / "objects"))
    assert status == 0
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_ls_output_is_the_run(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    from asyncstore.cli import main

    assert main(["ls", str(run_dir), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(v["step"], v["kind"]) for v in listed["versions"]] == [
        (100, "checkpoint"),
        (200, "checkpoint"),
        (300, "dcp"),
    ]


def test_the_s3_store_is_imported_by_its_first_use() -> None:
    # In a fresh interpreter: the store's module is not loaded by the package, and the
    # public names still reach it, shown as asyncstore.S3Store however they were reached.
    script = textwrap.dedent(
        """
        import sys
        import asyncstore, asyncstore.stores
        assert "asyncstore.stores.s3" not in sys.modules
        assert "botocore" not in sys.modules and "torch" not in sys.modules
        store = asyncstore.open_store("s3://bucket-name/prefix", endpoint_url="http://127.0.0.1:1")
        from asyncstore.stores import S3Store
        assert type(store) is S3Store is asyncstore.S3Store
        assert repr(S3Store) == "<class 'asyncstore.S3Store'>", repr(S3Store)
        assert "asyncstore.cache" not in sys.modules and "asyncstore.metrics" not in sys.modules
        assert repr(asyncstore.TieredCache) == "<class 'asyncstore.TieredCache'>"
        assert callable(asyncstore.metrics.snapshot)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_s3_class_shows_its_public_name_when_imported_directly() -> None:
    script = (
        "from asyncstore.stores.s3 import S3Store, S3Config\n"
        "print(repr(S3Store), S3Config.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "<class 'asyncstore.S3Store'> S3Config"


async def _both(url: str) -> tuple[list[Any], list[Any]]:
    async with asyncstore.Checkpointer(url) as ckpt:
        engine = await ckpt.versions()
    return await versions_of(url, {}), engine


def test_ls_lists_what_the_checkpointer_lists(run_dir: Path) -> None:
    # A step saved again after a later one (a rollback: it is now the newest), and a
    # damaged version: the same versions, sizes, states and order either way.
    with at.Checkpointer(run_dir) as ckpt:
        ckpt.save({"w": torch.zeros(8)}, 150)
    damaged = run_dir / "step-000000200.ckpt"
    data = bytearray(damaged.read_bytes())
    data[-40] ^= 0xFF  # in the manifest or footer: its checksum fails
    damaged.write_bytes(bytes(data))
    light, engine = asyncio.run(_both(str(run_dir)))
    assert light == engine
    # The damaged one's save time is unknown: it is taken as saved just after the step
    # before it (150, saved last).
    assert [v.step for v in light] == [100, 300, 150, 200]
    assert [v.state for v in light] == ["committed", "committed", "committed", "damaged"]
    assert light[0].raw_bytes > 32 * 32 * 4


def test_cache_stats_imports_neither(tmp_path: Path) -> None:
    status, modules = _imported(tmp_path, "cache", "stats", str(tmp_path / "no-cache"))
    assert status == 1  # nothing there: a one-line error, still without torch
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))
