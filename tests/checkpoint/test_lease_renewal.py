"""A lease's renewals: rewritten while held, stopped and awaited by release, and a renewal
that fails in a way nobody expects is logged, not left to surface nowhere."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import msgspec
import pytest

import asyncstore
from asyncstore.checkpoint._leases import Lease, LeaseHolder
from asyncstore.errors import NotFound
from asyncstore.stores import Store

pytestmark = pytest.mark.anyio


class Counting:
    """A store's put and delete, counting the puts; ``fail_from`` makes later puts raise."""

    def __init__(self, store: Store, fail_from: int | None = None) -> None:
        self.store, self.url, self.puts = store, store.url, 0
        self.fail_from = fail_from
        self.renewed = asyncio.Event()  # set at the third put: two renewals done

    async def put(self, key: str, data: bytes) -> Any:
        self.puts += 1
        if self.fail_from is not None and self.puts >= self.fail_from:
            self.renewed.set()
            raise RuntimeError("a renewal failed unexpectedly")
        if self.puts >= 3:
            self.renewed.set()
        return await self.store.put(key, data)

    async def delete(self, key: str) -> None:
        await self.store.delete(key)


def renewals() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "renew" in t.get_name()]


async def test_a_held_lease_is_renewed_and_release_stops_the_renewals() -> None:
    async with asyncstore.open_store("memory://lease-renewal") as store:
        counting = Counting(store)
        holder = LeaseHolder(cast(Store, counting), ["packs/x.pack"], ttl=0.03)
        await holder.hold()
        first = msgspec.msgpack.decode(await store.get(holder.key), type=Lease).renewed
        await asyncio.wait_for(counting.renewed.wait(), 30)
        later = msgspec.msgpack.decode(await store.get(holder.key), type=Lease).renewed
        assert later > first
        assert len(renewals()) == 1
        await holder.release()
        assert renewals() == []  # cancelled and awaited, not left behind
        with pytest.raises(NotFound):
            await store.get(holder.key)
        puts = counting.puts
        await asyncio.sleep(0.05)  # more than a renewal's interval: none comes
        assert counting.puts == puts


async def test_a_renewal_failing_unexpectedly_is_logged_and_release_still_removes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with asyncstore.open_store("memory://lease-renewal-fails") as store:
        counting = Counting(store, fail_from=2)
        holder = LeaseHolder(cast(Store, counting), ["packs/x.pack"], ttl=0.03)
        with caplog.at_level(logging.ERROR, logger="asyncstore"):
            await holder.hold()
            await asyncio.wait_for(counting.renewed.wait(), 30)
            running = renewals()
            if running:  # the failed renewal loop ends of itself
                await asyncio.wait(running, timeout=30)
        failed = [r for r in caplog.records if "renew" in r.getMessage()]
        assert len(failed) == 1
        assert holder.key in failed[0].getMessage()
        assert isinstance(failed[0].exc_info[1], RuntimeError)  # type: ignore[index]
        await holder.release()
        with pytest.raises(NotFound):
            await store.get(holder.key)
