"""DCP saves beside DDP training, as docs/distributed.md writes them: the checkpointer's own
gloo group keeps ``async_save``'s collectives apart from DDP's all-reduces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader

import asyncstore.torch

from ..ranks import spawn_ranks, wait_ranks

# The check loads in this one process, as DCP allows (and warns about).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DDP_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import asyncstore.torch as at

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
model = DDP(net)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(rank)
with at.Checkpointer(run, keep_last=2) as ckpt:
    pending = None
    for step in range(1, 41):
        loss = model(torch.randn(64, 256, generator=data)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces on the default group meanwhile
        optimizer.step()
        if step % 5 == 0:
            if pending is not None:
                pending.result(timeout=120)
            pending = ckpt.dcp_async_save({"model": net.state_dict(), "step": step}, step)
    pending.result(timeout=120)
if rank == 0:
    torch.save(net.state_dict(), out)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as the other rank scripts
"""


def test_async_saves_beside_ddp_training_do_not_hang_and_save_the_model(tmp_path: Path) -> None:
    # On the default group the same loop hangs within its first saves (DCP's background
    # collectives and DDP's all-reduce interleave on gloo); 90 s would not end it.
    run, out = tmp_path / "run", tmp_path / "final.pt"
    wait_ranks(spawn_ranks(DDP_SCRIPT, 2, str(run), str(out)), timeout=120)
    final = torch.load(out)
    with asyncstore.torch.Checkpointer(run) as ckpt:
        assert [(v.step, v.kind) for v in ckpt.versions()] == [(35, "dcp"), (40, "dcp")]
        state: dict[str, Any] = {
            "model": {k: torch.zeros_like(v) for k, v in final.items()},
            "step": 0,
        }
        state_dict_loader.load(state, storage_reader=ckpt.dcp_reader())
    assert state["step"] == 40
    for name, value in final.items():
        assert torch.equal(state["model"][name], value), name


def test_in_one_process_dcp_save_needs_no_group(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 2)
    with asyncstore.torch.Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.dcp_group() is None  # no process group: DCP runs without collectives
        ckpt.dcp_save({"model": model.state_dict(), "step": 1}, 1)
        ckpt.dcp_async_save({"model": model.state_dict(), "step": 2}, 2).result(timeout=60)
        back: dict[str, Any] = {"model": torch.nn.Linear(8, 2).state_dict(), "step": 0}
        assert ckpt.dcp_load(back) == 2
    assert back["step"] == 2
    for name, value in model.state_dict().items():
        assert torch.equal(back["model"][name], value), name
