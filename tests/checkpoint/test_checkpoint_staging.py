"""The staging pool and the save pipeline: slabs reused under a budget, chunks placed for
O_DIRECT, encoding priority, and every slab back in the pool however a save ends."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import InvalidArgument
from asyncstore.checkpoint import read_manifest, staging_pool

from .helpers import assert_same_storage_layout

pytestmark = pytest.mark.anyio

MiB = 1 << 20


class FailingFile(io.RawIOBase):
    """A file whose writes fail after a few, as a full disk does."""

    def __init__(self, good_writes: int) -> None:
        self.writes = 0
        self.good_writes = good_writes

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes > self.good_writes:
            raise OSError("No space left on device")
        return len(memoryview(data))


async def test_second_save_allocates_nothing_and_small_pools_stream(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(100_000) for i in range(8)}  # 3.2 MB
    first = await (
        await asyncstore.save(state, tmp_path / "1.ckpt", chunk_bytes=256 * 1024, staging_bytes=MiB)
    )
    pool = staging_pool(256 * 1024)
    allocated = pool.allocated
    assert 0 < pool.allocated_bytes <= MiB  # the budget held while 3.2 MB streamed through
    await (
        await asyncstore.save(state, tmp_path / "2.ckpt", chunk_bytes=256 * 1024, staging_bytes=MiB)
    )
    assert pool.allocated == allocated
    assert first.raw_bytes > 3 * MiB
    assert_same_storage_layout(state, await asyncstore.load(tmp_path / "2.ckpt"))


def test_staging_is_kept_across_event_loops(tmp_path: Path) -> None:
    # Scripts often run each save in its own asyncio.run(): the pool outlives the loop.
    state = {f"w{i}": torch.randn(50_000) for i in range(4)}
    chunk = 128 * 1024

    async def save_once(name: str) -> None:
        await (await asyncstore.save(state, tmp_path / name, chunk_bytes=chunk))

    asyncio.run(save_once("a.ckpt"))
    allocated = staging_pool(chunk).allocated
    asyncio.run(save_once("b.ckpt"))
    assert staging_pool(chunk).allocated == allocated > 0


async def test_reserve_allocates_ahead_of_the_first_save(tmp_path: Path) -> None:
    from asyncstore.checkpoint import staging_pool

    chunk = (1 << 20) + 8192
    pool = staging_pool(chunk)
    pool.trim()
    pool.set_budget(3 * chunk)
    pool.reserve(2 * chunk + 1)  # rounds up to whole slabs, within the budget
    assert pool.allocated == 3
    pool.reserve(100 * chunk)  # never beyond the budget
    assert pool.allocated == 3
    state = {"w": torch.randn(3 * chunk // 4 - 1000)}
    await (
        await asyncstore.save(
            state, tmp_path / "r.ckpt", chunk_bytes=chunk, staging_bytes=3 * chunk
        )
    )
    assert pool.allocated == 3  # the save found its slabs ready
    with pytest.raises(InvalidArgument, match="nbytes=-1"):
        pool.reserve(-1)
    pool.trim()


async def test_storages_are_cut_to_fill_each_slab(tmp_path: Path) -> None:
    # Six 768 KiB tensors in slabs of about 1 MiB: cutting a storage where a slab ends
    # fills five slabs instead of taking one each (a quarter of the staging memory saved).
    from asyncstore.checkpoint import staging_pool

    chunk = (1 << 20) + 12288
    pool = staging_pool(chunk)
    pool.trim()
    state = {f"t{i}": torch.randn(196_608) for i in range(6)}
    await (await asyncstore.save(state, tmp_path / "cut.ckpt", chunk_bytes=chunk, compression=None))
    assert pool.allocated == -(-6 * 196_608 * 4 // chunk) == 5
    manifest = await read_manifest(tmp_path / "cut.ckpt")
    sizes = [[c.raw for c in s.chunks] for s in manifest.storages]
    assert any(len(s) == 2 for s in sizes)  # some storages span two slabs
    assert all(sum(s) == 196_608 * 4 for s in sizes)
    assert_same_storage_layout(state, await asyncstore.load(tmp_path / "cut.ckpt"))
    pool.trim()


async def test_slabs_without_room_to_spare_still_hold_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pinned slabs are exactly chunk_bytes long (CUDA's allocator would double a larger
    # request), so a chunk placed at its file offset modulo 4096 may have to end early.
    # Plain memory of exactly that size stands in for pinned memory here.
    import mmap

    from asyncstore.checkpoint import StagingPool

    def tight(self: StagingPool) -> torch.Tensor:
        return torch.frombuffer(mmap.mmap(-1, self.slab_bytes), dtype=torch.uint8)

    monkeypatch.setattr(StagingPool, "_allocate", tight)
    for chunk in (4096, 12288, 65536 + 4096):
        pool = staging_pool(chunk)
        pool.trim()
        gen = torch.Generator().manual_seed(chunk)
        state = {
            f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate((1, 3000, 9001, 40000))
        }
        path = tmp_path / f"tight-{chunk}.ckpt"
        await (await asyncstore.save(state, path, chunk_bytes=chunk, compression=None))
        assert_same_storage_layout(state, await asyncstore.load(path))
        manifest = await read_manifest(path)
        assert all(c.raw <= chunk for s in manifest.storages for c in s.chunks)
        pool.trim()


def test_giving_a_slab_back_survives_a_closed_waiting_loop() -> None:
    from asyncstore.checkpoint import StagingPool

    pool = StagingPool(4096, pinned=False)
    pool.set_budget(4096)
    slab = asyncio.run(pool.acquire())  # the whole budget, in use
    loop = asyncio.new_event_loop()
    waiting = loop.create_task(pool.acquire())
    loop.run_until_complete(asyncio.sleep(0.01))  # it now waits for a slab
    loop.close()  # closed without cancelling it
    pool.release(slab)  # must not raise into the save giving it back
    assert len(pool._free) == 1
    assert not waiting.done()
    waiting._log_destroy_pending = False  # type: ignore[attr-defined]  # abandoned on purpose


async def test_local_saves_go_around_the_page_cache(tmp_path: Path) -> None:
    # Slabs hold each chunk at its file offset modulo 4096, so an uncompressed save to a
    # local file goes to the device straight from staging memory, bar a few partial blocks.
    state = {f"w{i}": torch.randn(1000 + 37 * i) for i in range(40)}
    state["big"] = torch.randn(3 << 20)
    handle = await asyncstore.save(
        state, tmp_path / "a.ckpt", compression=None, chunk_bytes=1 << 20
    )
    result = await handle
    assert result.direct_bytes >= result.stored_bytes - 16 * 4096
    loaded = await asyncstore.load(tmp_path / "a.ckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("priority", ["low", "normal"])
async def test_encoding_runs_at_the_priority_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, priority: str
) -> None:
    # Checksums and compression run on threads a training step's threads always win
    # against, unless the caller asks otherwise; the snapshot runs at normal priority.
    from asyncstore.checkpoint._pipeline import SaveJob
    from asyncstore.checkpoint._staging import Copier

    seen: dict[str, set[int]] = {"encode": set(), "copy": set()}

    def own() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    encode, copy = SaveJob._encode_sync, Copier._copy

    def spying_encode(self: Any, segment: Any) -> Any:
        seen["encode"].add(own())
        return encode(self, segment)

    def spying_copy(segment: Any) -> None:
        seen["copy"].add(own())
        copy(segment)

    monkeypatch.setattr(SaveJob, "_encode_sync", spying_encode)
    monkeypatch.setattr(Copier, "_copy", staticmethod(spying_copy))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    state = {"w": torch.randn(1 << 16)}
    await (await asyncstore.save(state, tmp_path / "p.ckpt", priority=priority))  # type: ignore[arg-type]
    assert seen["encode"] == ({19} if priority == "low" else {base})
    assert seen["copy"] == {base}
    with pytest.raises(InvalidArgument, match="priority='urgent'"):
        await asyncstore.save(state, tmp_path / "p.ckpt", priority="urgent")  # type: ignore[arg-type]


async def test_failed_saves_give_their_staging_back() -> None:
    # Writes failing while the snapshot still needs slabs: every slab must come back, or
    # later saves with the same pool would wait for ever.
    state = {f"t{i}": torch.randn(1024) for i in range(64)}  # 64 x 4 KiB, 2 slabs of budget
    options: dict[str, Any] = {"chunk_bytes": 4096, "staging_bytes": 8192, "compression": None}

    async def save(target: Any) -> None:
        await (await asyncstore.save(state, target, **options))

    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            await asyncio.wait_for(save(FailingFile(3)), 30)
    pool = staging_pool(4096)
    assert len(pool._free) == pool.allocated
    target = io.BytesIO()
    await asyncio.wait_for(save(target), 30)
    target.seek(0)
    assert_same_storage_layout(state, await asyncstore.load(target))


async def test_a_writer_failing_during_a_short_snapshot_gives_staging_back() -> None:
    # The first write fails (a full disk) while a state of half a slab is being copied: the
    # snapshot then ends without asking for another slab, and must give its slab back, or
    # the next save with this pool waits for ever.
    chunk = (1 << 20) + 20480
    state = {"w": torch.randn(chunk // 8)}
    options: dict[str, Any] = {"chunk_bytes": chunk, "staging_bytes": 2 * chunk}
    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            await asyncio.wait_for(
                (await asyncstore.save(state, FailingFile(0), compression=None, **options)).wait(),
                30,
            )
    pool = staging_pool(chunk)
    assert len(pool._free) == pool.allocated
    target = io.BytesIO()
    await asyncio.wait_for((await asyncstore.save(state, target, **options)).wait(), 30)
    target.seek(0)
    assert_same_storage_layout(state, await asyncstore.load(target))
    pool.trim()


async def test_a_failed_snapshot_copy_fails_the_save_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy into staging failing (a tensor freed under us, a device error) fails the call
    # itself; every slab comes back, no temp file stays, the previous checkpoint is intact.
    from asyncstore.checkpoint._staging import Copier

    chunk = (1 << 16) + 4096
    state = {f"t{i}": torch.randn(10_000) for i in range(40)}  # several slabs
    target = tmp_path / "c.ckpt"
    await (await asyncstore.save(state, target, chunk_bytes=chunk, compression=None))
    copy = Copier._copy
    calls = 0

    def failing_copy(segment: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("copy failed")
        copy(segment)

    monkeypatch.setattr(Copier, "_copy", staticmethod(failing_copy))
    changed = {k: v + 1 for k, v in state.items()}
    with pytest.raises(RuntimeError, match="copy failed"):
        await asyncstore.save(changed, target, chunk_bytes=chunk, compression=None)
    pool = staging_pool(chunk)
    assert pool.allocated > 0
    assert len(pool._free) == pool.allocated
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]
    monkeypatch.undo()
    assert_same_storage_layout(state, await asyncstore.load(target))
    pool.trim()


async def test_saves_cancelled_at_random_moments_give_every_slab_back(tmp_path: Path) -> None:
    # Cancellation can land anywhere in a save: while it waits for a slab (one may arrive
    # in that very moment), while it copies, while it writes. Afterwards every slab is back
    # in the pool, no temp file stays, and the next save works.
    chunk = (1 << 20) + 24576
    state = {f"t{i}": torch.randn(150_000) for i in range(24)}
    pool = staging_pool(chunk)
    rng = random.Random(0)
    for trial in range(20):
        staging = chunk * rng.choice([2, 4, 64])
        task = asyncio.ensure_future(
            asyncstore.save(
                state,
                tmp_path / f"x{trial % 2}.ckpt",
                chunk_bytes=chunk,
                staging_bytes=staging,
                compression=rng.choice([None, "auto"]),
            )
        )
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        try:
            handle = await asyncio.wait_for(asyncio.shield(task), 30)
            if rng.random() < 0.5:
                handle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(handle.wait(), 30)
        except asyncio.CancelledError:
            pass
        assert pool.allocated == len(pool._free), f"trial {trial}"
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith(".ckpt")]
    options: dict[str, Any] = {"chunk_bytes": chunk, "staging_bytes": 4 * chunk}
    await asyncio.wait_for(
        (await asyncstore.save(state, tmp_path / "final.ckpt", **options)).wait(), 30
    )
    assert_same_storage_layout(state, await asyncstore.load(tmp_path / "final.ckpt"))
    pool.trim()


async def test_a_save_cancelled_as_its_snapshot_ends_is_abandoned_and_releases_its_slabs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last moment a cancellation can reach the call: the snapshot is taken and the
    # writer holds slabs, but the call has not returned the handle yet. Nobody holds a
    # handle then, so the save must stop and give its slabs back before the call ends.
    from asyncstore.checkpoint import _pipeline

    ending, cancelled = asyncio.Event(), asyncio.Event()
    real_end, real_append = _pipeline.SaveJob._end, _pipeline._Layout.append_segment

    async def slow_end(self: Any, part: str, error: BaseException | None) -> None:
        if part == "snapshot" and error is None:
            ending.set()
            await cancelled.wait()
        await real_end(self, part, error)

    async def slow_append(self: Any, segment: Any, encoded: Any, loan: Any) -> None:
        await cancelled.wait()
        await asyncio.sleep(1)  # the call's cancellation lands meanwhile
        await real_append(self, segment, encoded, loan)

    monkeypatch.setattr(_pipeline.SaveJob, "_end", slow_end)
    monkeypatch.setattr(_pipeline._Layout, "append_segment", slow_append)
    chunk = 1 << 20
    state = {f"t{i}": torch.randn(300_000) for i in range(8)}
    pool = staging_pool(chunk)
    target = tmp_path / "c.ckpt"
    task = asyncio.ensure_future(
        asyncstore.save(state, target, chunk_bytes=chunk, staging_bytes=64 * chunk)
    )
    await asyncio.wait_for(ending.wait(), 30)
    task.cancel()
    cancelled.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.allocated > 0
    assert len(pool._free) == pool.allocated
    assert not list(tmp_path.iterdir())  # nothing committed, no temp file left
    monkeypatch.undo()
    await asyncio.wait_for((await asyncstore.save(state, target, chunk_bytes=chunk)).wait(), 30)
    assert_same_storage_layout(state, await asyncstore.load(target))
    pool.trim()
