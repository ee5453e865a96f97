"""S3 clients shared by the stores of a process: one per event loop, endpoint, credentials
and client settings.

Making a client costs tens of milliseconds (hundreds the first time), and a checkpoint save
to a URL opens a store of its own each time; the pool lets every store opened with the same
options use the same client and its warm connections. A store takes a lease when it first
needs the client and gives it back when it closes; the client stays open, idle, for the next
store, and is closed:

- when its event loop shuts down (``asyncio.run`` and ``asyncio.Runner`` close the loop's
  async generators first; each client is held by one, see :func:`_hold`), whatever its
  leases: its connections could not be used from another loop anyway;
- at interpreter exit, if idle (leases given back after that close it at once);
- never in a forked child, which inherited the parent's sockets: the child forgets the
  parent's clients (keeping them referenced, so that no finalizer touches the sockets) and
  makes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from .._concurrency import ExitStep, after_fork_in_child, at_exit
from ._s3client import open_client, open_getter
from ._s3fast import SignedGetter

if TYPE_CHECKING:
    from ._s3config import S3Config

__all__ = ["Lease", "acquire", "release"]


class Lease:
    """A pooled client: what a store uses while it holds it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[Any, ...], cm: Any) -> None:
        self.loop, self.key, self.cm = loop, key, cm
        self.client: Any = None
        self.getters: dict[str, SignedGetter] = {}  # the fast GET path, per bucket
        self.refs = 0
        self.closed = False
        self.holder: AsyncGenerator[None, None] | None = None


_POOL: dict[tuple[Any, ...], Lease] = {}
_LOCKS: dict[tuple[Any, ...], asyncio.Lock] = {}
# Clients inherited across fork or left by loops closed without shutting down their async
# generators: never used again, and kept referenced so that no finalizer runs on them.
_LEFT_BEHIND: list[Lease] = []
_exiting = False


def _secret_digest(value: str | None) -> str | None:
    # The key holds no secret in clear: it could surface in a debugger or a heap dump.
    return hashlib.sha256(value.encode()).hexdigest() if value is not None else None


def _key(config: S3Config, endpoint: str | None) -> tuple[Any, ...]:
    """What makes two clients interchangeable: where they go, as whom, and how."""
    return (
        endpoint,
        config.region,
        config.profile,
        config.aws_access_key_id,
        _secret_digest(config.aws_secret_access_key),
        _secret_digest(config.aws_session_token),
        config.max_inflight,
        config.connect_timeout,
        config.read_timeout,
        config.addressing_style,
    )


async def acquire(
    config: S3Config, endpoint: str | None, bucket: str, url: str
) -> tuple[Lease, Any, SignedGetter]:
    """A lease on the client for these options on the running loop, made if needed; give
    it back with :func:`release`.

    Raises:
        NoCredentials, StoreError: as :func:`~._s3client.open_client`.
    """
    loop = asyncio.get_running_loop()
    for key in [k for k, lease in _POOL.items() if lease.loop.is_closed()]:
        _LEFT_BEHIND.append(_POOL.pop(key))
        _LOCKS.pop(key, None)
    key = (loop, *_key(config, endpoint))
    lock = _LOCKS.setdefault(key, asyncio.Lock())
    async with lock:
        lease = _POOL.get(key)
        if lease is None or lease.closed:
            cm, client, fast = await open_client(config, endpoint, bucket, url)
            lease = Lease(loop, key, cm)
            lease.client = client
            lease.getters[bucket] = fast
            holder = _hold(lease)
            await holder.__anext__()
            lease.holder = holder
            _POOL[key] = lease
        elif bucket not in lease.getters:
            lease.getters[bucket] = await open_getter(lease.client, config, bucket, url)
        lease.refs += 1
        return lease, lease.client, lease.getters[bucket]


async def release(lease: Lease) -> None:
    """Give a lease back (on its own loop): the client stays for the next store, unless the
    interpreter is exiting."""
    lease.refs -= 1
    if lease.refs <= 0 and _exiting:
        await _close(lease)


def release_elsewhere(lease: Lease) -> None:
    """Give a lease back from another loop, where its connections cannot be touched."""
    lease.refs -= 1


async def _hold(lease: Lease) -> AsyncGenerator[None, None]:
    # Suspended here for the client's life: the loop closes it when it shuts down its async
    # generators (asyncio.run does, before closing the loop).
    try:
        yield
    finally:
        lease.holder = None
        await _close(lease)


async def _close(lease: Lease) -> None:
    if lease.closed:
        return
    lease.closed = True
    if _POOL.get(lease.key) is lease:
        del _POOL[lease.key]
        _LOCKS.pop(lease.key, None)
    holder, lease.holder = lease.holder, None
    try:
        for getter in lease.getters.values():
            await getter.aclose()
        await lease.cm.__aexit__(None, None, None)
    finally:
        if holder is not None:
            await holder.aclose()  # finishes at once: the lease is closed already


def _close_idle_at_exit() -> None:
    global _exiting
    _exiting = True
    for lease in list(_POOL.values()):
        loop = lease.loop
        if lease.refs > 0 or loop.is_closed() or not loop.is_running():
            continue
        future = asyncio.run_coroutine_threadsafe(_close(lease), loop)
        with contextlib.suppress(Exception):  # exiting: a client that will not close is dropped
            future.result(timeout=5)


def _forget() -> None:
    _LEFT_BEHIND.extend(_POOL.values())
    _POOL.clear()
    _LOCKS.clear()


after_fork_in_child(_forget)
# In the step of pending saves: idle clients close now, and those of saves still running as
# soon as their store gives them back.
at_exit(ExitStep.FINISH_SAVES, _close_idle_at_exit)
