"""Saves interrupted from outside: a process killed mid-save, an object store stopped mid-save.
What is left is the old checkpoint or the new one, never a part of one."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import NotFound, StoreUnavailable
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import assert_same_storage_layout

pytestmark = pytest.mark.anyio

WRITER = """
import sys, time, torch
from asyncstore.torch import save
target, options = sys.argv[1], eval(sys.argv[2])
gen = torch.Generator().manual_seed(int(sys.argv[3]))
state = {f"w{i}": torch.randn(2_000_000, generator=gen) for i in range(4)}
print("ready", flush=True)
save(state, target, compression="zstd", level=3, chunk_bytes=1 << 20, store_options=options)
print("saved", flush=True)
"""


def expected_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(2_000_000, generator=gen) for i in range(4)}


def kill_during_save(target: str, options: dict[str, Any], seed: int, delay: float) -> bool:
    """Start a save in a subprocess, SIGKILL it ``delay`` s after it is ready; True if it
    finished first."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, target, repr(options), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    return "saved" in out


@pytest.mark.parametrize("kind", ["local", "s3"])
async def test_sigkill_mid_save_leaves_old_or_new(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "s3":
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        options = s3_options(server)
        target = f"s3://{BUCKET}/{unique('kill')}/ckpt"
    else:
        options, target = {}, str(tmp_path / "ckpt")
    rng = random.Random(5)
    outcomes = set()
    killed_mid_save = 0
    for attempt, delay in enumerate([0.0, 0.05, 0.1, 0.2, 0.4]):
        finished = await anyio.to_thread.run_sync(
            kill_during_save, target, options, attempt, delay + rng.uniform(0.0, 0.05)
        )
        killed_mid_save += not finished
        try:
            loaded = await asyncstore.load(target, store_options=options)
        except NotFound:
            assert not finished
            outcomes.add("absent")
            continue
        # Never a partial checkpoint: what is there is one whole save, verified.
        matches = [
            seed
            for seed in range(attempt + 1)
            if all(torch.equal(loaded[k], v) for k, v in expected_state(seed).items())
        ]
        assert matches, "the checkpoint matches none of the saves"
        outcomes.add("new" if matches[-1] == attempt else "old")
        if finished:
            assert matches[-1] == attempt
    assert killed_mid_save >= 1
    # The next save cleans up what a killed one left: temp files, or unfinished uploads.
    final = {"done": torch.ones(3)}
    await (await asyncstore.save(final, target, store_options=options))
    assert_same_storage_layout(final, await asyncstore.load(target, store_options=options))
    if kind == "s3":
        prefix = target.removeprefix(f"s3://{BUCKET}/")
        assert server.list_multipart_uploads(BUCKET, prefix) == []
    else:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert outcomes


async def test_server_stopped_mid_save(tmp_path: Path) -> None:
    server = SeaweedFS(data_dir=tmp_path / "sw")
    server.start()
    try:
        server.create_bucket("ckpt")
        options = s3_options(server, retry_base_delay=0.01, retry_max_delay=0.05, max_attempts=3)
        state = {f"w{i}": torch.randn(1_500_000) for i in range(4)}  # 24 MB: several parts
        handle = await asyncstore.save(
            state, "s3://ckpt/run/step.ckpt", compression=None, store_options=options
        )
        server.stop(timeout=2.0)
        with pytest.raises(StoreUnavailable):
            await handle
    finally:
        server.stop(timeout=2.0)
    again = SeaweedFS(data_dir=tmp_path / "sw")
    again.start()
    try:
        with pytest.raises(NotFound):
            await asyncstore.load("s3://ckpt/run/step.ckpt", store_options=s3_options(again))
    finally:
        again.stop(timeout=2.0)
