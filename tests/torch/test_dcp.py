"""The ``torch.distributed.checkpoint`` storage plugin: DCP's own save and load through
asyncstore, in one process and in two processes of a real gloo process group, to local disk
and to SeaweedFS."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from asyncstore import IntegrityError, InvalidArgument, NotFound
from asyncstore.testing import SeaweedFS
from asyncstore.torch.dcp import StorageReader, StorageWriter

from ..conftest import BUCKET, s3_options, unique
from ..ranks import spawn_ranks, wait_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def trained(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "meta": {"step": seed}}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    server: SeaweedFS = request.getfixturevalue("seaweedfs")
    return f"s3://{BUCKET}/{unique('dcp')}", s3_options(server)


def test_dcp_save_and_load_in_one_process(where: tuple[str, dict[str, Any]]) -> None:
    url, options = where
    saved = trained(1)
    state_dict_saver.save(saved, storage_writer=StorageWriter(url, store_options=options))
    target = trained(2)  # same shapes, other values
    state_dict_loader.load(target, storage_reader=StorageReader(url, store_options=options))
    assert_same(target, saved)


def test_dcp_async_save_stages_and_writes_through_the_plugin(
    where: tuple[str, dict[str, Any]],
) -> None:
    # DCP's async_save stages the state with its own copy, then writes through the plugin
    # in the background: the tensors may change as soon as it returns.
    url, options = where
    weights = torch.randn(1000, 100)
    live = weights.clone()
    state = {"w": live, "step": 3}
    future = state_dict_saver.async_save(
        state, storage_writer=StorageWriter(url, store_options=options)
    )
    live.add_(1.0)  # the training step goes on
    assert isinstance(future, Future)
    future.result(timeout=120)
    back: dict[str, Any] = {"w": torch.zeros(1000, 100), "step": 0}
    state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
    assert torch.equal(back["w"], weights)
    assert back["step"] == 3


def test_a_damaged_chunk_names_the_object_and_an_unfinished_save_is_not_found(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ckpt")
    state_dict_saver.save(trained(1), storage_writer=StorageWriter(url, compression=None))
    (rank_file,) = (tmp_path / "ckpt").glob("__0_*.ckpt")
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 1
    rank_file.write_bytes(bytes(data))
    # DCP gathers each rank's error into a CheckpointException.
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(trained(2), storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert rank_file.name in str(error)
    assert "does not match its checksum" in str(error)
    # The metadata is written last: without it there is no checkpoint.
    (tmp_path / "ckpt" / ".metadata").unlink()
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(trained(2), storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert "no complete DCP checkpoint" in str(error)  # DCP re-raises it as its own


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="checkpoint_id="):
        StorageWriter(123)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="store_options="):
        StorageReader("/x", store_options="a")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="no URL"):
        StorageWriter().reset()


RANK_SCRIPT = """
import os, sys, json
import torch, torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate, distribute_tensor
from asyncstore.torch.dcp import StorageReader, StorageWriter

url, options = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)  # the same full tensors on every rank
full = {"rows": torch.randn(64, 16), "bias": torch.randn(16)}
state = {
    "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),  # row-wise sharded
    "bias": distribute_tensor(full["bias"], mesh, [Replicate()]),
    "step": 5,
}
state_dict_saver.save(state, storage_writer=StorageWriter(url, store_options=options))
back = {
    "rows": distribute_tensor(torch.zeros(64, 16), mesh, [Shard(0)]),
    "bias": distribute_tensor(torch.zeros(16), mesh, [Replicate()]),
    "step": 0,
}
state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
assert torch.equal(back["rows"].full_tensor(), full["rows"])
assert torch.equal(back["bias"].full_tensor(), full["bias"])
assert back["step"] == 5
dist.destroy_process_group()
# Every check above has passed. Leave without the interpreter's teardown: one rank process
# in about thirty of the suite's aborted there ("terminate called without an active
# exception", a C++ thread destroyed while running), which 88 standalone runs did not
# reproduce; whose thread it is remains to be found (see the issue's note).
sys.stdout.flush()
os._exit(0)
"""


def test_two_ranks_save_a_sharded_state_and_one_process_loads_it_whole(
    where: tuple[str, dict[str, Any]],
) -> None:
    url, options = where
    wait_ranks(spawn_ranks(RANK_SCRIPT, 2, url, json.dumps(options)), timeout=180)
    # Loaded at a different world size: one process, plain tensors (DCP reshards).
    torch.manual_seed(0)
    full = {"rows": torch.randn(64, 16), "bias": torch.randn(16)}
    back: dict[str, Any] = {"rows": torch.zeros(64, 16), "bias": torch.zeros(16), "step": 0}
    state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
    assert torch.equal(back["rows"], full["rows"])
    assert torch.equal(back["bias"], full["bias"])
    assert back["step"] == 5


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

    async def write(self, data):
        await real_write(self, data)
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
os._exit(0)  # as in RANK_SCRIPT
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


# -- versions in one process: retention, replacing, damage, hostile metadata -------------------


def small(step: int) -> dict[str, Any]:
    return {"w": torch.full((3, 5), float(step)), "b": torch.arange(4) + step, "step": step}


def load_small(ckpt: Any, step: int | None = None) -> dict[str, Any]:
    target: dict[str, Any] = {"w": torch.zeros(3, 5), "b": torch.zeros(4, dtype=torch.long)}
    target["step"] = 0
    state_dict_loader.load(target, storage_reader=ckpt.dcp_reader(step))
    return target


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_distributed_versions_are_listed_retained_verified_and_deleted(
    where: tuple[str, dict[str, Any]],
) -> None:
    from asyncstore import NotFound
    from asyncstore.torch import Checkpointer

    url, options = where
    with Checkpointer(url, keep_last=2, store_options=options) as ckpt:
        with pytest.raises(NotFound, match="no distributed version"):
            ckpt.dcp_reader()
        for step in (1, 2, 3):
            state_dict_saver.save(small(step), storage_writer=ckpt.dcp_writer(step))
    with Checkpointer(url, keep_last=2, store_options=options) as ckpt:
        versions = ckpt.versions()
        assert [(v.step, v.kind, v.key) for v in versions] == [
            (2, "dcp", "step-000000002.dcp/"),
            (3, "dcp", "step-000000003.dcp/"),
        ]
        assert all(v.state == "committed" and v.size > 0 for v in versions)
        assert load_small(ckpt)["step"] == 3
        back = load_small(ckpt, 2)
        assert torch.equal(back["w"], small(2)["w"])
        assert torch.equal(back["b"], small(2)["b"])
        with pytest.raises(NotFound, match="of step 1"):
            ckpt.dcp_reader(1)  # retention took it
        with pytest.raises(InvalidArgument, match=r"dcp_reader\(3\)"):
            ckpt.load()
        assert ckpt.verify(3).ok
        ckpt.delete(3)
        assert [v.step for v in ckpt.versions()] == [2]
        assert ckpt.stats().deleted == 0  # this one only deleted by hand
    if "://" not in url:
        names = files(Path(url))
        assert names[0] == "step-000000002.dcp/.metadata"
        assert len(names) == 2
        assert names[1].startswith("step-000000002.dcp/__0_")


def _flip_a_byte(path: Path, at: float = 1 / 3) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 1
    path.write_bytes(bytes(data))


def test_dcp_load_falls_back_from_a_damaged_version_to_the_newest_that_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run, compression=None) as ckpt:
        for step in (1, 2, 3):
            state_dict_saver.save(small(step), storage_writer=ckpt.dcp_writer(step))
    (chunked,) = (run / "step-000000003.dcp").glob("__0_*.ckpt")
    _flip_a_byte(chunked)  # a chunk of step 3: found only by reading it
    _flip_a_byte(run / "step-000000002.dcp" / ".metadata", 0.5)  # found before any read
    with Checkpointer(run) as ckpt:
        target: dict[str, Any] = {"w": torch.zeros(3, 5), "b": torch.zeros(4, dtype=torch.long)}
        target["step"] = 0
        with caplog.at_level("WARNING", logger="asyncstore.checkpoint"):
            assert ckpt.dcp_load(target) == 1
        assert torch.equal(target["w"], small(1)["w"])
        assert torch.equal(target["b"], small(1)["b"])
        assert target["step"] == 1
        warned = caplog.text
        assert "step-000000003.dcp" in warned
        assert chunked.name in warned  # what failed, named
        assert "step-000000002.dcp" in warned
        assert [(v.step, v.state) for v in ckpt.versions()] == [
            (1, "committed"),
            (2, "damaged"),
            (3, "damaged"),
        ]
        # The plain reader passes over what is known damaged or whose .metadata fails.
        assert load_small(ckpt)["step"] == 1
        # A step asked for by number loads that one or fails.
        with pytest.raises(IntegrityError, match=r"step 3 .*does not load: rank 0: .*__0_"):
            ckpt.dcp_load(target, 3)
        assert ckpt.dcp_load(target, 1) == 1
        with pytest.raises(NotFound, match="of step 7"):
            ckpt.dcp_load(target, 7)
        with pytest.raises(InvalidArgument, match="step="):
            ckpt.dcp_load(target, -1)
        # A state that does not fit the checkpoint is the caller's error: no fallback.
        with pytest.raises(CheckpointException, match="nope"):
            ckpt.dcp_load({**target, "nope": torch.zeros(2)})
    _flip_a_byte(run / "step-000000001.dcp" / ".metadata", 0.5)
    with Checkpointer(run) as ckpt:
        with pytest.raises(IntegrityError, match=r"no distributed version .* loads") as caught:
            ckpt.dcp_load(target)
        for step in (1, 2, 3):
            assert f"step {step}:" in str(caught.value)
        with pytest.raises(IntegrityError, match="no distributed version"):
            ckpt.dcp_reader()


def test_a_rank_finding_its_shard_damaged_makes_every_rank_load_the_older_version(
    tmp_path: Path,
) -> None:
    url, rows = str(tmp_path / "run"), 64
    run_ranks(2, {"mode": "save", "url": url, "options": {}, "rows": rows, "steps": [1, 2]})
    (theirs,) = (tmp_path / "run" / "step-000000002.dcp").glob("__1_*.ckpt")
    _flip_a_byte(theirs)  # rank 1's row shards: rank 0 reads nothing from this object
    job = {"mode": "fallback", "url": url, "options": {}, "rows": rows, "newest": 1}
    run_ranks(2, job)


def test_saving_a_step_again_keeps_the_old_version_whole_until_the_new_one_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstore.torch import Checkpointer
    from asyncstore.torch import _dcpwriter as plugin

    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        state_dict_saver.save(small(5), storage_writer=ckpt.dcp_writer(5))
    before = files(run)

    async def crash(*args: Any) -> None:
        raise OSError("the coordinator died before its .metadata")

    # The second save writes its rank objects, then fails before the commit.
    with monkeypatch.context() as patched:
        patched.setattr(plugin, "_commit", crash)
        with Checkpointer(run) as ckpt, pytest.raises(CheckpointException):
            state_dict_saver.save(small(50), storage_writer=ckpt.dcp_writer(5))
    assert len(files(run)) == len(before) + 1  # its rank object: never named by .metadata
    with Checkpointer(run) as ckpt:
        assert load_small(ckpt, 5)["step"] == 5  # the old version, whole
        assert ckpt.gc() == 1  # the failed save's object
        assert files(run) == before
        state_dict_saver.save(small(51), storage_writer=ckpt.dcp_writer(5))
        after = files(run)
        assert len(after) == 2
        assert after != before
        assert load_small(ckpt, 5)["step"] == 51


def test_a_distributed_save_replaces_a_single_object_version_and_cleans_up_unfinished_ones(
    tmp_path: Path,
) -> None:
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    # What a killed distributed save of step 4 left, and a file of the user's beside it.
    unfinished = run / "step-000000004.dcp"
    unfinished.mkdir(parents=True)
    (unfinished / "__1_0123456789abcdef.ckpt").write_bytes(b"half a shard")
    (unfinished / "notes.txt").write_text("mine")
    with Checkpointer(run, keep_last=5) as ckpt:
        ckpt.save(small(7), 7).result()
        assert [(v.step, v.kind) for v in ckpt.versions()] == [(7, "checkpoint")]
        state_dict_saver.save(small(7), storage_writer=ckpt.dcp_writer(7))
    with Checkpointer(run) as ckpt:
        assert [(v.step, v.kind) for v in ckpt.versions()] == [(7, "dcp")]
    assert not (run / "step-000000007.ckpt").exists()
    assert files(unfinished) == ["notes.txt"]  # only what a save writes is removed


def test_damaged_or_hostile_metadata_is_refused(tmp_path: Path) -> None:
    import struct

    import xxhash

    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        state_dict_saver.save(small(1), storage_writer=ckpt.dcp_writer(1))
        state_dict_saver.save(small(2), storage_writer=ckpt.dcp_writer(2))
    metadata = run / "step-000000002.dcp" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[-3] ^= 0x40
    metadata.write_bytes(bytes(data))
    with Checkpointer(run) as ckpt:
        report = ckpt.verify(2)
        assert not report.ok
        assert report.error is not None
        assert "does not match its checksum" in report.error
        assert [v.state for v in ckpt.versions()] == ["committed", "damaged"]
        with pytest.raises(CheckpointException) as raised:
            load_small(ckpt, 2)
        ((error, _),) = raised.value.failures.values()
        # DCP reads .metadata on the coordinator and re-raises its error as its own.
        assert "does not match its checksum" in str(error)

    # A crafted .metadata with a valid checksum whose pickle would run a command.
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    body = pickle.dumps(Payload())
    metadata.write_bytes(struct.pack("<8sQ", b"ASYNCDCP", xxhash.xxh3_64_intdigest(body)) + body)
    with Checkpointer(run) as ckpt, pytest.raises(CheckpointException) as raised:
        load_small(ckpt, 2)
    ((error, _),) = raised.value.failures.values()
    assert "names posix.system" in str(error)
    assert "refusing to build it" in str(error)
    assert not marker.exists()


def test_a_damaged_rank_object_fails_verify_and_the_writer_refuses_bad_options(
    tmp_path: Path,
) -> None:
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run, compression=None) as ckpt:
        state_dict_saver.save(small(1), storage_writer=ckpt.dcp_writer(1))
        (rank_object,) = (run / "step-000000001.dcp").glob("__0_*.ckpt")
        data = bytearray(rank_object.read_bytes())
        data[len(data) // 3] ^= 1
        rank_object.write_bytes(bytes(data))
        report = ckpt.verify(1)
        assert not report.ok
        assert report.error is not None
        assert rank_object.name in report.error
        rank_object.unlink()
        with pytest.raises(IntegrityError, match="lost a rank's shards"):
            ckpt.verify(1, raise_on_error=True)
        with pytest.raises(InvalidArgument, match="step="):
            ckpt.dcp_writer(-1)
        with pytest.raises(InvalidArgument, match="thread mode"):
            pickle.dumps(ckpt.dcp_writer(2))  # as AsyncCheckpointerType.PROCESS would
        pickle.loads(pickle.dumps(StorageWriter(str(tmp_path / "z"))))  # a plain one goes
        with pytest.raises(InvalidArgument, match="checkpoint_id="):
            state_dict_saver.save(
                small(2), storage_writer=ckpt.dcp_writer(2), checkpoint_id=str(tmp_path / "x")
            )
    with (
        Checkpointer(run, mirror=tmp_path / "mirror") as ckpt,
        pytest.raises(InvalidArgument, match="mirror"),
    ):
        ckpt.dcp_writer(3)
    with pytest.raises(InvalidArgument, match="compression"):
        StorageWriter(str(tmp_path / "y"), compression="lz4")  # type: ignore[arg-type]


def test_targets_that_cannot_take_the_bytes_directly_are_copied_into(tmp_path: Path) -> None:
    # A non-contiguous target and one of another dtype take the copying path; a
    # contiguous one of the saved dtype is read into directly: all end up equal.
    url = str(tmp_path / "ckpt")
    saved = {"plain": torch.randn(6, 4), "t": torch.randn(4, 6), "wide": torch.randn(5)}
    state_dict_saver.save(saved, storage_writer=StorageWriter(url))
    plain = torch.zeros(6, 4)
    transposed = torch.zeros(6, 4).t()  # (4, 6), not contiguous
    wide = torch.zeros(5, dtype=torch.float64)
    target: dict[str, Any] = {"plain": plain, "t": transposed, "wide": wide}
    state_dict_loader.load(target, storage_reader=StorageReader(url))
    assert target["plain"] is plain
    assert torch.equal(plain, saved["plain"])
    assert torch.equal(transposed, saved["t"])
    assert torch.equal(wide, saved["wide"].double())


# -- what a hostile or unlucky user does -------------------------------------------------------


def test_a_cached_plan_never_writes_over_the_committed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's plan caching reuses an earlier save's plan: the objects must still be new.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from asyncstore.torch import _dcpwriter as plugin

    url = str(tmp_path / "ckpt")
    writer = StorageWriter(url)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    state_dict_saver.save({"w": torch.full((4,), 1.0)}, storage_writer=writer, planner=planner)

    async def crash(*args: Any) -> None:
        raise OSError("killed before its .metadata")

    with monkeypatch.context() as patched:
        patched.setattr(plugin, "_commit", crash)
        with pytest.raises(CheckpointException):
            state_dict_saver.save(
                {"w": torch.full((4,), 2.0)}, storage_writer=writer, planner=planner
            )
    back = {"w": torch.zeros(4)}
    state_dict_loader.load(back, storage_reader=StorageReader(url))
    assert torch.equal(back["w"], torch.full((4,), 1.0))  # the committed save, untouched


def _rank_object(url: str) -> tuple[Path, dict[str, torch.Tensor]]:
    import asyncstore.torch

    (path,) = Path(url).glob("__0_*.ckpt")
    return path, asyncstore.torch.load(path)


def test_a_crafted_value_cannot_run_code_or_read_past_its_bytes(tmp_path: Path) -> None:
    import io as _io

    import asyncstore.torch
    from asyncstore import UnsafeCheckpoint

    url = str(tmp_path / "ckpt")
    state_dict_saver.save({"w": torch.ones(3), "note": {"a": 1}}, storage_writer=StorageWriter(url))
    path, entries = _rank_object(url)
    (entry,) = [k for k, v in entries.items() if v.dtype == torch.uint8]
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    buffer = _io.BytesIO()
    torch.save(Payload(), buffer)
    entries[entry] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    asyncstore.torch.save(entries, path)
    target: dict[str, Any] = {"w": torch.zeros(3), "note": {"a": 0}}
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(target, storage_reader=StorageReader(url, weights_only=True))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, UnsafeCheckpoint)
    assert "weights_only=False" in str(error)
    assert "'note.a'" in str(error)  # the state's key, not the object's entry number
    assert not marker.exists()

    # One byte of storage claiming to be a million: refused, nothing read past it.
    entries[entry] = torch.zeros(1, dtype=torch.uint8).expand(1_000_000)
    asyncstore.torch.save(entries, path)
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load(target, storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "should be a value's bytes" in str(error)

    # A tensor of another dtype than .metadata says: refused, not converted.
    entries[entry] = torch.frombuffer(bytearray(b"x"), dtype=torch.uint8)
    (tensor_entry,) = [k for k, v in entries.items() if v.dtype == torch.float32]
    entries[tensor_entry] = torch.ones(3, dtype=torch.float64)
    asyncstore.torch.save(entries, path)
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load({"w": torch.zeros(3)}, storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "does not hold the tensors" in str(error)
    path.unlink()
    with pytest.raises(CheckpointException) as raised:
        state_dict_loader.load({"w": torch.zeros(3)}, storage_reader=StorageReader(url))
    ((error, _),) = raised.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "lost a rank's shards" in str(error)


def test_a_commit_removes_only_what_the_replaced_checkpoint_named(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    state_dict_saver.save({"w": torch.ones(3)}, storage_writer=StorageWriter(str(url)))
    (first,) = url.glob("__0_*.ckpt")
    # Another save into the same directory, still writing: its object is not ours to take.
    other = url / "__1_00112233445566aa.ckpt"
    other.write_bytes(b"another save's shard, in flight")
    state_dict_saver.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(str(url)))
    assert not first.exists()  # the replaced checkpoint's object went
    assert other.exists()
    assert len(list(url.glob("__0_*.ckpt"))) == 1


def test_a_step_still_being_written_is_not_a_leftover(tmp_path: Path) -> None:
    import gc as _gc

    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        slow = ckpt.dcp_writer(1)  # its save is still writing when step 2 commits
        (run / "step-000000001.dcp").mkdir(parents=True)
        shard = run / "step-000000001.dcp" / "__0_0123456789abcdef.ckpt"
        shard.write_bytes(b"step 1's shard, being written")
        state_dict_saver.save(small(2), storage_writer=ckpt.dcp_writer(2))
        assert shard.exists()
        del slow  # that save gave up: what it wrote is a leftover now
        _gc.collect()
        state_dict_saver.save(small(3), storage_writer=ckpt.dcp_writer(3))
        assert not shard.exists()


def test_a_checkpointer_closed_before_the_commit_still_reports_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    ckpt = Checkpointer(run)
    writer = ckpt.dcp_writer(1)
    ckpt.close()  # too early: the save below has not committed yet
    with caplog.at_level("WARNING", logger="asyncstore.checkpoint"):
        state_dict_saver.save(small(1), storage_writer=writer)  # no error: it is saved
    assert "could not run retention" in caplog.text
    with Checkpointer(run) as again:
        assert load_small(again, 1)["step"] == 1


def test_a_view_is_saved_without_the_storage_around_it(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    big = torch.randn(1000, 1000)  # 4 MB
    state_dict_saver.save({"w": big[5:7]}, storage_writer=StorageWriter(str(url)))
    (rank_object,) = url.glob("__0_*.ckpt")
    assert rank_object.stat().st_size < 100_000
    back = {"w": torch.zeros(2, 1000)}
    state_dict_loader.load(back, storage_reader=StorageReader(str(url)))
    assert torch.equal(back["w"], big[5:7])
    with pytest.raises(InvalidArgument, match="checkpoint_id="):
        StorageWriter("/")


def test_metadata_of_python_3_11_early_enum_pickles_loads_and_getattr_stays_refused(
    tmp_path: Path,
) -> None:
    # Python 3.11.0-3.11.3 pickle an enum member as getattr(cls, name): what Debian 12's
    # python3 (3.11.2) writes into every .metadata. Reproduced here whatever this
    # interpreter's own form is, with a pickler that writes enums that way.
    import enum
    import io

    from torch.distributed.checkpoint.metadata import TensorProperties

    from asyncstore.checkpoint._distributed import MAGIC, decode_metadata
    from asyncstore.torch import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        state_dict_saver.save(small(1), storage_writer=ckpt.dcp_writer(1))
    metadata = decode_metadata((run / "step-000000001.dcp" / ".metadata").read_bytes(), "m")

    def framed(value: Any, swap: Any) -> bytes:
        class EarlyPickler(pickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, enum.Enum) and not isinstance(obj, torch.dtype):
                    return swap(obj)
                return NotImplemented

        out = io.BytesIO()
        EarlyPickler(out, protocol=4).dump(value)
        body = out.getvalue()
        return MAGIC + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body

    early = framed(metadata, lambda member: (getattr, (type(member), member.name)))
    assert b"getattr" in early
    assert decode_metadata(early, "m") == metadata
    for target, name in (
        (None, "__class__"),  # the enum's class, but not one of its members
        (None, "mro"),
        (TensorProperties, "__init__"),  # a class the metadata holds, but no enum
    ):
        crafted = framed(
            metadata, lambda member, t=target, n=name: (getattr, (t or type(member), n))
        )
        with pytest.raises(IntegrityError, match="not a member of a DCP metadata enum"):
            decode_metadata(crafted, "m")
