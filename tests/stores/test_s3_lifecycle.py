"""An S3 store's lifecycle against the real SeaweedFS: cancellation while an upload starts,
writers that outlive their store, event loops, and two writers of one key."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import anyio
import pytest

import asyncstore
from asyncstore import StoreClosed
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique
from .conftest import FAST

pytestmark = pytest.mark.anyio


async def wait_for(condition: Any, what: str) -> None:
    """Poll ``condition()`` until true; the bound only turns a hang into a failure."""
    with anyio.fail_after(30):
        while not condition():  # noqa: ASYNC110 - set by the proxy's thread: no Event to wait on
            await anyio.sleep(0.01)


async def test_cancel_while_create_multipart_upload_is_in_flight(
    faults: FaultProxy, seaweedfs: SeaweedFS
) -> None:
    # The proxy holds each request 0.5 s before forwarding it, and forwards it even when the
    # client has gone: the server creates the upload after the caller was cancelled.
    options = s3_options(seaweedfs, endpoint_url=faults.url, **FAST)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options) as store:
        prefix = store.url.removeprefix(f"s3://{BUCKET}/")
        faults.latency = 0.5
        before = faults.requests
        task = asyncio.ensure_future(store.put("big", os.urandom(6 * MiB)))  # multipart
        await wait_for(lambda: faults.requests > before, "CreateMultipartUpload to be sent")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        faults.latency = 0.0
        # Once the create has reached the server, an orphan would be listed within moments.
        await wait_for(lambda: faults.requests_forwarded > 0, "the create to be forwarded")
        for _ in range(20):
            assert seaweedfs.list_multipart_uploads(BUCKET, prefix) == []
            await anyio.sleep(0.05)
        with pytest.raises(asyncstore.NotFound):
            await store.stat("big")


@pytest.mark.parametrize("size", [1000, 6 * MiB], ids=["single-put", "multipart"])
async def test_writer_open_across_aclose_never_commits(
    open_kind: Any, store_kind: str, request: pytest.FixtureRequest, size: int
) -> None:
    store = open_kind()
    await store.__aenter__()
    writer = store.open_writer("k")
    await writer.__aenter__()
    await writer.write(os.urandom(size))
    await store.aclose()
    with pytest.raises(StoreClosed, match="store was closed while the writer was open"):
        await writer.write(b"more")
    with pytest.raises(StoreClosed, match="nothing was written"):
        await writer.__aexit__(None, None, None)
    assert writer.info is None
    async with open_kind(store.url) as again:
        with pytest.raises(asyncstore.NotFound):
            await again.stat("k")
    if store_kind == "s3":
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        prefix = store.url.removeprefix(f"s3://{BUCKET}/")
        assert server.list_multipart_uploads(BUCKET, prefix) == []  # aborted, not orphaned


async def test_writer_failing_inside_block_after_aclose_keeps_its_error(
    seaweedfs: SeaweedFS,
) -> None:
    store = asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs))
    writer = store.open_writer("k")
    with pytest.raises(ValueError, match="producer"):
        async with writer:
            await writer.write(os.urandom(6 * MiB))
            await store.aclose()
            raise ValueError("producer failed")
    prefix = store.url.removeprefix(f"s3://{BUCKET}/")
    assert seaweedfs.list_multipart_uploads(BUCKET, prefix) == []


async def test_writer_whose_upload_another_writer_aborted_says_so(seaweedfs: SeaweedFS) -> None:
    # A second process saving to the same key first aborts unfinished uploads of it
    # (clean_up_writes): the first writer's upload vanishes under it.
    url = f"s3://{BUCKET}/{unique()}"
    async with (
        asyncstore.open_store(url, **s3_options(seaweedfs)) as first,
        asyncstore.open_store(url, **s3_options(seaweedfs)) as second,
    ):
        assert isinstance(second, asyncstore.S3Store)
        with pytest.raises(asyncstore.StoreError, match="another writer of the same key") as caught:
            async with first.open_writer("ckpt") as writer:
                await writer.write(os.urandom(6 * MiB))  # the upload and its first part
                assert await second.clean_up_writes("ckpt") == 1
                await writer.write(os.urandom(MiB))
        assert not isinstance(caught.value, asyncstore.NotFound)
        assert "does not exist" not in str(caught.value)


async def test_checkpoint_replaced_during_a_load_is_reported_as_replaced(
    seaweedfs: SeaweedFS,
) -> None:
    from asyncstore.checkpoint._target import StoreSource

    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs)) as store:
        old, new = os.urandom(12 * MiB), os.urandom(12 * MiB)
        await store.put("model.ckpt", old)
        source = StoreSource(store, "model.ckpt", None)
        assert await source.size() == len(old)
        assert await source.read(MiB, 2 * MiB) == old[MiB : 2 * MiB]
        await store.put("model.ckpt", new)  # another process saves over it
        for start, end in [(0, 100), (MiB, 11 * MiB)]:  # one request; parallel ranges
            with pytest.raises(asyncstore.StoreError, match="replaced by another writer"):
                await source.read(start, end)
        await source.aclose()


def test_store_used_on_a_second_event_loop_says_what_to_do(seaweedfs: SeaweedFS) -> None:
    # Not an anyio test: it drives two event loops of its own, as two asyncio.run() calls do.
    store = asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs))
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(store.put("k", b"v"))
        with pytest.raises(asyncstore.StoreError, match="first used on another event loop"):
            asyncio.run(store.get("k"))
        with pytest.raises(asyncstore.StoreError, match="open the store inside the loop"):
            asyncio.run(store.put("k", b"w"))
        assert first.run_until_complete(store.get("k")) == b"v"  # its own loop still works
        first.run_until_complete(store.aclose())
    finally:
        first.close()


def test_store_closed_from_another_loop_after_its_loop_ended(seaweedfs: SeaweedFS) -> None:
    store = asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs))

    async def use_and_release() -> None:
        await store.put("k", b"v")
        assert isinstance(store, asyncstore.S3Store)
        # Give the connections back to the first loop's pool and close them there, as a
        # careful user would, so that only the client object outlives its loop.
        assert store._fast is not None
        await store._fast.aclose()
        await store._client._endpoint.http_session.close()

    asyncio.run(use_and_release())
    with pytest.raises(asyncstore.StoreError, match="first used on another event loop"):
        asyncio.run(store.get("k"))
    asyncio.run(store.aclose())  # no "Event loop is closed": the old client is dropped
    with pytest.raises(StoreClosed):
        asyncio.run(store.get("k"))
