"""S3 behaviour against a real SeaweedFS: multipart, credentials, buckets, the AWS chain."""

from __future__ import annotations

import os
from typing import Any

import pytest

import asyncstore
from asyncstore import NotFound, PermissionDenied
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, MiB, s3_options, unique

pytestmark = pytest.mark.anyio


def open_s3(server: SeaweedFS, url: str | None = None, **overrides: Any) -> asyncstore.Store:
    return asyncstore.open_store(
        url or f"s3://{BUCKET}/{unique()}", **s3_options(server, **overrides)
    )


async def test_multipart_writer_uploads_parts_and_leaves_no_upload(
    seaweedfs: SeaweedFS, fresh_bucket: str
) -> None:
    url = f"s3://{fresh_bucket}/{unique()}"
    async with open_s3(seaweedfs, url, upload_max_inflight=2) as store:
        data = os.urandom(23 * MiB + 11)  # five parts of 5 MiB, the last one short
        async with store.open_writer("mp/obj") as writer:
            for offset in range(0, len(data), 3 * MiB):
                await writer.write(data[offset : offset + 3 * MiB])
        assert writer.info is not None
        assert writer.info.etag is not None
        assert writer.info.etag.endswith("-5")  # S3 marks multipart ETags with the part count
        assert await store.get("mp/obj") == data
        assert seaweedfs.list_multipart_uploads(fresh_bucket) == []  # none, anywhere


async def test_failed_writer_aborts_its_multipart_upload(seaweedfs: SeaweedFS) -> None:
    async with open_s3(seaweedfs) as store:
        assert isinstance(store, asyncstore.S3Store)
        prefix = store.url.removeprefix(f"s3://{BUCKET}/")
        with pytest.raises(ValueError, match="producer failed"):
            async with store.open_writer("mp/failed") as writer:
                await writer.write(os.urandom(12 * MiB))  # two parts already sent
                assert seaweedfs.list_multipart_uploads(BUCKET, prefix) != []
                raise ValueError("producer failed")
        assert seaweedfs.list_multipart_uploads(BUCKET, prefix) == []
        with pytest.raises(NotFound):
            await store.stat("mp/failed")


async def test_wrong_secret_is_permission_denied_without_the_secret(seaweedfs: SeaweedFS) -> None:
    async with open_s3(seaweedfs, aws_secret_access_key="wrong-secret-abc123") as store:
        with pytest.raises(PermissionDenied) as caught:
            await store.get("anything")
        message = str(caught.value)
        assert "wrong-secret-abc123" not in message
        assert seaweedfs.secret_key not in message
        assert store.url in message


async def test_missing_bucket(seaweedfs: SeaweedFS) -> None:
    # (SeaweedFS creates a bucket on the first PUT into it, so only reads can show this.)
    # A name no other test uses: none of them can have created it.
    bucket = unique("no-such-bucket")
    async with open_s3(seaweedfs, f"s3://{bucket}/x") as store:
        with pytest.raises(NotFound, match=f"bucket '{bucket}' does not exist"):
            await store.get("k")
        with pytest.raises(NotFound, match=f"bucket '{bucket}' does not exist"):
            [i async for i in store.list()]


async def test_credentials_and_endpoint_from_the_environment(
    seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", seaweedfs.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", seaweedfs.region)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}") as store:
        await store.put("env", b"from the chain")
        assert await store.get("env") == b"from the chain"


async def test_parallel_ranged_get_of_a_large_object(seaweedfs: SeaweedFS) -> None:
    async with open_s3(seaweedfs) as store:
        data = os.urandom(33 * MiB)
        await store.put("big", data)
        assert await store.get("big") == data
        assert await store.get("big", 7 * MiB + 3, 29 * MiB) == data[7 * MiB + 3 : 29 * MiB]


async def test_object_overwritten_during_a_streaming_read(seaweedfs: SeaweedFS) -> None:
    # The reader pins the version it started with; a resumed read never mixes versions.
    async with open_s3(seaweedfs) as store:
        first = os.urandom(3 * MiB)
        await store.put("v", first)
        async with store.open_reader("v", chunk_bytes=MiB) as reader:
            head = await reader.__anext__()
            await store.put("v", os.urandom(3 * MiB))
            rest = b"".join([chunk async for chunk in reader])
        assert head + rest == first


async def test_unclosed_store_warns(seaweedfs: SeaweedFS) -> None:
    store = open_s3(seaweedfs)
    await store.put("k", b"v")
    with pytest.warns(ResourceWarning, match="was not closed"):
        store.__del__()  # type: ignore[attr-defined]
    await store.aclose()
