"""Rank processes of a ``torch.distributed`` gloo group on loopback, for the distributed
tests: each rank a fresh interpreter running a script, as ``torchrun`` would start it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap


def free_port() -> int:
    """A loopback TCP port free right now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(script: str, world: int, *args: str) -> list[subprocess.Popen[str]]:
    """Start ``world`` processes running ``script`` (dedented) with ``args`` as ``sys.argv[1:]``,
    each told its rank, the world size and a fresh rendezvous address through the
    environment variables ``dist.init_process_group`` reads. Their output is piped, stderr
    into stdout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def wait_ranks(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each rank's output, once every rank has exited with status 0. Fails naming each rank
    that did not, with its output; a rank still running after ``timeout`` seconds is killed
    (and fails)."""
    outputs = []
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += f"\n(killed: still running after {timeout} s)"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [
        f"rank {rank} of {len(procs)} exited {proc.returncode}:\n{out}"
        for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True))
        if proc.returncode != 0
    ]
    assert not failed, "\n".join(failed)
    return outputs


# Ranks saving one state of sharded, replicated and plain values twice: as the version
# ``step`` of the run (asyncstore), and with DCP's own FileSystemWriter into ``plain``, which
# torch's dcp_to_torch_save reads. Arguments: run, store options (JSON), plain, step.
SHARDED_SAVE_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter, state_dict_saver
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import asyncstore.torch

run, options, plain, step = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
rows, bias = torch.randn(64, 16, generator=g), torch.randn(16, generator=g)
moment = torch.randn(64, 16, generator=g)
state = {
    "model": {
        "rows": distribute_tensor(rows, mesh, [Shard(0)]),  # half on each rank
        "bias": distribute_tensor(bias, mesh, [Replicate()]),  # saved once
    },
    "optim": {
        "state": {"rows": {"exp_avg": distribute_tensor(moment, mesh, [Shard(0)]),
                           "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["rows", "bias"]}],
    },
    "step": step,
    "data": {f"rank{rank}": {"consumed": 1000 + rank}},
}
with asyncstore.torch.Checkpointer(run, store_options=options) as ckpt:
    state_dict_saver.save(state, storage_writer=ckpt.dcp_writer(step))
state_dict_saver.save(state, storage_writer=FileSystemWriter(plain))
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as tests/torch/test_dcp.py's rank scripts do
"""
