"""A DDP training job that streams its data and checkpoints without stopping, as
docs/distributed.md writes it: run it with torchrun, kill it, run it again, and it goes on
exactly where its newest checkpoint left it.

    torchrun --standalone --nproc-per-node=2 examples/train_ddp.py --checkpoints /tmp/run1

On GPUs, ``--device cuda`` trains on each rank's GPU (``LOCAL_RANK``) over NCCL, with pinned
batches copied in the background.

Every rank runs this script. The data (a synthetic regression set, made on first use) is
read through a StreamingDataset with DataLoader workers; the model is a small MLP under DDP
with AdamW; every ``--save-every`` steps the whole training state (model, every moment of
the optimizer, the dataset's position) is saved in the background by
``Checkpointer.save_training_state``, on a process group of the checkpointer's own, while
training goes on. On start, ``load_training_state`` resumes from the newest checkpoint
that loads whole, on every rank.

With ``torchrun --max-restarts=N``, a rank that dies (``--kill-at STEP`` kills the last rank
there, in the first attempt only, to try it) makes torchrun restart every rank, which resume.
Rank 0 prints ``step <n> loss <value>`` for every step: the losses after a resume are those
of a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import asyncstore.torch
from asyncstore.torch import StreamingDataset

FEATURES = 32


def decode(key: str, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample: FEATURES inputs and a target, stored as float32 bytes."""
    values = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return values[:FEATURES], values[FEATURES:]


def make_data(path: Path, samples: int) -> None:
    """A synthetic regression set: one small file per sample (made once, by rank 0)."""
    if path.exists():
        return
    scratch = path.with_name(path.name + ".partial")
    scratch.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1234)
    weights = torch.randn(FEATURES, 1, generator=generator)
    for i in range(samples):
        x = torch.randn(FEATURES, generator=generator)
        y = torch.tanh(x @ weights) + 0.01 * torch.randn(1, generator=generator)
        (scratch / f"{i:06d}.bin").write_bytes(torch.cat([x, y]).numpy().tobytes())
    scratch.rename(path)  # complete or absent, if this rank dies while making it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", required=True, help="the checkpoints' URL or directory")
    parser.add_argument(
        "--data", default=None, help="the samples' directory (default: beside --checkpoints)"
    )
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=None, help="the last rank dies here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(args.device, torch.cuda.current_device() if cuda else None)
    data = Path(args.data or f"{args.checkpoints.rstrip('/')}-data")
    if rank == 0:
        make_data(data, args.samples)
    dist.barrier()

    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(device)
    model = DistributedDataParallel(net)  # net: the model, on `device`
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = args.batch_size
    ds = StreamingDataset(data, shuffle=True, seed=0, batch_size=batch, decode=decode)
    loader = DataLoader(
        ds, batch_size=batch, num_workers=args.workers, persistent_workers=True, pin_memory=cuda
    )

    with asyncstore.torch.Checkpointer(args.checkpoints, keep_last=3) as ckpt:
        # The dataset's position is the whole job's (every rank steps together), so it is
        # saved once, under a key every rank shares.
        extra = {"epoch": 0, "data": ds.state_dict(consumed=0)}
        step = ckpt.load_training_state(model, optimizer, extra=extra) or 0
        start_epoch, consumed = 0, 0
        if step:
            ds.load_state_dict(extra["data"])  # the next iteration goes on after it
            start_epoch, consumed = extra["epoch"], ds.state_dict()["consumed"]
            if rank == 0:
                print(f"resumed from step {step}", flush=True)
        for epoch in range(start_epoch, args.epochs):
            if consumed == 0:
                ds.set_epoch(epoch)  # a resumed epoch is current already, at its position
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # DDP all-reduces the gradients on the default group
                optimizer.step()
                step += 1
                consumed += len(x)
                if rank == 0:
                    print(f"step {step} loss {loss.item()!r}", flush=True)
                if step % args.save_every == 0:
                    # Returns once the state is copied; the previous save is waited for.
                    position = {"epoch": epoch, "data": ds.state_dict(consumed=consumed)}
                    ckpt.save_training_state(step, model, optimizer, extra=position)
                if (
                    step == args.kill_at
                    and rank == dist.get_world_size() - 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                ):
                    os.kill(os.getpid(), signal.SIGKILL)  # a lost node, mid-save
            consumed = 0
    # Leaving the with block waited for the last save.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
