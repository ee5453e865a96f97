"""Credentials never reach a repr or a log line, botocore's own DEBUG log included."""

from __future__ import annotations

import logging
import re
from urllib.parse import quote

import pytest

import asyncstore
from asyncstore import PermissionDenied, S3Config
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique

pytestmark = pytest.mark.anyio

TOKEN = "FwoGZXIvYXdzEXAMPLE/session+token=="


def test_config_reprs_mask_the_secrets() -> None:
    config = S3Config(
        aws_access_key_id="AKID", aws_secret_access_key="s3cr3t-key", aws_session_token=TOKEN
    )
    rich = dict(config.__rich_repr__())  # what rich.print / rich tracebacks show
    assert rich["aws_secret_access_key"] == "***"
    assert rich["aws_session_token"] == "***"
    assert rich["aws_access_key_id"] == "AKID"
    for text in (repr(config), str(config), f"{config}", f"{config!r}", str(rich)):
        assert "s3cr3t-key" not in text
        assert TOKEN not in text
        assert "aws_secret_access_key='***'" in text or "'***'" in text


async def test_botocore_debug_log_carries_no_credentials(
    seaweedfs: SeaweedFS, caplog: pytest.LogCaptureFixture
) -> None:
    # Every signed request logs its canonical request, prepared headers and presigned URL at
    # DEBUG. SeaweedFS refuses the (made-up) session token, but only after the whole signed
    # request crossed the wire, which is what the log shows.
    caplog.set_level(logging.DEBUG)
    for name in ("botocore", "aiobotocore"):
        caplog.set_level(logging.DEBUG, logger=name)
    secret = seaweedfs.secret_key
    options = s3_options(seaweedfs, aws_session_token=TOKEN)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options) as store:
        with pytest.raises(PermissionDenied):
            await store.put("k", b"v")
        with pytest.raises(PermissionDenied):
            await store.get("k")  # the signed fast path
        with pytest.raises(PermissionDenied):
            async with store.open_reader("k") as reader:  # botocore's get_object
                [chunk async for chunk in reader]
    # Without a token the requests succeed; the secret key must not show either.
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **s3_options(seaweedfs)) as store:
        await store.put("k", b"v")
        assert await store.get("k") == b"v"

    botocore_records = [
        r for r in caplog.records if r.name.split(".")[0] in ("botocore", "aiobotocore")
    ]
    messages = [r.getMessage() for r in botocore_records]
    everything = "\n".join(messages)
    assert any("x-amz-security-token" in m.lower() for m in messages)  # the token was logged about
    assert any("Authorization" in m for m in messages)
    for value in (TOKEN, quote(TOKEN, safe=""), quote(TOKEN, safe="/~"), secret):
        assert value not in everything
    for record in caplog.records:
        assert TOKEN not in record.getMessage()
        assert secret not in record.getMessage()
    # Signatures are bearer material for the life of the request: masked too.
    signatures = re.findall(r"Signature[:=]\s*b?'?([^\s,'&]+)", everything)
    assert signatures
    assert set(signatures) == {"***"}


def test_filter_masks_known_fields_in_any_logger_form() -> None:
    from asyncstore.stores import _redact

    _redact.remember_secret("wJalrXUtnFEMI/K7MDENG")
    samples = {
        "headers={'Authorization': b'AWS4-HMAC-SHA256 Credential=AK/x, "
        "SignedHeaders=host, Signature=abc123'}": "abc123",
        "x-amz-security-token:tok/en==\nhost:x": "tok/en==",
        "GET /b/k?X-Amz-Security-Token=tok%2Fen&X-Amz-Signature=deadbeef&X": "deadbeef",
        "<Credentials><SecretAccessKey>zzzSECRET</SecretAccessKey>"
        "<SessionToken>ttt</SessionToken>": "zzzSECRET",
        "key was wJalrXUtnFEMI%2FK7MDENG in a URL": "wJalrXUtnFEMI",
    }
    for text, leaked in samples.items():
        assert leaked not in _redact.redact(text), text
    assert (
        _redact.redact("Calculating signature using v4 auth.")
        == "Calculating signature using v4 auth."
    )
