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
