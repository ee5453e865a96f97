"""What users meet in their first hour with S3: credentials, buckets, a local server, and
saves that block the training loop."""

from __future__ import annotations

from pathlib import Path

import pytest

import asyncstore
from asyncstore.stores import _s3client
from asyncstore.testing import SeaweedFS

from .conftest import BUCKET, s3_options, unique

pytestmark = pytest.mark.anyio


# -- credentials ---------------------------------------------------------------------------


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process where the AWS chain finds no credentials at all."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Sessions resolve the chain once; start from a fresh one.
    monkeypatch.setattr(_s3client, "_SESSIONS", {})


@pytest.mark.usefixtures("no_credentials")
async def test_missing_credentials_are_permission_denied(seaweedfs: SeaweedFS) -> None:
    prefix = unique()
    store = asyncstore.open_store(f"s3://{BUCKET}/{prefix}", endpoint_url=seaweedfs.endpoint_url)
    try:
        for call in (
            lambda: store.get("run/model.ckpt"),
            lambda: store.put("run/model.ckpt", b"x"),
        ):
            with pytest.raises(asyncstore.PermissionDenied) as caught:
                await call()
            message = str(caught.value)
            assert f"s3://{BUCKET}/{prefix}/run/model.ckpt" in message  # the object, not the prefix
            for where in ("aws_access_key_id", "AWS_ACCESS_KEY_ID", "AWS_SHARED_CREDENTIALS_FILE"):
                assert where in message
    finally:
        await store.aclose()


# -- buckets ---------------------------------------------------------------------------------


async def test_save_to_a_new_bucket_with_create(seaweedfs: SeaweedFS) -> None:
    import torch

    bucket = unique("new")
    options = s3_options(seaweedfs, create=True)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    target = f"s3://{bucket}/run/step-1.ckpt"
    await (await asyncstore.save(state, target, store_options=options))
    loaded = await asyncstore.load(target, store_options=options)
    assert torch.equal(loaded["w"], state["w"])
    assert bucket in {b["Name"] for b in seaweedfs.client().list_buckets()["Buckets"]}


async def test_create_is_idempotent_and_safe_between_racing_openers(seaweedfs: SeaweedFS) -> None:
    import anyio

    bucket = unique("race")
    stores = [
        asyncstore.open_store(f"s3://{bucket}/p{i}", **s3_options(seaweedfs, create=True))
        for i in range(4)
    ]

    async def use(i: int) -> None:
        async with stores[i] as store:
            await store.put("k", str(i).encode())

    async with anyio.create_task_group() as tg:
        for i in range(len(stores)):
            tg.start_soon(use, i)
    # An existing bucket is used as it is, its objects kept.
    async with asyncstore.open_store(f"s3://{bucket}", **s3_options(seaweedfs, create=True)) as s:
        assert sorted([i.key async for i in s.list()]) == [f"p{i}/k" for i in range(4)]


async def test_create_when_not_allowed_is_permission_denied(seaweedfs: SeaweedFS) -> None:
    bucket = unique("denied")
    options = s3_options(seaweedfs, create=True, aws_secret_access_key="not-the-secret")
    with pytest.raises(asyncstore.PermissionDenied, match=f"create bucket '{bucket}'"):
        async with asyncstore.open_store(f"s3://{bucket}/x", **options):
            pass
    assert bucket not in {b["Name"] for b in seaweedfs.client().list_buckets()["Buckets"]}


async def test_a_missing_bucket_is_named_apart_from_a_missing_key(seaweedfs: SeaweedFS) -> None:
    bucket = unique("missing")
    async with asyncstore.open_store(f"s3://{bucket}/run", **s3_options(seaweedfs)) as store:
        for call in (lambda: store.stat("a.bin"), lambda: store.get("a.bin")):
            with pytest.raises(asyncstore.NotFound) as caught:
                await call()
            message = str(caught.value)
            assert f"bucket {bucket!r} does not exist" in message
            assert "create=True" in message
            assert f"s3://{bucket}/run/a.bin" in message
    with pytest.raises(asyncstore.NotFound, match=f"bucket {bucket!r} does not exist"):
        await asyncstore.load(f"s3://{bucket}/run/step.ckpt", store_options=s3_options(seaweedfs))
    # In a bucket that exists, a missing key is only that.
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs)) as store:
        for call in (lambda: store.stat("a.bin"), lambda: store.get("a.bin")):
            with pytest.raises(asyncstore.NotFound) as caught:
                await call()
            assert "bucket" not in str(caught.value)
