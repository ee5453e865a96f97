"""The epoch plan runs on the calling thread: it neither uses torch's intra-op pool nor
leaves it at another size, and it is the same order as before (when torch computed it)."""

from __future__ import annotations

import array
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import xxhash

from asyncstore.torch import StreamingDataset
from asyncstore.torch._datastate import stream_slices
from asyncstore.torch._order import EpochOrder


def test_the_order_of_an_epoch_is_the_one_states_were_saved_with() -> None:
    # Saved positions count in this order: any change to the arithmetic would resume a
    # saved epoch at other samples. Values taken from the release that introduced it.
    order = EpochOrder(1_000_003, seed=12345, epoch=7, shuffle=True, rank=1, world=3)
    indices = order.rank_indices(0, order.per_rank).tolist()
    assert indices[:8] == [182298, 146446, 938035, 194039, 101814, 627213, 505975, 146939]
    assert sum(indices) == 166413314940
    assert xxhash.xxh3_64_hexdigest(array.array("q", indices).tobytes()) == "15faf787bc583112"
    assert [i for part in order.slices() for i in part] == indices


def test_planning_starts_none_of_torchs_pool_threads() -> None:
    # A fresh process whose pool would have four threads: torch starts them at the first
    # operation that runs on it, so the process's thread count tells whether one did.
    code = textwrap.dedent(
        """
        import os, torch
        from asyncstore.torch._order import EpochOrder
        from asyncstore.torch._datastate import stream_slices
        torch.set_num_threads(4)
        before = len(os.listdir("/proc/self/task"))
        order = EpochOrder(1_500_000, seed=1, epoch=2, shuffle=True, rank=1, world=2)
        assert sum(map(len, order.slices(batch=8, worker=1, workers=2))) > 0
        assert len(order.rank_indices(0, order.per_rank)) == order.per_rank
        assert sum(map(len, stream_slices(order, 1000, 64, 8, 0, 2))) > 0
        print(before, len(os.listdir("/proc/self/task")), torch.get_num_threads())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    before, after, threads = map(int, out.split())
    assert after == before
    assert threads == 4


def test_planning_gives_the_pool_back_at_its_size(tmp_path: Path) -> None:
    default = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        order = EpochOrder(300_000, seed=0, epoch=0, shuffle=True, rank=0, world=1)
        first = next(order.slices())
        # Between two slices the consumer's own code runs at the pool's size.
        assert torch.get_num_threads() == 3
        assert len(first) > 0
        assert len(list(stream_slices(order, 5, 0, 1, 0, 1))) > 0
        assert torch.get_num_threads() == 3
        # The dataset plans on its background thread and here: neither changes this
        # thread's pool.
        for i in range(50):
            (tmp_path / "src" / f"{i:03d}").parent.mkdir(exist_ok=True)
            (tmp_path / "src" / f"{i:03d}").write_bytes(b"x" * i)
        ds: StreamingDataset[bytes] = StreamingDataset(tmp_path / "src", shuffle=True)
        assert sorted(map(len, ds)) == list(range(50))
        assert len(ds.plan()) == 50
        assert torch.get_num_threads() == 3
        ds.close()
    finally:
        torch.set_num_threads(default)
