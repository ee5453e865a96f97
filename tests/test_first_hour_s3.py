"""What users meet in their first hour with S3: credentials, buckets, a local server, and
saves that block the training loop."""

from __future__ import annotations

from pathlib import Path

import pytest

import asyncstore
from asyncstore.stores import _s3client
from asyncstore.testing import SeaweedFS

from .conftest import BUCKET, unique

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
