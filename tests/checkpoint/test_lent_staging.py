"""Staging slabs lent to an S3 upload: the parts keep views of the slabs (no copy), each slab
goes back to the pool once its parts are sent, and a pool smaller than the parts in flight
still streams a large state (the part being gathered is copied while the snapshot waits for
a slab). Against the real server; faults through the proxy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import asyncstore
from asyncstore.checkpoint import staging_pool
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique
from .helpers import assert_same_storage_layout

pytestmark = pytest.mark.anyio


def all_back(chunk: int) -> bool:
    pool = staging_pool(chunk)
    return len(pool._free) == pool.allocated


@pytest.mark.parametrize(
    ("chunk", "staging"),
    [
        (MiB, 2 * MiB),  # two slabs; a 5 MiB part would hold both (and more) if kept lent
        (3 * MiB + 4096, 64 * MiB),  # room for every part in flight: nothing copied
    ],
)
async def test_a_state_streams_to_s3_through_a_pool_smaller_than_its_parts(
    seaweedfs: SeaweedFS, chunk: int, staging: int
) -> None:
    options = s3_options(seaweedfs)  # 5 MiB parts, 4 in flight
    state = {f"layer{i}": torch.randn(3 * MiB // 4) for i in range(8)}  # 24 MiB of fp32
    state["step"] = torch.tensor(7)
    target = f"s3://{BUCKET}/{unique('lent')}/a.ckpt"
    save = asyncstore.save(
        state,
        target,
        compression=None,
        chunk_bytes=chunk,
        staging_bytes=staging,
        store_options=options,
    )
    # Without the copy of the part being gathered this waits for ever: the part waits for
    # the next segment, which waits for a slab the part holds.
    result = await asyncio.wait_for((await save).wait(), 60)
    assert result.raw_bytes > 24 * MiB
    assert all_back(chunk)
    loaded = await asyncstore.load(target, store_options=options)
    assert_same_storage_layout(state, loaded)
    staging_pool(chunk).trim()


async def test_slabs_come_back_when_the_upload_fails(
    seaweedfs: SeaweedFS, proxy: FaultProxy
) -> None:
    chunk = 2 * MiB
    options: dict[str, Any] = s3_options(seaweedfs, endpoint_url=proxy.url, max_attempts=1)
    state = {f"w{i}": torch.randn(MiB) for i in range(6)}  # 24 MiB
    target = f"s3://{BUCKET}/{unique('lent')}/a.ckpt"
    for after in (0, 2):  # the first part refused, or a later one while earlier ones are held
        proxy.reset()
        await (await asyncstore.save({"x": 1}, target, store_options=options))  # connections up
        proxy.fail_next(1, status=500, match=f"partNumber={after + 1}&")
        with pytest.raises(asyncstore.StoreUnavailable):
            await asyncio.wait_for(
                (
                    await asyncstore.save(
                        state,
                        target,
                        compression=None,
                        chunk_bytes=chunk,
                        staging_bytes=64 * MiB,
                        store_options=options,
                    )
                ).wait(),
                60,
            )
        assert all_back(chunk)
        assert (await asyncstore.load(target, store_options=options)) == {"x": 1}
    staging_pool(chunk).trim()


async def test_slabs_come_back_when_a_save_is_cancelled_mid_upload(
    seaweedfs: SeaweedFS, proxy: FaultProxy
) -> None:
    chunk = 2 * MiB
    options: dict[str, Any] = s3_options(seaweedfs, endpoint_url=proxy.url)
    state = {f"w{i}": torch.randn(MiB) for i in range(6)}
    target = f"s3://{BUCKET}/{unique('lent')}/a.ckpt"
    await (await asyncstore.save({"x": 1}, target, store_options=options))
    handle = await asyncstore.save(
        state, target, compression=None, chunk_bytes=chunk, store_options=options
    )
    proxy.stall(True)
    await asyncio.sleep(0.3)
    handle.cancel()
    proxy.stall(False)
    with pytest.raises(asyncio.CancelledError):
        await handle.wait()
    assert all_back(chunk)
    assert (await asyncstore.load(target, store_options=options)) == {"x": 1}
    staging_pool(chunk).trim()
