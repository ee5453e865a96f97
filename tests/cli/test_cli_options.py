"""Store options on the command line (``-o KEY=VALUE``, ``cp --dst-option``): each value is
read as the type of the option it is for, never guessed from how the text looks. A secret
key of digits stays text; ``part_bytes=5242880`` is an int and ``create=true`` a bool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore.torch
from asyncstore import LocalStore, S3Store, open_store
from asyncstore.cli import main, parser
from asyncstore.cli._runs import store_options
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, unique
from .helpers import one_line_error

# Generated credentials are sometimes all digits; a leading zero would be lost to an int.
ACCESS_KEY = "1234567890"
SECRET_KEY = "0123456789"
NUMBERS = "numbers"


@pytest.fixture(scope="module")
def numeric_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """An S3 server whose only identity has credentials made of digits."""
    server = SeaweedFS(
        data_dir=tmp_path_factory.mktemp("numeric"), access_key=ACCESS_KEY, secret_key=SECRET_KEY
    )
    server.start()
    try:
        server.create_bucket(NUMBERS)
        yield server
    finally:
        server.stop(timeout=2.0)


def numeric_options(server: SeaweedFS, flag: str = "-o") -> list[str]:
    options = [
        f"endpoint_url={server.endpoint_url}",
        f"aws_access_key_id={ACCESS_KEY}",
        f"aws_secret_access_key={SECRET_KEY}",
        f"region={server.region}",
        "part_bytes=5242880",
    ]
    return [word for option in options for word in (flag, option)]


def test_credentials_of_digits_reach_s3_as_text(
    numeric_server: SeaweedFS, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique("digits")
    numeric_server.client().put_object(Bucket=NUMBERS, Key=f"{prefix}/a.bin", Body=b"abc")
    url = f"s3://{NUMBERS}/{prefix}"
    assert main(["ls", url, *numeric_options(numeric_server), "--json"]) == 0, capsys.readouterr()
    listed = json.loads(capsys.readouterr().out)
    assert [o["key"] for o in listed["objects"]] == ["a.bin"]
    # cp's --dst-option is read the same way.
    checkpoint = tmp_path / "model.ckpt"
    weights = torch.arange(1000, dtype=torch.float32)
    asyncstore.torch.save({"w": weights}, str(checkpoint))
    to_s3 = numeric_options(numeric_server, "--dst-option")
    assert main(["cp", str(checkpoint), f"{url}/", *to_s3]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert SECRET_KEY not in out
    options = {"endpoint_url": numeric_server.endpoint_url, "region": numeric_server.region}
    options |= {"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY}
    loaded = asyncstore.torch.load(f"{url}/model.ckpt", store_options=options)
    assert torch.equal(loaded["w"], weights)


@pytest.mark.parametrize(
    ("url", "given", "expected"),
    [
        (
            "s3://bucket/prefix",
            [
                "aws_access_key_id=12345",
                "aws_secret_access_key=0042",
                "region=2024",
                "part_bytes=5242880",
                "max_attempts=7",
                "create=true",
                "retry_base_delay=1",
            ],
            {
                "aws_access_key_id": "12345",
                "aws_secret_access_key": "0042",
                "region": "2024",
                "part_bytes": 5242880,
                "max_attempts": 7,
                "create": True,
                "retry_base_delay": 1.0,
            },
        ),
        ("s3://bucket", ["create=false", "endpoint_url=http://127.0.0.1:1"], {"create": False}),
        ("local", ["fsync=false", "max_inflight=4"], {"fsync": False, "max_inflight": 4}),
    ],
    ids=["s3", "s3-false", "local"],
)
def test_each_value_is_read_as_the_type_of_its_option(
    url: str, given: list[str], expected: dict[str, Any], tmp_path: Path
) -> None:
    if url == "local":
        url = str(tmp_path / "store")
    argv = ["ls", url]
    for option in given:
        argv += ["-o", option]
    args = parser().parse_args(argv)
    options = store_options(args, url)
    for name, value in expected.items():
        assert options[name] == value
        assert type(options[name]) is type(value), name
    # What the command line passes on is what the Python API, strict, takes.
    store = open_store(url, **options)
    assert isinstance(store, S3Store | LocalStore)
    config = store.config
    for name, value in expected.items():
        assert getattr(config, name) == value
        assert type(getattr(config, name)) is type(value), name


def test_a_value_that_is_not_of_its_type_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = str(tmp_path / "store")
    s3 = f"s3://{BUCKET}/{unique('bad')}"
    assert main(["ls", local, "-o", "max_inflight=lots"]) == 1
    one_line_error(capsys, "asyncstore: max_inflight='lots': expected an int", "file://")
    assert main(["ls", s3, "-o", "part_bytes=5MiB"]) == 1
    one_line_error(capsys, "part_bytes='5MiB': expected an int", s3)
    assert main(["verify", s3, "-o", "create=yes"]) == 1
    one_line_error(capsys, "create='yes': expected true or false")
    assert main(["ls", s3, "-o", "retry_max_delay=soon"]) == 1
    one_line_error(capsys, "retry_max_delay='soon': expected a number")
    # cp's destination options, and the demo's, are read the same way.
    source = tmp_path / "model.ckpt"
    asyncstore.torch.save({"w": torch.zeros(3)}, str(source))
    assert main(["cp", str(source), s3, "--dst-option", "max_inflight=many"]) == 1
    one_line_error(capsys, "max_inflight='many': expected an int")
    demo = ["demo", "--dir", str(tmp_path / "demo"), "--url", local, "--option", "fsync=maybe"]
    assert main(demo) == 1
    one_line_error(capsys, "fsync='maybe': expected true or false")
    # A misspelt credential: the closest option is named, the value never shown.
    assert main(["ls", s3, "-o", "aws_secret_acess_key=0042abc"]) == 1
    err = one_line_error(capsys, "aws_secret_acess_key", "did you mean 'aws_secret_access_key'")
    assert "0042abc" not in err
