"""Faults between client and server: a TCP proxy in front of the real SeaweedFS injects resets,
503s, throttling, latency and stalls; a stopped server must fail fast and clearly."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncstore
from asyncstore import StoreError, StoreUnavailable
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique
from .conftest import FAST

pytestmark = pytest.mark.anyio


def through(
    proxy: FaultProxy, server: SeaweedFS, *, bucket: str = BUCKET, **overrides: Any
) -> asyncstore.Store:
    options = s3_options(server, endpoint_url=proxy.url, **FAST)
    options.update(overrides)
    return asyncstore.open_store(f"s3://{bucket}/{unique()}", **options)


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_server_errors_and_throttling_are_retried(
    faults: FaultProxy, seaweedfs: SeaweedFS, status: int
) -> None:
    async with through(faults, seaweedfs) as store:
        data = os.urandom(100_000)
        faults.fail_next(2, status=status)
        await store.put("k", data)
        faults.fail_next(3, status=status)
        assert await store.get("k") == data
        assert faults.failed == 5


async def test_connection_resets_are_retried(faults: FaultProxy, seaweedfs: SeaweedFS) -> None:
    async with through(faults, seaweedfs) as store:
        data = os.urandom(2 * MiB)
        faults.reset_next(1)
        await store.put("k", data)
        faults.reset_next(2, after_bytes=300_000)  # mid-body
        assert await store.get("k") == data
        assert faults.resets == 3


async def test_reset_during_parallel_ranged_get(faults: FaultProxy, seaweedfs: SeaweedFS) -> None:
    async with through(faults, seaweedfs) as store:
        data = os.urandom(16 * MiB)
        await store.put("big", data)
        faults.reset_next(3, after_bytes=MiB)
        assert await store.get("big") == data
        assert faults.resets == 3


async def test_streaming_reader_resumes_after_a_reset(
    faults: FaultProxy, seaweedfs: SeaweedFS
) -> None:
    async with through(faults, seaweedfs) as store:
        data = os.urandom(6 * MiB)
        await store.put("stream", data)
        requests_before = faults.requests
        faults.reset_next(1, after_bytes=2 * MiB + 123)
        async with store.open_reader("stream", chunk_bytes=MiB) as reader:
            received = b"".join([chunk async for chunk in reader])
        assert received == data
        assert faults.resets == 1
        assert faults.requests - requests_before == 2  # the GET and one ranged resume


async def test_multipart_upload_survives_part_failures(
    faults: FaultProxy, seaweedfs: SeaweedFS, fresh_bucket: str
) -> None:
    async with through(faults, seaweedfs, bucket=fresh_bucket, upload_max_inflight=3) as store:
        data = os.urandom(16 * MiB)
        faults.fail_next(1)  # CreateMultipartUpload
        async with store.open_writer("mp") as writer:
            await writer.write(data[: 6 * MiB])
            faults.fail_next(2)
            faults.reset_next(1)
            await writer.write(data[6 * MiB :])
        assert await store.get("mp") == data
        assert seaweedfs.list_multipart_uploads(fresh_bucket) == []  # none, anywhere


async def test_latency_is_tolerated(faults: FaultProxy, seaweedfs: SeaweedFS) -> None:
    async with through(faults, seaweedfs) as store:
        faults.latency = 0.05
        await store.put("slow", b"x" * 1000)
        assert await store.get("slow") == b"x" * 1000


async def test_persistent_errors_give_store_unavailable(
    faults: FaultProxy, seaweedfs: SeaweedFS
) -> None:
    async with through(faults, seaweedfs) as store:
        faults.fail_next(1000)
        with pytest.raises(StoreUnavailable, match=r"failed 4 time\(s\).*HTTP 503") as caught:
            await store.get("k")
        assert faults.failed == 4
        assert store.url in str(caught.value)
        assert seaweedfs.secret_key not in str(caught.value)


async def test_client_errors_are_not_retried(faults: FaultProxy, seaweedfs: SeaweedFS) -> None:
    async with through(faults, seaweedfs) as store:
        faults.fail_next(5, status=400)
        with pytest.raises(StoreError, match="HTTP 400"):
            await store.get("k")
        assert faults.failed == 1


async def test_stalled_server_times_out(faults: FaultProxy, seaweedfs: SeaweedFS) -> None:
    async with through(faults, seaweedfs, read_timeout=0.5, max_attempts=2) as store:
        await store.put("k", b"v")
        faults.stall(True)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="failed 2 time"):
            await store.get("k")
        assert time.monotonic() - started < 10


async def test_refused_connections(faults: FaultProxy, seaweedfs: SeaweedFS) -> None:
    async with through(faults, seaweedfs) as store:
        faults.refuse(True)
        with pytest.raises(StoreUnavailable):
            await store.put("k", b"v")


async def test_stopped_server_fails_fast(tmp_path: Path) -> None:
    server = SeaweedFS(data_dir=tmp_path / "sw")
    server.start()
    try:
        server.create_bucket("doomed")
        options = s3_options(server, **FAST)
        async with asyncstore.open_store("s3://doomed/x", **options) as store:
            await store.put("k", b"v")
            server.stop(timeout=2.0)
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="reachable"):
                await store.get("k")
            # Refused connections are retried with backoff, then reported: no hang.
            assert time.monotonic() - started < 15
    finally:
        server.stop(timeout=2.0)


async def test_writer_failing_mid_stream_leaves_nothing(
    faults: FaultProxy, seaweedfs: SeaweedFS
) -> None:
    async with through(faults, seaweedfs, upload_max_inflight=1, max_attempts=2) as store:
        assert isinstance(store, asyncstore.S3Store)
        prefix = store.url.removeprefix(f"s3://{BUCKET}/")
        with pytest.raises(StoreUnavailable):
            async with store.open_writer("doomed") as writer:
                await writer.write(os.urandom(5 * MiB))  # part 1 goes up
                faults.fail_next(1000, match="partNumber=2")
                for _ in range(4):
                    await writer.write(os.urandom(5 * MiB))
        faults.reset()
        assert seaweedfs.list_multipart_uploads(BUCKET, prefix) == []
        assert [i async for i in store.list()] == []


async def test_writer_never_commits_after_a_failed_write(
    faults: FaultProxy, seaweedfs: SeaweedFS
) -> None:
    # A caller that catches a failed write and leaves the block cleanly must not get a
    # shortened object: the writer refuses to commit.
    async with through(faults, seaweedfs, max_attempts=2) as store:
        with pytest.raises(StoreError, match="an earlier write failed"):
            async with store.open_writer("short") as writer:
                await writer.write(os.urandom(3 * MiB))
                faults.fail_next(1000, match="uploads")  # CreateMultipartUpload fails
                with pytest.raises(StoreUnavailable):
                    await writer.write(os.urandom(3 * MiB))
                faults.reset()
        assert [i async for i in store.list()] == []


async def test_abandoned_reader_gives_its_slot_back(seaweedfs: SeaweedFS) -> None:
    options = s3_options(seaweedfs, max_inflight=1)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options) as store:
        await store.put("r", os.urandom(3 * MiB))
        with pytest.warns(ResourceWarning, match="not closed"):
            async for _chunk in store.open_reader("r", chunk_bytes=MiB):
                break  # no 'async with': the reader is dropped open
            gc.collect()
        with anyio.fail_after(10):
            assert (await store.stat("r")).size == 3 * MiB


async def test_lost_completion_response_is_recovered(
    faults: FaultProxy, seaweedfs: SeaweedFS, fresh_bucket: str
) -> None:
    # The server completes the upload but the client never hears it: the retried completion
    # must end in the object, not in an error or a second upload.
    async with through(faults, seaweedfs, bucket=fresh_bucket) as store:
        data = os.urandom(11 * MiB)  # three parts
        # CompleteMultipartUpload is the one "POST /bucket/key?uploadId=…" request.
        path = store.url.removeprefix("s3://")
        faults.reset_next(1, match=f"POST /{path}/completed?uploadId=")
        async with store.open_writer("completed") as writer:
            await writer.write(data)
        assert faults.resets == 1
        assert writer.info is not None
        assert writer.info.size == len(data)
        assert await store.get("completed") == data
        assert seaweedfs.list_multipart_uploads(fresh_bucket) == []  # none, anywhere
