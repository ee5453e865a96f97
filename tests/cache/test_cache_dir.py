"""A cache directory that cannot be used is refused where it is given, by TieredCache and by
StreamingDataset, with an asyncstore error that names the path and what to do."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from asyncstore import InvalidArgument, open_store
from asyncstore.cache import TieredCache
from asyncstore.torch import StreamingDataset


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.bin").write_bytes(bytes([i]) * 10)
    return root


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_bytes(b"not a directory")
    return path


# Paths that no process can make a directory of, root included: checked for every user.
WRONG_PATHS = {
    "a file": (a_file, "is a file, not a directory"),
    "under a file": (lambda tmp: a_file(tmp) / "cache", "a part of that path is a file"),
    "in /proc": (lambda tmp: Path("/proc/asyncstore-cache"), "cannot be created"),
}


@pytest.mark.parametrize("case", WRONG_PATHS)
def test_tiered_cache_refuses_a_path_that_cannot_be_a_directory(
    source: Path, tmp_path: Path, case: str
) -> None:
    make, expected = WRONG_PATHS[case]
    path = make(tmp_path)
    store = open_store(source)  # not entered: nothing to close
    with pytest.raises(InvalidArgument) as caught:
        TieredCache(store, memory_bytes=1 << 20, disk_dir=path, disk_bytes=1 << 20)
    message = str(caught.value)
    assert message.startswith(f"disk_dir={str(path)!r}")
    assert expected in message
    assert "choose a directory this process can write" in message
    assert "disk_dir=None and disk_bytes=None for no disk tier" in message
    assert isinstance(caught.value.__cause__, OSError)  # the system's own error, kept


@pytest.mark.parametrize("listed", [False, True])
@pytest.mark.parametrize("case", WRONG_PATHS)
def test_streaming_dataset_refuses_a_path_that_cannot_be_a_directory(
    source: Path, tmp_path: Path, case: str, listed: bool
) -> None:
    make, expected = WRONG_PATHS[case]
    path = make(tmp_path)
    keys = None if listed else ["0.bin", "1.bin"]  # listed: the listing is kept there too
    with pytest.raises(InvalidArgument) as caught:
        StreamingDataset(source, keys=keys, cache_dir=path)
    message = str(caught.value)
    assert message.startswith(f"cache_dir={str(path)!r}")
    assert expected in message
    assert "choose a directory this process can write, or cache_dir=None" in message


def test_a_usable_directory_is_created_and_left_clean(source: Path, tmp_path: Path) -> None:
    disk = tmp_path / "new" / "disk"
    TieredCache(open_store(source), memory_bytes=1 << 20, disk_dir=disk, disk_bytes=1 << 20)
    assert disk.is_dir()
    assert list(disk.iterdir()) == []  # the write probe removed its file
    cache_dir = tmp_path / "new" / "dataset"
    ds: StreamingDataset[bytes] = StreamingDataset(source, keys=["0.bin"], cache_dir=cache_dir)
    try:
        assert list(ds) == [bytes([0]) * 10]
        assert cache_dir.is_dir()
        assert ds.stats() is not None
    finally:
        ds.close()


# Run in a child process, which reads the directories as an unprivileged user: a process of
# root writes in a directory of mode 0o555 all the same, so as root the child gives up root
# (after its imports, which may live under root's home) before anything is constructed.
READ_ONLY_CHILD = """
import json, os, sys
from asyncstore import open_store
from asyncstore.cache import TieredCache
from asyncstore.torch import StreamingDataset

source, read_only = sys.argv[1], sys.argv[2]
store = open_store(source)
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)  # nobody
attempts = {
    "cache": lambda path: TieredCache(
        store, memory_bytes=1 << 20, disk_dir=path, disk_bytes=1 << 20
    ),
    "dataset": lambda path: StreamingDataset(source, keys=["0.bin"], cache_dir=path),
    "listed dataset": lambda path: StreamingDataset(source, cache_dir=path),
}
results = {}
for name, attempt in attempts.items():
    for path in (read_only, os.path.join(read_only, "cache")):
        try:
            attempt(path)
        except Exception as exc:
            results[f"{name} {path}"] = [type(exc).__name__, str(exc)]
        else:
            results[f"{name} {path}"] = ["constructed", ""]
print(json.dumps(results))
"""


@pytest.fixture
def world_readable() -> Iterator[Path]:
    # Not under tmp_path: its parents are private to the user running the tests, and the
    # child must reach the directory to be refused by its mode, not by a parent's.
    root = Path(tempfile.mkdtemp(prefix="asyncstore-cache-dir-"))
    try:
        root.chmod(0o755)
        yield root
    finally:
        for path in root.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(root)


def test_a_directory_this_process_may_not_write_is_refused(world_readable: Path) -> None:
    source = world_readable / "data"
    source.mkdir(mode=0o755)
    (source / "0.bin").write_bytes(b"x")
    (source / "0.bin").chmod(0o644)
    read_only = world_readable / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    result = subprocess.run(
        [sys.executable, "-c", READ_ONLY_CHILD, str(source), str(read_only)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    results = json.loads(result.stdout)
    assert len(results) == 6
    for attempt, (error, message) in results.items():
        path = attempt.split(" ")[-1]
        parameter = "disk_dir" if attempt.startswith("cache") else "cache_dir"
        assert error == "PermissionDenied", (attempt, error, message)
        assert message.startswith(f"{parameter}={path!r}: this process (uid ")
        assert "may not write there (Permission denied)" in message
        assert "choose a directory this process can write" in message
    assert list(read_only.iterdir()) == []  # nothing was left there


def test_a_listing_that_cannot_be_kept_is_made_in_memory(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The directory is fine, but the listing's own file cannot be written there (its lock's
    # name is taken by a directory), as on a disk that fails or fills up: the listing is a
    # cache, so the dataset lists into memory and says so, rather than failing.
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    digest = xxhash.xxh3_64_hexdigest(f"{source}\0".encode())  # how the dataset names it
    (cache_dir / f"keys-{digest}.idx.lock").mkdir()
    with caplog.at_level(logging.WARNING, logger="asyncstore.torch"):
        ds: StreamingDataset[bytes] = StreamingDataset(source, cache_dir=cache_dir)
    try:
        assert len(ds) == 3
        assert sorted(ds) == [bytes([i]) * 10 for i in range(3)]
    finally:
        ds.close()
    assert any(
        "could not keep the listing" in record.getMessage()
        and str(cache_dir) in record.getMessage()
        for record in caplog.records
    )
    assert not (cache_dir / f"keys-{digest}.idx").exists()
    assert os.path.isdir(cache_dir / f"keys-{digest}.idx.lock")
