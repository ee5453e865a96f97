"""Leases: what a save or an upload in flight will point into, visible to other processes.

A save writes its pack (and, while it runs, relies on the packs of the version it builds
on) before the version that names them commits. Until then nothing in the run says those
packs are needed, and another process's collection of unused packs would delete them: the
version would commit and never load. So before it creates anything, a save (or an upload
to a mirror) writes a *lease*, ``leases/<token>.lease``, naming the keys it will write or
point into, and removes it once the version naming them has committed (or the save
failed).

A collector lists the packs first, then the leases, then the versions: a pack in its
listing was created after its lease, so the lease is in the later listing unless it was
released, which happens only after the version naming the pack committed, so that version
is in the listing after. A lease holds while its writer may still be running:

- on the same machine (same host name and boot id), while a process of its pid with the
  same start time exists: a killed writer's lease is dead at once, whatever its age;
- elsewhere, until ``renewed + ttl``: the writer renews it every third of ``ttl`` while
  it runs, so a lease that has not been renewed for ``ttl`` belongs to a writer that is
  gone (or cut off from the store, where it can no longer commit anything).

Dead leases are removed by the collector; their keys are then ordinary leftovers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable

import msgspec

from .._concurrency import TaskSet
from ..errors import AsyncStoreError, NotFound
from ..stores import Store

__all__ = ["LEASES", "Lease", "LeaseHolder", "live_keys"]

logger = logging.getLogger("asyncstore.checkpoint")

LEASES = "leases/"
LEASE_TTL_SECONDS = 300.0
"""Five minutes: a writer on another machine that stopped renewing for this long is gone
(renewals come every 100 s, so a store that is slow for a minute costs nothing)."""


RELEASE_SECONDS = 5.0
"""How long removing a lease may take before it is left to end with its process."""


class Lease(msgspec.Struct, frozen=True):
    """One writer's claim on ``keys`` of a run (stored as msgpack)."""

    host: str
    boot: str  # the machine's boot id: a pid means nothing across reboots
    pid: int
    started: str  # the process's start time, as the kernel gives it ("" if unknown)
    renewed: float  # Unix seconds
    ttl: float
    keys: list[str]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    # Field 22 of /proc/<pid>/stat, after the command name (which may hold spaces).
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if ")" in stat else ""


_BOOT = _read("/proc/sys/kernel/random/boot_id")
_HOST = socket.gethostname()


def _alive(lease: Lease, now: float) -> bool:
    if lease.host == _HOST and lease.boot and lease.boot == _BOOT and lease.started:
        # This machine, since the same boot: the process itself says.
        return _start_time(lease.pid) == lease.started
    return lease.renewed + lease.ttl > now


async def live_keys(store: Store) -> tuple[set[str], int]:
    """The keys named by the live leases in ``store``, and how many dead leases were
    removed (leases that do not decode among them: nothing is claimed by those)."""
    keys: set[str] = set()
    removed = 0
    now = time.time()
    names = [info.key async for info in store.list(LEASES) if info.key.endswith(".lease")]
    for name in names:
        try:
            lease = msgspec.msgpack.decode(await store.get(name), type=Lease)
        except NotFound:
            continue  # released meanwhile
        except msgspec.DecodeError:
            lease = None
        if lease is not None and _alive(lease, now):
            keys.update(lease.keys)
        else:
            await store.delete(name)
            removed += 1
    return keys, removed


class LeaseHolder:
    """A lease held in one store: written by :meth:`hold`, renewed in the background while
    held, removed by :meth:`release`."""

    def __init__(self, store: Store, keys: Iterable[str], ttl: float = LEASE_TTL_SECONDS) -> None:
        self.store = store
        self.key = f"{LEASES}{secrets.token_hex(8)}.lease"
        self._keys = sorted(set(keys))
        self._ttl = ttl
        self._renewing = TaskSet(f"the lease {self.key}")

    def _encode(self) -> bytes:
        pid = os.getpid()
        lease = Lease(_HOST, _BOOT, pid, _start_time(pid), time.time(), self._ttl, self._keys)
        return msgspec.msgpack.encode(lease)

    async def hold(self) -> LeaseHolder:
        """Write the lease (before anything it names is created); start renewing it.
        Interrupted (cancelled, failed), the lease may be there or not: :meth:`release`
        removes it either way."""
        await self.store.put(self.key, self._encode())
        # Detached: nobody awaits the renewals; a failure the loop does not expect is logged
        # when it happens, and release() cancels and awaits the loop.
        self._renewing.spawn(self._renew(), name=f"renew {self.key}", detached=True)
        return self

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                await self.store.put(self.key, self._encode())
            except (AsyncStoreError, OSError) as exc:
                logger.warning(
                    "renewing the lease %s/%s failed (%s)", self.store.url, self.key, exc
                )

    async def release(self) -> None:
        """Stop renewing and remove the lease (once what it names is committed, or will
        never be). A failure to remove it is logged: the lease dies with its process."""
        await self._renewing.aclose()
        try:
            # Bounded: a stalled store must not hold up the close of a checkpointer. A
            # lease left behind dies with its process (or expires, seen from elsewhere).
            async with asyncio.timeout(RELEASE_SECONDS):
                await self.store.delete(self.key)
        except (AsyncStoreError, OSError, TimeoutError) as exc:
            logger.warning(
                "removing the lease %s/%s failed (%s); it ends with this process",
                self.store.url,
                self.key,
                exc or "timed out",
            )
