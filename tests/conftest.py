"""Shared fixtures: the SeaweedFS server the session starts, and one store per kind."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import asyncstore
from asyncstore.stores import drop_memory_store
from asyncstore.testing import FaultProxy, SeaweedFS

from .helpers import write_samples

BUCKET = "asyncstore-tests"
MiB = 1 << 20

STORE_KINDS = ["memory", "local", "s3"]


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    """The dataset tests' small dataset (``tests.helpers.SAMPLE_KEYS``) in a local directory."""
    return write_samples(tmp_path / "data")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    # aiobotocore runs on asyncio only.
    return "asyncio"


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One real S3 server for the whole session, on free loopback ports."""
    server = SeaweedFS(data_dir=tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop(timeout=2.0)


@pytest.fixture
def fresh_bucket(seaweedfs: SeaweedFS) -> str:
    """A new, empty bucket on the session's server, for one test alone: what the test finds
    in it (objects, unfinished multipart uploads) is its own doing, whatever other tests
    leave in the shared ``BUCKET``."""
    name = unique("bucket")
    seaweedfs.create_bucket(name)
    return name


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Iterator[FaultProxy]:
    """A fault-injecting TCP proxy in front of the session's server, for one test."""
    with FaultProxy("127.0.0.1", seaweedfs.s3_port) as running:
        yield running


def s3_options(server: SeaweedFS, **overrides: Any) -> dict[str, Any]:
    """Options that reach ``server`` directly, with a small part size to exercise multipart."""
    options = server.store_options(part_bytes=5 * MiB)
    options.update(overrides)
    return options


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def store_url(kind: str, tmp_path: Path) -> str:
    if kind == "memory":
        return f"memory://{unique()}"
    if kind == "local":
        return str(tmp_path / "store")
    return f"s3://{BUCKET}/{unique()}"


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def open_kind(request: pytest.FixtureRequest, store_kind: str, tmp_path: Path) -> Iterator[Any]:
    """A factory ``open_kind(**options)`` opening a fresh store of the parametrized kind."""
    opened: list[str] = []

    def factory(url: str | None = None, **options: Any) -> asyncstore.Store:
        url = url or store_url(store_kind, tmp_path)
        if store_kind == "s3":
            server: SeaweedFS = request.getfixturevalue("seaweedfs")
            options = s3_options(server, **options)
        opened.append(url)
        return asyncstore.open_store(url, **options)

    yield factory
    for url in opened:
        if url.startswith("memory://"):
            drop_memory_store(url.removeprefix("memory://").split("/")[0])


@pytest.fixture
async def store(open_kind: Any) -> AsyncIterator[asyncstore.Store]:
    """A fresh, empty store of each kind (memory, local directory, SeaweedFS)."""
    async with open_kind() as opened:
        yield opened


def pytest_report_header() -> str:
    return f"asyncstore {asyncstore.__version__}, {os.cpu_count()} CPUs"


# Fixtures that start or reach the SeaweedFS server; names a test module imports when it
# starts processes (ranks, CLI runs, workers).
_S3_FIXTURES = frozenset({"seaweedfs", "proxy", "fresh_bucket"})
_PROCESS_NAMES = ("spawn_ranks", "subprocess", "multiprocessing")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by what it uses, so that ``pytest -m "not slow"`` is the inner loop:
    ``s3`` (the server, by fixture or an ``"s3"`` parameter), ``processes`` (its module
    starts processes) and ``slow`` (either, or a timeout above the default)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = {str(v) for v in callspec.params.values()} if callspec is not None else set()
        s3 = (
            bool(_S3_FIXTURES & set(getattr(item, "fixturenames", ())))
            or "s3" in params
            or item.get_closest_marker("s3") is not None
        )
        module = getattr(item, "module", None)
        processes = module is not None and any(n in vars(module) for n in _PROCESS_NAMES)
        timeout = item.get_closest_marker("timeout")
        long = timeout is not None and bool(timeout.args) and timeout.args[0] > 120
        if s3 and item.get_closest_marker("s3") is None:
            item.add_marker(pytest.mark.s3)
        if processes:
            item.add_marker(pytest.mark.processes)
        if s3 or processes or long:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["local", "s3"])
def run_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    """A checkpoint run's URL and store options: a local directory, then an S3 prefix."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    server: SeaweedFS = request.getfixturevalue("seaweedfs")
    return f"s3://{BUCKET}/{unique('run')}", s3_options(server)
