"""``asyncstore cache stats|clear`` on a directory a real TieredCache filled, and
``asyncstore bench`` on a local directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import asyncstore
from asyncstore.cli import main


def fill(tmp_path: Path, count: int) -> Path:
    """A disk tier in tmp_path/cache holding ``count`` entries of 1000 bytes."""
    directory = tmp_path / "cache"

    async def run() -> None:
        async with asyncstore.open_store(tmp_path / "data") as store:
            for i in range(count):
                await store.put(f"k{i}", bytes([i]) * 1000)
            async with asyncstore.TieredCache(
                store, memory_bytes=1 << 20, disk_dir=directory, disk_bytes=8 << 20
            ) as cache:
                for i in range(count):
                    assert await cache.get(f"k{i}") == bytes([i]) * 1000

    asyncio.run(run())
    return directory


async def read_through(tmp_path: Path, directory: Path, key: str) -> asyncstore.CacheStats:
    async with (
        asyncstore.open_store(tmp_path / "data") as store,
        asyncstore.TieredCache(
            store, memory_bytes=1 << 20, disk_dir=directory, disk_bytes=8 << 20
        ) as cache,
    ):
        await cache.get(key)
        return cache.stats()


def test_cache_stats_counts_what_the_cache_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = fill(tmp_path, 12)
    assert main(["cache", "stats", str(directory), "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["entries"] == 12
    assert 12 * 1000 < usage["entry_bytes"] < 12 * 1300  # payloads plus record headers
    assert usage["segments"] >= 1
    assert usage["used_bytes"] == usage["segment_bytes"] + usage["index_bytes"]
    assert usage["budget"] is None
    assert usage["oldest_read"] <= usage["newest_read"]
    assert main(["cache", "stats", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "entries" in text
    assert " 12" in text


@pytest.mark.parametrize("action", ["stats", "clear"])
def test_cache_verbs_take_a_relative_directory(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    action: str,
) -> None:
    fill(tmp_path, 3)
    monkeypatch.chdir(tmp_path)
    assert main(["cache", action, "cache"]) == 0
    out = capsys.readouterr().out
    assert ("removed 3 entries" if action == "clear" else " 3") in out


def test_cache_clear_removes_every_entry_and_the_cache_refills(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = fill(tmp_path, 5)
    assert main(["cache", "clear", str(directory)]) == 0
    assert "removed 5 entries" in capsys.readouterr().out
    assert main(["cache", "stats", str(directory), "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["entries"] == 0
    assert usage["segments"] == 0
    assert usage["file_bytes"] == 0
    assert list((directory / "segments").iterdir()) == []
    # The cache still works: a miss, fetched from the store and kept again.
    stats = asyncio.run(read_through(tmp_path, directory, "k3"))
    assert stats.disk.hits == 0
    assert stats.store.fetches == 1
    assert main(["cache", "stats", str(directory), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 1


@pytest.mark.parametrize("action", ["stats", "clear"])
def test_cache_verbs_on_a_directory_without_a_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    assert main(["cache", action, str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncstore: ")
    assert "does not exist" in err
    assert len(err.splitlines()) == 1
    assert "Traceback" not in err
    assert not (tmp_path / "nothing").exists()


def test_cache_needs_an_action(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["cache"])
    assert caught.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_bench_measures_put_and_get(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "bench"
    argv = ["bench", str(target), "--seconds", "0.4", "--sizes", "1000,20000"]
    assert main([*argv, "--concurrency", "1,4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    results = report["results"]
    assert {(r["op"], r["size"], r["inflight"]) for r in results} == {
        (op, size, level) for op in ("put", "get") for size in (1000, 20000) for level in (1, 4)
    }
    assert all(r["ops"] > 0 and r["mb_per_second"] > 0 for r in results)
    assert list(target.iterdir()) == []  # what it wrote is gone
    assert main(["bench", "--seconds", "0.2", "--sizes", "4096"]) == 0
    out = capsys.readouterr().out
    assert "temporary local directory" in out
    assert "REQ/S" in out


@pytest.mark.parametrize(
    "argv", [["--seconds", "0"], ["--sizes", "x"], ["--concurrency", "0"], ["--option", "nokey"]]
)
def test_bench_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["bench", *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "usage:" in err
