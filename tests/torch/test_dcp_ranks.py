"""The ``torch.distributed.checkpoint`` plugin across rank processes of a real gloo group:
versions of a run saved by four ranks and loaded by two and by one process, a rank killed in
the middle of a save, and a rank finding its shard damaged, to local disk and to SeaweedFS."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader

from ..ranks import spawn_ranks, wait_ranks
from .helpers import flip_a_byte

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- versions of a run, many ranks, a rank killed ---------------------------------------------

VERSION_SCRIPT = """
import json, os, signal, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import asyncstore
import asyncstore.torch as at

job = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))

def full(step, rows):
    g = torch.Generator().manual_seed(step)
    return {
        "rows": torch.randn(rows, 16, generator=g),
        "bias": torch.randn(16, generator=g),
        "exp_avg": torch.randn(rows, 16, generator=g),
    }

def sharded(values, step):
    return {
        "model": {
            "rows": distribute_tensor(values["rows"], mesh, [Shard(0)]),  # row-wise
            "bias": distribute_tensor(values["bias"], mesh, [Replicate()]),
        },
        "optim": {
            "state": {"rows": {
                "exp_avg": distribute_tensor(values["exp_avg"], mesh, [Shard(0)]),
                "step": torch.tensor(float(step)),
            }},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["rows", "bias"]}],
        },
        "step": step,
        # Each rank's own values (its dataset position): under a key of its own, or DCP
        # would keep one rank's copy of a key every rank saves.
        "data": {f"rank{rank}": {"consumed": 1000 * step + rank}},
    }

def check(loaded, step, rows):
    want = full(step, rows)
    assert torch.equal(loaded["model"]["rows"].full_tensor(), want["rows"]), step
    assert torch.equal(loaded["model"]["bias"].full_tensor(), want["bias"]), step
    got = loaded["optim"]["state"]["rows"]
    assert torch.equal(got["exp_avg"].full_tensor(), want["exp_avg"]), step
    assert got["step"].item() == float(step)
    assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert loaded["step"] == step
    assert loaded["data"] == {f"rank{rank}": {"consumed": 1000 * step + rank}}

def load(ckpt, step, rows):
    target = sharded({k: torch.zeros_like(v) for k, v in full(0, rows).items()}, 0)
    state_dict_loader.load(target, storage_reader=ckpt.dcp_reader(step))
    return target

if job["mode"] == "die" and rank == 1:
    # Killed in the middle of writing its shards, as a lost node would be.
    from asyncstore.checkpoint import _target
    real_write, calls = _target.StoreSink.write, []

    async def write(self, data, loan=None):
        await real_write(self, data, loan)
        calls.append(len(data))
        if len(calls) < 2:
            return
        if job["url"].startswith("s3://") and len(calls) < 12:
            # On S3, once a part of the object is up (a multipart upload to clean up).
            async with asyncstore.open_store(job["url"], **job["options"]) as store:
                if not await store.abandoned_writes("step-000000002.dcp/__1_"):
                    return
        os.kill(os.getpid(), signal.SIGKILL)

    _target.StoreSink.write = write

with at.Checkpointer(
    job["url"], keep_last=2, chunk_bytes=1 << 20, store_options=job["options"]
) as ckpt:
    rows = job["rows"]
    if job["mode"] in ("save", "die"):
        for step in job["steps"]:
            values = full(step, rows)
            state = sharded({k: v.clone() for k, v in values.items()}, step)
            writer = ckpt.dcp_writer(step)
            if step in job.get("async", ()):
                future = state_dict_saver.async_save(
                    state, storage_writer=writer, process_group=ckpt.dcp_group()
                )
                for tensor in (state["model"]["rows"], state["optim"]["state"]["rows"]["exp_avg"]):
                    tensor.to_local().add_(1.0)  # the next training step goes on at once
                future.result(timeout=120)
            else:
                state_dict_saver.save(state, storage_writer=writer)
    elif job["mode"] == "load":
        for step in job["steps"]:
            loaded = load(ckpt, step, rows)
            check(loaded, loaded["step"], rows)
            if step is None:
                assert loaded["step"] == job["newest"], loaded["step"]
    elif job["mode"] == "fallback":
        target = sharded({k: torch.zeros_like(v) for k, v in full(0, rows).items()}, 0)
        step = ckpt.dcp_load(target)
        assert step == job["newest"], step
        check(target, step, rows)
    elif job["mode"] == "recover":
        loaded = load(ckpt, None, rows)
        assert loaded["step"] == job["newest"], loaded["step"]
        check(loaded, loaded["step"], rows)
        state_dict_saver.save(sharded(full(3, rows), 3), storage_writer=ckpt.dcp_writer(3))
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as in test_dcp.py's RANK_SCRIPT
"""


def spawn(world: int, job: dict[str, Any]) -> list[subprocess.Popen[str]]:
    return spawn_ranks(VERSION_SCRIPT, world, json.dumps(job))


def run_ranks(world: int, job: dict[str, Any]) -> None:
    wait_ranks(spawn(world, job), timeout=240)


def full_values(step: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "rows": torch.randn(rows, 16, generator=g),
        "bias": torch.randn(16, generator=g),
        "exp_avg": torch.randn(rows, 16, generator=g),
    }


def load_whole(ckpt: Any, step: int | None, rows: int) -> dict[str, Any]:
    """The version loaded in this one process, as plain tensors (another world size)."""
    target: dict[str, Any] = {
        "model": {"rows": torch.zeros(rows, 16), "bias": torch.zeros(16)},
        "optim": {
            "state": {"rows": {"exp_avg": torch.zeros(rows, 16), "step": torch.tensor(0.0)}},
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}],
        },
        "step": 0,
    }
    state_dict_loader.load(target, storage_reader=ckpt.dcp_reader(step))
    return target


def assert_whole(loaded: dict[str, Any], step: int, rows: int) -> None:
    want = full_values(step, rows)
    assert loaded["step"] == step
    assert torch.equal(loaded["model"]["rows"], want["rows"])
    assert torch.equal(loaded["model"]["bias"], want["bias"])
    assert torch.equal(loaded["optim"]["state"]["rows"]["exp_avg"], want["exp_avg"])
    assert loaded["optim"]["state"]["rows"]["step"].item() == float(step)


def test_four_ranks_save_versions_that_two_ranks_and_one_process_load(
    where: tuple[str, dict[str, Any]],
) -> None:
    from asyncstore.torch import Checkpointer

    url, options = where
    rows = 64
    # Step 1 with dcp.save, step 2 with dcp.async_save (the tensors change as it returns).
    job = {"url": url, "options": options, "rows": rows}
    run_ranks(4, {**job, "mode": "save", "steps": [1, 2], "async": [2]})
    # Two ranks: the newest version (agreed by rank 0), then step 1 by name.
    run_ranks(2, {**job, "mode": "load", "steps": [None, 1], "newest": 2})
    with Checkpointer(url, store_options=options) as ckpt:
        versions = ckpt.versions()
        assert [(v.step, v.kind) for v in versions] == [(1, "dcp"), (2, "dcp")]
        assert_whole(load_whole(ckpt, None, rows), 2, rows)
        assert ckpt.verify(2).ok


def test_a_rank_killed_during_a_save_leaves_the_previous_version_and_the_next_save_cleans_up(
    where: tuple[str, dict[str, Any]],
) -> None:
    from asyncstore.stores import CleansUpWrites, open_store
    from asyncstore.torch import Checkpointer

    url, options = where
    rows = 1 << 17  # 8 MiB of rows, 8 of optimizer state: a rank's object takes many writes
    run_ranks(2, {"mode": "save", "url": url, "options": options, "rows": rows, "steps": [1]})
    procs = spawn(2, {"mode": "die", "url": url, "options": options, "rows": rows, "steps": [2]})
    procs[1].communicate(timeout=240)
    assert procs[1].returncode == -9  # SIGKILL, in the middle of its write
    try:
        procs[0].communicate(timeout=30)  # its collective fails, or it waits for rank 1
    except subprocess.TimeoutExpired:
        procs[0].kill()  # as torchrun does to the rest of a group that lost a rank
        procs[0].communicate()
    assert procs[0].returncode != 0

    async def leftovers() -> list[str]:
        async with open_store(url, **options) as store:
            found = [info.key async for info in store.list("step-000000002.dcp/")]
            assert isinstance(store, CleansUpWrites)
            return found + await store.abandoned_writes("step-000000002.dcp/")

    from asyncstore._loop import run_sync

    left = run_sync(leftovers())
    assert not any(key.endswith(".metadata") for key in left)  # never became a version
    # Rank 1's unfinished write: a temporary file, or on S3 a multipart upload.
    assert any(key.startswith("step-000000002.dcp/__1_") for key in left), left
    with Checkpointer(url, store_options=options) as ckpt:
        assert [v.step for v in ckpt.versions()] == [1]
    # A new group loads the newest version, step 1, and saves step 3: what the killed save
    # left goes.
    run_ranks(2, {"mode": "recover", "url": url, "options": options, "rows": rows, "newest": 1})
    assert run_sync(leftovers()) == []
    with Checkpointer(url, store_options=options) as ckpt:
        assert [(v.step, v.kind) for v in ckpt.versions()] == [(1, "dcp"), (3, "dcp")]


def test_a_rank_finding_its_shard_damaged_makes_every_rank_load_the_older_version(
    tmp_path: Path,
) -> None:
    url, rows = str(tmp_path / "run"), 64
    run_ranks(2, {"mode": "save", "url": url, "options": {}, "rows": rows, "steps": [1, 2]})
    (theirs,) = (tmp_path / "run" / "step-000000002.dcp").glob("__1_*.ckpt")
    flip_a_byte(theirs)  # rank 1's row shards: rank 0 reads nothing from this object
    job = {"mode": "fallback", "url": url, "options": {}, "rows": rows, "newest": 1}
    run_ranks(2, job)
