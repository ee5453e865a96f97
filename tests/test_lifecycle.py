"""The lifecycle every closeable component shares (asyncstore._resource.AsyncResource):
open once, close idempotently and to the end, refuse use after close, warn when leaked."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

import asyncstore
from asyncstore import Prefetcher, StoreClosed
from asyncstore._resource import AsyncResource
from asyncstore.cache import TieredCache
from asyncstore.stores import MemoryStore

from .conftest import unique

pytestmark = pytest.mark.anyio


class Counting(AsyncResource):
    def __init__(self) -> None:
        self.opened = 0
        self.closed_fully = False

    async def _on_open(self) -> None:
        self.opened += 1
        await asyncio.sleep(0.01)

    async def _on_close(self) -> None:
        await asyncio.sleep(0.05)
        self.closed_fully = True


async def test_concurrent_first_uses_open_once_and_close_is_idempotent() -> None:
    resource = Counting()
    await asyncio.gather(*(resource._ensure_open() for _ in range(5)))
    assert resource.opened == 1
    await resource.aclose()
    await resource.aclose()
    assert resource.closed
    assert resource.closed_fully
    with pytest.raises(StoreClosed, match="this Counting is closed; create a new one"):
        await resource.__aenter__()


async def test_a_cancelled_close_still_finishes_its_cleanup() -> None:
    resource = Counting()
    async with resource:
        pass
    resource = Counting()
    await resource._ensure_open()
    task = asyncio.ensure_future(resource.aclose())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert resource.closed_fully


async def test_a_failed_open_can_be_tried_again() -> None:
    class Flaky(AsyncResource):
        attempts = 0

        async def _on_open(self) -> None:
            self.attempts += 1
            if self.attempts == 1:
                raise OSError("not yet")

    resource = Flaky()
    with pytest.raises(OSError, match="not yet"):
        await resource._ensure_open()
    assert not resource.closed
    await resource._ensure_open()
    assert resource.attempts == 2
    await resource.aclose()


async def test_use_after_close_names_the_component() -> None:
    store = MemoryStore(f"memory://{unique()}")
    await store.put("k", b"v")
    cache = TieredCache(store, memory_bytes=1 << 20)
    async with cache:
        assert await cache.get("k") == b"v"
    with pytest.raises(StoreClosed, match="TieredCache is closed"):
        await cache.get("k")
    prefetcher = Prefetcher(store, ["k"])
    await prefetcher.aclose()
    with pytest.raises(StoreClosed, match="Prefetcher is closed"):
        await prefetcher.__aenter__()
    reader = store.open_reader("k")
    assert [chunk async for chunk in reader] == [b"v"]
    with pytest.raises(StoreClosed, match=r"reader for memory://.*/k is closed; open a new"):
        await reader.__anext__()
    await store.aclose()
    with pytest.raises(StoreClosed, match="is closed; open a new store with open_store"):
        await store.get("k")


async def test_a_prefetcher_dropped_with_fetches_in_flight_warns() -> None:
    store = MemoryStore(f"memory://{unique()}")
    for i in range(8):
        await store.put(f"k{i}", b"x" * 100)
    prefetcher = Prefetcher(store, [f"k{i}" for i in range(8)], lookahead=4)
    assert (await prefetcher.__anext__())[0] == "k0"  # the window now holds fetches
    await asyncio.sleep(0.01)  # they end (a running task keeps its prefetcher alive)
    with pytest.warns(ResourceWarning, match="this Prefetcher was not closed"):
        del prefetcher
        gc.collect()


async def test_a_prefetcher_read_to_the_end_closes_itself(recwarn: pytest.WarningsRecorder) -> None:
    store = MemoryStore(f"memory://{unique()}")
    await store.put("a", b"1")
    prefetcher = Prefetcher(store, ["a"])
    assert [key async for key, _ in prefetcher] == ["a"]
    assert prefetcher.closed
    del prefetcher
    gc.collect()
    assert [str(w.message) for w in recwarn if issubclass(w.category, ResourceWarning)] == []


async def test_writer_aclose_discards_an_open_write(tmp_path: Path) -> None:
    async with asyncstore.open_store(tmp_path.as_uri()) as store:
        writer = store.open_writer("w")
        async with writer:
            await writer.write(b"partial")
            await writer.aclose()  # give up: nothing may appear under the key
            with pytest.raises(StoreClosed, match=r"writer for .* is aborted"):
                await writer.write(b"more")
        assert writer.info is None
        with pytest.raises(asyncstore.NotFound):
            await store.get("w")
        assert list(tmp_path.iterdir()) == []  # no temp file left either
        assert "aborted" in repr(writer)

        committed = store.open_writer("c")
        async with committed:
            await committed.write(b"whole")
        await committed.aclose()  # harmless after the block
        assert await store.get("c") == b"whole"
        assert "committed" in repr(committed)
