"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncstore.checkpoint import staging_pool

from .helpers import CHUNK


@pytest.fixture(autouse=True)
def give_staging_back() -> Iterator[None]:
    """Free the staging pool of ``CHUNK`` slabs after each test: the pool of a chunk size is
    shared by the process, and later tests (in any order) measure what it allocates."""
    yield
    staging_pool(CHUNK).trim()
