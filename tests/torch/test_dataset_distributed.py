"""StreamingDataset under a real ``torch.distributed`` process group: two rank processes of a
gloo group, each reading through a DataLoader with two workers, over several epochs and
across a restart in the middle of one, from a local directory and from SeaweedFS.

No rank, world size or environment variable names the shard to the dataset: it must take
both from the initialised process group, in the rank process and in its DataLoader workers
(forked, or spawned, as ``forkserver`` and macOS's default are).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncstore
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from ..ranks import spawn_ranks, wait_ranks

WORLD = 2
WORKERS = 2
SEED = 11

RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from asyncstore.torch import StreamingDataset

cfg = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# From here on only the process group knows the shard: neither this process nor its
# DataLoader workers can read it from the environment.
for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(name, None)
batch = cfg["batch"]
ds = StreamingDataset(
    cfg["url"],
    store_options=cfg["options"],
    cache_dir=cfg["cache_dir"],  # shared by both ranks, as on one node
    shuffle=True,
    seed=cfg["seed"],
    batch_size=batch,
)
loader = DataLoader(
    ds,
    batch_size=batch,
    num_workers=cfg["workers"],
    multiprocessing_context=cfg["context"],
    persistent_workers=True,
)
out = {"rank": rank, "world": world, "len": len(ds), "batches": len(loader)}
epochs, plans, batches = {}, {}, {}

def read(epoch, stop=None):
    ds.set_epoch(epoch)
    keys, count = [], 0
    for batch_of in loader:
        keys += [data.decode() for data in batch_of]  # each object holds its own key
        count += 1
        if count == stop:
            break
    epochs[epoch], plans[epoch], batches[epoch] = keys, ds.plan(epoch), count

if cfg["phase"] == "first":
    read(0)
    read(1)
    read(2, stop=cfg["stop"])  # the job stops here, mid-epoch
    out["state"] = ds.state_dict(consumed=cfg["stop"] * batch)
else:
    ds.load_state_dict(cfg["states"][rank])
    read(2)  # a training loop sets the epoch it resumes: the position must hold
    read(3)
out.update(epochs=epochs, plans=plans, batches_read=batches)
with open(os.path.join(cfg["out"], f"{cfg['phase']}-{rank}.json"), "w") as f:
    json.dump(out, f)
del loader  # stops the persistent workers
dist.destroy_process_group()
# Every check has run. Leave without the interpreter's teardown, as tests/torch/test_dcp.py's
# rank script does (a rank process there sometimes aborted in it).
sys.stdout.flush()
os._exit(0)
"""


def run_ranks(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run RANK_SCRIPT in WORLD processes of a new gloo group; each rank's JSON report."""
    wait_ranks(spawn_ranks(RANK_SCRIPT, WORLD, json.dumps(cfg)), timeout=90)
    reports = []
    for rank in range(WORLD):
        report = json.loads((Path(cfg["out"]) / f"{cfg['phase']}-{rank}.json").read_text())
        assert (report["rank"], report["world"]) == (rank, WORLD)
        reports.append(report)
    return reports


def check_epoch(streams: list[list[str]], everything: list[str]) -> None:
    """Each rank's stream of one epoch: equal lengths, and every sample once across them.

    When the count is not a multiple of the world size, the shorter ranks are padded with
    the first samples of the epoch's order, which are the first ranks' first samples.
    """
    per_rank = -(-len(everything) // WORLD)
    assert [len(stream) for stream in streams] == [per_rank] * WORLD
    pad = per_rank * WORLD - len(everything)
    expected = collections.Counter(everything) + collections.Counter(
        streams[rank][0] for rank in range(pad)
    )
    assert collections.Counter(key for stream in streams for key in stream) == expected


def check_run(
    cfg: dict[str, Any], everything: list[str], stop: int, *, restart: bool = True
) -> None:
    batch = cfg["batch"]
    per_rank = -(-len(everything) // WORLD)
    first = run_ranks({**cfg, "phase": "first", "stop": stop})
    for report in first:
        assert report["len"] == per_rank  # len(ds): equal on every rank, as DDP needs
        assert report["batches"] == -(-per_rank // batch)  # len(loader)
        for epoch in ("0", "1"):
            assert report["batches_read"][epoch] == report["batches"]
            assert report["epochs"][epoch] == report["plans"][epoch]  # the plan's order
        assert report["state"]["consumed"] == stop * batch
    for epoch in ("0", "1"):
        check_epoch([report["epochs"][epoch] for report in first], everything)
    for report in first:
        assert report["epochs"]["0"] != report["epochs"]["1"]  # shuffled anew each epoch
    if not restart:
        return
    # The restart: new processes, a new process group, each rank's own saved state.
    states = [report["state"] for report in first]
    second = run_ranks({**cfg, "phase": "second", "states": states})
    whole = []
    for before, after in zip(first, second, strict=True):
        read = before["epochs"]["2"] + after["epochs"]["2"]
        assert len(before["epochs"]["2"]) == stop * batch
        assert read == after["plans"]["2"]  # nothing repeated, nothing skipped, in order
        whole.append(read)
        assert after["epochs"]["3"] == after["plans"]["3"]
        assert after["epochs"]["3"] != read  # the next epoch starts afresh, reshuffled
    check_epoch(whole, everything)
    check_epoch([report["epochs"]["3"] for report in second], everything)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_two_ranks_read_every_sample_once_per_epoch_and_resume(
    tmp_path: Path, context: str
) -> None:
    root = tmp_path / "data"
    everything = [f"{i // 100}/{i:04d}.bin" for i in range(300)]
    for key in everything:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(key.encode())
    cfg = {
        "url": str(root),
        "options": {},
        "cache_dir": str(tmp_path / "cache"),
        "seed": SEED,
        "batch": 8,
        "workers": WORKERS,
        "context": context,
        "out": str(tmp_path),
    }
    # 150 samples per rank: 18 batches of 8 and one of 6; stop after 7, an odd number, so
    # the resumed epoch starts on the other worker's turn. Spawned workers import torch
    # anew (seconds each on a small machine): they read the epochs, and the restart is
    # checked with forked ones.
    check_run(cfg, everything, stop=7, restart=context == "fork")


def test_two_ranks_over_seaweedfs_with_padding(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/{unique('ddp')}"
    options = s3_options(seaweedfs)
    everything = [f"train/{i:04d}.bin" for i in range(61)]  # odd: one rank is padded

    async def upload() -> None:
        async with asyncstore.open_store(url, **options) as store:
            for key in everything:
                await store.put(key, key.encode())

    anyio.run(upload)
    cfg = {
        "url": url,
        "options": options,
        "cache_dir": str(tmp_path / "cache"),
        "seed": SEED,
        "batch": 4,
        "workers": WORKERS,
        "context": "fork",
        "out": str(tmp_path),
    }
    check_run(cfg, everything, stop=3)


# -- another number of ranks -----------------------------------------------------------------

RESHARD_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader
from asyncstore.torch import StreamingDataset

cfg = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(name, None)
batch = cfg["batch"]
ds = StreamingDataset(cfg["url"], cache_dir=cfg["cache_dir"], shuffle=True, seed=cfg["seed"],
                      batch_size=batch)
loader = DataLoader(ds, batch_size=batch, num_workers=2, multiprocessing_context="fork",
                    persistent_workers=True)
out = {"rank": rank, "world": world}

def read(stop=None):
    keys = []
    for step, got in enumerate(loader):
        keys += [data.decode() for data in got]
        if step + 1 == stop:
            break
    return keys

if cfg["phase"] == "first":
    ds.set_epoch(1)
    out["keys"] = read(cfg["stop"])
    out["state"] = ds.state_dict(consumed=cfg["stop"] * batch)
    # One key for the whole job: DCP keeps one copy of a value every rank saves under it.
    dcp.save({"data": out["state"]}, checkpoint_id=cfg["ckpt"])
else:
    resumed = {"data": ds.state_dict()}  # the template: any rank of any world asks for it
    dcp.load(resumed, checkpoint_id=cfg["ckpt"])
    ds.load_state_dict(resumed["data"])
    out["loaded"] = resumed["data"]
    ds.set_epoch(resumed["data"]["epoch"])  # the usual loop: the position holds
    out["plan"], out["keys"] = ds.plan(), read()
    ds.set_epoch(2)
    out["next_plan"], out["next"] = ds.plan(), read()
with open(os.path.join(cfg["out"], f"{cfg['phase']}-{world}-{rank}.json"), "w") as f:
    json.dump(out, f)
del loader
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def run_world(cfg: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Run RESHARD_SCRIPT in ``world`` processes of a new gloo group; their reports."""
    wait_ranks(spawn_ranks(RESHARD_SCRIPT, world, json.dumps(cfg)), timeout=120)
    out = Path(cfg["out"])
    return [
        json.loads((out / f"{cfg['phase']}-{world}-{rank}.json").read_text())
        for rank in range(world)
    ]


def test_two_ranks_save_one_state_and_one_or_three_ranks_resume_it(tmp_path: Path) -> None:
    root = tmp_path / "data"
    everything = [f"train/{i:04d}.bin" for i in range(61)]  # prime: every split is padded
    for key in everything:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(key.encode())
    batch, stop = 4, 3
    cfg = {
        "url": str(root),
        "cache_dir": str(tmp_path / "cache"),
        "seed": SEED,
        "batch": batch,
        "stop": stop,
        "ckpt": str(tmp_path / "ckpt"),
        "out": str(tmp_path),
    }
    first = run_world({**cfg, "phase": "first"}, WORLD)
    state = first[0]["state"]
    assert all(report["state"] == state for report in first)  # the same on every rank
    assert (state["start"], state["consumed"], state["world_size"]) == (0, stop * batch, 2)
    before = [key for report in first for key in report["keys"]]
    assert len(before) == len(set(before)) == WORLD * stop * batch
    for world in (1, 3):
        second = run_world({**cfg, "phase": "second"}, world)
        rest = len(everything) - len(before)
        for report in second:
            assert report["loaded"] == state  # every rank of this world loaded the one copy
            assert report["keys"] == report["plan"]  # the new stream, in order
            assert len(report["keys"]) == -(-rest // world)  # equal lengths, for DDP
            assert report["next"] == report["next_plan"]
        after = [key for report in second for key in report["keys"]]
        # Every sample once across both worlds, but the padding of the last split: the
        # epoch's first samples, which the first world read first (rank 0's, then 1's).
        pad = len(before) + len(after) - len(everything)
        assert pad == (-rest) % world
        padded = [first[i % WORLD]["keys"][i // WORLD] for i in range(pad)]
        assert collections.Counter(before + after) == collections.Counter(
            everything
        ) + collections.Counter(padded)
        check_epoch_at(world, [report["next"] for report in second], everything)


def check_epoch_at(world: int, streams: list[list[str]], everything: list[str]) -> None:
    """An epoch not resumed at ``world`` ranks: equal streams, every sample once but the
    padding (the first ranks' first samples)."""
    per_rank = -(-len(everything) // world)
    assert [len(stream) for stream in streams] == [per_rank] * world
    padded = [streams[rank][0] for rank in range(per_rank * world - len(everything))]
    assert collections.Counter(key for s in streams for key in s) == collections.Counter(
        everything
    ) + collections.Counter(padded)
