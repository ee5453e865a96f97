"""The cache tests' source: a real memory store that counts the reads reaching it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from asyncstore import StoreError
from asyncstore.stores import MemoryStore, drop_memory_store

from ..conftest import unique

KiB = 1 << 10


class CountingStore(MemoryStore):
    """A real memory store that counts the reads reaching it, and can be slowed or broken."""

    def __init__(self) -> None:
        super().__init__(unique("counting"))
        self.gets: list[tuple[str, int, int | None]] = []
        self.delay = 0.0
        self.fail: Exception | None = None
        # Fail fast, instead of hanging the suite, if a read makes far more GETs than it
        # should (a range not clipped to the object once made one per block of 2**63).
        self.max_gets = 10_000

    async def _get(self, key: str, start: int, end: int | None) -> bytes:
        self.gets.append((key, start, end))
        if len(self.gets) > self.max_gets:
            raise StoreError(f"{len(self.gets)} GETs reached the store: far too many")
        if self.fail is not None:
            await anyio.sleep(self.delay)
            raise self.fail
        # Read, then wait: like a server that answered and a network that is slow.
        data = await super()._get(key, start, end)
        await anyio.sleep(self.delay)
        return data


@pytest.fixture
async def source() -> AsyncIterator[CountingStore]:
    store = CountingStore()
    for i in range(20):
        await store.put(f"obj/{i:03d}", bytes([i]) * (10 * KiB))
    yield store
    drop_memory_store(store.url.removeprefix("memory://"))
