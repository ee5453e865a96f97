"""Fixtures of the torch adapter tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A place for checkpoints and files, and the store options that reach it: a local
    directory, then an S3 prefix on the session's server."""
    if request.param == "local":
        return str(tmp_path / "place"), {}
    server: SeaweedFS = request.getfixturevalue("seaweedfs")
    return f"s3://{BUCKET}/{unique('where')}", s3_options(server)
