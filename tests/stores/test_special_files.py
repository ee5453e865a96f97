"""A FIFO, socket or directory where a file is expected is refused at once, never waited on.

Opening a FIFO for reading blocks until a writer comes, inside a worker thread that no
cancellation reaches: the calls run in a child process, so that a regression fails the test
(the child is killed at the timeout) instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.anyio

_CHILD = r"""
import asyncio, json, sys
import asyncstore, asyncstore.torch
from asyncstore.checkpoint import read_manifest

root = sys.argv[1]
results = {}

async def outcome(name, make):
    try:
        await make()
        results[name] = ["returned", ""]
    except Exception as exc:
        results[name] = [type(exc).__name__, str(exc)]

async def read_all(store, key):
    async with store.open_reader(key) as reader:
        return await reader.read()

async def main():
    async with asyncstore.open_store(root) as store:
        for key in ("fifo", "sock", "dir"):
            await outcome(f"get {key}", lambda: store.get(key))
            await outcome(f"range {key}", lambda: store.get(key, 1, 3))
            await outcome(f"reader {key}", lambda: read_all(store, key))
            await outcome(f"stat {key}", lambda: store.stat(key))
        results["list"] = [info.key async for info in store.list()]
        await outcome("clean_up_writes", lambda: store.clean_up_writes("k"))
        for name, target in [
            ("path", f"{root}/fifo"),
            ("url", f"file://{root}/fifo"),
            ("pair", (store, "fifo")),
        ]:
            await outcome(f"load {name}", lambda: asyncstore.load(target))
            await outcome(f"read_manifest {name}", lambda: read_manifest(target))
            await outcome(
                f"sync load {name}",
                lambda: asyncio.to_thread(asyncstore.torch.load, target),
            )

asyncio.run(main())
print(json.dumps(results))
"""


def test_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "fifo")
    # A temp-file name is reserved and never listed, but clean_up_writes opens such files.
    os.mkfifo(root / ".asyncstore-tmp-0123456789ab-k")
    (root / "dir").mkdir()
    (root / "dir" / "x").write_bytes(b"x")
    (root / "file").write_bytes(b"data")
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(root)  # a relative name: socket paths are limited to 108 bytes
    try:
        sock.bind("sock")
    finally:
        os.chdir(cwd)
    try:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(root)],
            capture_output=True,
            text=True,
            timeout=90,  # a hang guard under the per-test timeout: the calls return at once
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    finally:
        sock.close()
    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout.splitlines()[-1])
    for key, kind in [("fifo", "a FIFO"), ("sock", "a socket"), ("dir", "a directory")]:
        for call in ("get", "range", "reader", "stat"):
            error, message = results[f"{call} {key}"]
            assert error == "NotFound", (call, key, error, message)
            assert f"file://{root}/{key}" in message
            assert kind in message
    assert results["list"] == ["dir/x", "file"]  # only regular files are objects
    assert results["clean_up_writes"][0] == "returned"
    for name in ("path", "url", "pair"):
        for call in ("load", "read_manifest", "sync load"):
            error, message = results[f"{call} {name}"]
            assert error == "NotFound", (call, name, error, message)
            assert f"{root}/fifo" in message
            assert "a FIFO" in message
