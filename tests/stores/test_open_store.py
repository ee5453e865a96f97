"""open_store(): URLs and options are checked at once, with errors that say what to do."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import asyncstore
from asyncstore import InvalidArgument, InvalidURL


def test_schemes(tmp_path: Path) -> None:
    assert isinstance(asyncstore.open_store("memory://scratch"), asyncstore.MemoryStore)
    local = asyncstore.open_store(f"file://{tmp_path}")
    assert isinstance(local, asyncstore.LocalStore)
    assert local.url == f"file://{tmp_path}"
    assert asyncstore.open_store(str(tmp_path)).url == local.url
    assert asyncstore.open_store(tmp_path).url == local.url  # PathLike
    assert asyncstore.open_store(f"file://localhost{tmp_path}").url == local.url
    s3 = asyncstore.open_store("s3://my-bucket/some/prefix/")
    assert isinstance(s3, asyncstore.S3Store)
    assert s3.url == "s3://my-bucket/some/prefix"
    assert asyncstore.open_store("s3://my-bucket").url == "s3://my-bucket"


def test_relative_path_is_taken_from_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert asyncstore.open_store("data").url == f"file://{tmp_path}/data"


def test_file_url_is_percent_decoded(tmp_path: Path) -> None:
    store = asyncstore.open_store(f"file://{tmp_path}/my%20dir")
    assert store.url == f"file://{tmp_path}/my dir"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "empty store URL"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("s3://", "has no bucket"),
        ("s3:///prefix", "has no bucket"),
        ("s3://Upper_Case/x", "not a valid bucket name"),
        ("s3://ab/x", "not a valid bucket name"),
        ("s3://bucket/a/../b", "malformed path"),
        ("s3://bucket/a//b", "malformed path"),
        ("s3://bucket/x?versionId=3", "query or fragment"),
        ("memory://", "needs a name"),
        ("file://relative/path", "names host 'relative'"),
        ("nul\x00byte", "NUL byte"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(InvalidURL, match=match) as caught:
        asyncstore.open_store(url)
    assert isinstance(caught.value, ValueError)


def test_url_of_wrong_type() -> None:
    with pytest.raises(InvalidURL, match="is a int"):
        asyncstore.open_store(42)  # type: ignore[arg-type]


def test_credentials_in_url_are_refused_and_never_echoed() -> None:
    with pytest.raises(InvalidURL, match="embeds credentials") as caught:
        asyncstore.open_store("s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/prefix")
    assert "wJalrXUtnFEMI" not in str(caught.value)
    assert "AKIDEXAMPLE" not in str(caught.value)


def test_local_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(InvalidURL, match="is a file"):
        asyncstore.open_store(tmp_path / "f")


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("s3://bucket", {"part_bytes": 1024}, r"part_bytes=1024: expected int >= 5242880"),
        ("s3://bucket", {"max_inflight": 0}, "max_inflight=0"),
        ("s3://bucket", {"max_attempts": "3"}, r"max_attempts='3': expected int, got str"),
        ("s3://bucket", {"endpoint": "http://x"}, r"'endpoint' \(did you mean 'endpoint_url'\?\)"),
        ("s3://bucket", {"addressing_style": "sideways"}, "addressing_style='sideways'"),
        ("s3://bucket", {"read_timeout": 0}, "read_timeout=0"),
        ("/tmp/x", {"fsync": "yes"}, "fsync='yes'"),
        ("/tmp/x", {"max_inflight": -1}, "max_inflight=-1"),
        ("memory://m", {"fsync": True}, "take no options"),
    ],
)
def test_bad_options(url: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        asyncstore.open_store(url, **options)


def test_bad_endpoint() -> None:
    with pytest.raises(InvalidURL, match="not an http"):
        asyncstore.open_store("s3://bucket", endpoint_url="127.0.0.1:9000")


def test_secrets_never_in_repr_or_errors() -> None:
    store = asyncstore.open_store(
        "s3://bucket",
        aws_access_key_id="AKID",
        aws_secret_access_key="s3cr3t-value",
        aws_session_token="t0ken-value",
    )
    assert isinstance(store, asyncstore.S3Store)
    text = repr(store) + repr(store.config) + str(store.config)
    assert "s3cr3t-value" not in text
    assert "t0ken-value" not in text
    with pytest.raises(InvalidArgument) as caught:
        asyncstore.open_store("s3://bucket", aws_secret_access_key=12345)
    assert "12345" not in str(caught.value)


def test_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    store = asyncstore.open_store("s3://bucket")
    assert isinstance(store, asyncstore.S3Store)
    assert store.endpoint_url == "http://127.0.0.1:2"  # the service-specific one wins
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    store = asyncstore.open_store("s3://bucket")
    assert isinstance(store, asyncstore.S3Store)
    assert store.endpoint_url == "http://127.0.0.1:1"
    explicit = asyncstore.open_store("s3://bucket", endpoint_url="http://127.0.0.1:3")
    assert isinstance(explicit, asyncstore.S3Store)
    assert explicit.endpoint_url == "http://127.0.0.1:3"


def test_open_store_does_no_io(tmp_path: Path) -> None:
    target = tmp_path / "not-yet"
    asyncstore.open_store(target)
    assert not os.path.exists(target)


def test_credentials_in_endpoint_are_refused() -> None:
    with pytest.raises(InvalidURL, match="embeds credentials") as caught:
        asyncstore.open_store("s3://bucket", endpoint_url="http://user:pw-secret@127.0.0.1:1")
    assert "pw-secret" not in str(caught.value)


@pytest.mark.parametrize(
    "field", ["aws_secret_access_key", "aws_session_token", "aws_access_key_id"]
)
def test_credential_options_are_never_echoed(field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        asyncstore.open_store("s3://bucket", **{field: b"TOP-SECRET-VALUE"})
    assert "TOP-SECRET-VALUE" not in str(caught.value)
    assert field in str(caught.value)


@pytest.mark.anyio
async def test_unknown_profile_is_a_store_error() -> None:
    store = asyncstore.open_store("s3://bucket-x", profile="no-such-profile-here")
    with pytest.raises(asyncstore.StoreError, match="cannot create an S3 client"):
        await store.stat("k")
    await store.aclose()
