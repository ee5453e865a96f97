"""Fixtures of the torch adapter tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import close_datasets


@pytest.fixture(autouse=True)
def closed_datasets() -> Iterator[None]:
    """Datasets a test registered with ``closed_after_test`` are closed when it ends."""
    yield
    close_datasets()


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A place for checkpoints and files, and the store options that reach it: a local
    directory, then an S3 prefix on the session's server."""
    if request.param == "local":
        return str(tmp_path / "place"), {}
    server: SeaweedFS = request.getfixturevalue("seaweedfs")
    return f"s3://{BUCKET}/{unique('where')}", s3_options(server)
