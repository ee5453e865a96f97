"""Leases: a pack or write another process's save or upload is busy with is never
collected; a writer that is provably gone loses its claim, locally and on S3."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import asyncstore
from asyncstore.checkpoint import Checkpointer, _target
from asyncstore.checkpoint._leases import LEASES, Lease, LeaseHolder, live_keys
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import assert_tidy, state_of

pytestmark = pytest.mark.anyio


def other_machine(renewed: float, keys: list[str]) -> bytes:
    return msgspec.msgpack.encode(Lease("elsewhere", "boot-x", 1, "1", renewed, 60.0, keys))


async def test_another_checkpointers_save_in_flight_keeps_its_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two checkpointers on one run (two processes, as far as their pins go): A's version
    # is held back after its pack committed; B saves, runs retention and gc meanwhile.
    held, release = asyncio.Event(), asyncio.Event()
    commit = _target.StoreSink.commit

    async def held_back(self: _target.StoreSink) -> None:
        if self.url.endswith("step-000000005.ckpt"):
            held.set()
            await release.wait()
        await commit(self)

    monkeypatch.setattr(_target.StoreSink, "commit", held_back)
    async with Checkpointer(tmp_path, keep_last=5) as a, Checkpointer(tmp_path, keep_last=5) as b:
        await (await a.save(state_of(1), 1))
        handle = await a.save({"w": torch.randn(100_000), "step": 5}, 5)
        await asyncio.wait_for(held.wait(), 30)
        await (await b.save(state_of(6), 6))  # its retention collects unused packs
        await b.gc()
        release.set()
        await handle
        loaded = await a.load(step=5)
        assert loaded["step"] == 5
        assert (await a.verify(5)).ok
    await assert_tidy(tmp_path)


async def test_a_lease_is_released_with_its_save_and_leaves_nothing(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        handle = await ckpt.save(state_of(1), 1)
        async with asyncstore.open_store(tmp_path) as store:
            claimed, _ = await live_keys(store)
        assert "step-000000001.ckpt" in claimed
        await handle
    leases = tmp_path / LEASES
    assert not leases.exists() or not any(leases.iterdir())
    assert await assert_tidy(tmp_path) == ["step-000000001.ckpt"]


async def test_a_lease_from_another_machine_holds_until_it_expires(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(state_of(1), 1))
    orphan = "packs/step-000000007-0badcafe.pack"
    (tmp_path / orphan).write_bytes(b"ASYNCPAK" + bytes(100))
    (tmp_path / LEASES).mkdir(exist_ok=True)
    lease = tmp_path / LEASES / "0123456789abcdef.lease"
    lease.write_bytes(other_machine(time.time(), [orphan]))
    async with Checkpointer(tmp_path) as ckpt:
        assert await ckpt.gc() == 0  # a live writer elsewhere may still name it
        assert (tmp_path / orphan).exists()
        lease.write_bytes(other_machine(time.time() - 3600, [orphan]))
        assert await ckpt.gc() == 2  # the dead lease, then the pack nothing names
    assert not (tmp_path / orphan).exists()
    assert not lease.exists()


async def test_a_lease_of_a_killed_process_on_this_machine_is_dead_at_once(
    tmp_path: Path,
) -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "0")
    await proc.wait()
    async with asyncstore.open_store(tmp_path) as store:
        holder = LeaseHolder(store, ["packs/x.pack"])
        await holder.hold()
        live, dead = await live_keys(store)
        assert (live, dead) == ({"packs/x.pack"}, 0)
        # The same lease, written by a process that has exited since: not renewed for
        # long, but dead anyway because its pid is gone.
        data = msgspec.msgpack.decode(await store.get(holder.key), type=Lease)
        gone = msgspec.structs.replace(data, pid=proc.pid, renewed=time.time())
        await store.put(holder.key, msgspec.msgpack.encode(gone))
        assert await live_keys(store) == (set(), 1)
        await holder.release()


@pytest.mark.s3
async def test_gc_leaves_a_leased_multipart_upload_on_s3_alone(seaweedfs: SeaweedFS) -> None:
    prefix = unique("run")
    url = f"s3://{BUCKET}/{prefix}"
    options: dict[str, Any] = s3_options(seaweedfs)
    key = "step-000000009.ckpt"
    client = seaweedfs.client()
    client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/{key}")
    lease_key = f"{LEASES}fedcba9876543210.lease"
    async with asyncstore.open_store(url, **options) as store:
        await store.put(lease_key, other_machine(time.time(), [key]))
    async with Checkpointer(url, store_options=options) as ckpt:
        await ckpt.gc()
        assert len(seaweedfs.list_multipart_uploads(BUCKET, f"{prefix}/")) == 1
        async with asyncstore.open_store(url, **options) as store:
            await store.put(lease_key, other_machine(time.time() - 3600, [key]))
        assert await ckpt.gc() == 2  # the dead lease and the upload it claimed
    assert seaweedfs.list_multipart_uploads(BUCKET, f"{prefix}/") == []
