"""Fixtures of the store tests: one fault proxy a module, reset around each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncstore.testing import FaultProxy, SeaweedFS

# Fast retries keep the suite quick; the policy under test is the same.
FAST = {"retry_base_delay": 0.01, "retry_max_delay": 0.05, "max_attempts": 4}


@pytest.fixture(scope="module")
def module_proxy(seaweedfs: SeaweedFS) -> Iterator[FaultProxy]:
    """A fault-injecting TCP proxy in front of the session's server, one for all of a
    module's tests; take it through :func:`faults`, which resets it around each test."""
    with FaultProxy("127.0.0.1", seaweedfs.s3_port) as running:
        yield running


@pytest.fixture
def faults(module_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The module's fault proxy, with no fault armed and its counters at zero, before and
    after the test."""
    module_proxy.reset()
    yield module_proxy
    module_proxy.reset()
