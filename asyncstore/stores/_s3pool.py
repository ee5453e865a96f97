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

No I/O happens under the pool's lock (the shape of httpcore's connection pool): the locked
part, :func:`_assign`, only reads and changes the pool and returns the I/O still to do, as
tasks: making the client (credentials may come from a process, a metadata server or SSO),
and the signed GET path of each bucket. Every store that wants the same client or bucket
waits on the same task; a store that stops waiting (cancelled, or closed meanwhile) leaves
it running for the others, and the pool keeps what it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from .._concurrency import (
    ExitStep,
    TaskSet,
    after_fork_in_child,
    at_exit,
    forget_errors,
    shield,
    wait_shared,
)
from ._s3client import open_client, open_signed
from ._s3fast import SignedRequests

if TYPE_CHECKING:
    from ._s3config import S3Config

__all__ = ["Lease", "acquire", "release", "release_elsewhere"]


class Lease:
    """A pooled client: what a store uses while it holds it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[Any, ...]) -> None:
        self.loop, self.key = loop, key
        self.cm: Any = None  # the client's context manager, once made
        self.client: Any = None
        self.opening: asyncio.Task[SignedRequests] | None = None  # makes the client
        self.signers: dict[
            str, asyncio.Task[SignedRequests]
        ] = {}  # the fast path (signed GETs and PUTs), per bucket
        self.refs = 0
        self.closed = False  # no store takes it any more
        self.shut = False  # its client and paths are being closed, or are
        self.holder: AsyncGenerator[None, None] | None = None


_POOL: dict[tuple[Any, ...], Lease] = {}
# Guards the pool's dict against the loops of other threads (the sync bridge's beside a
# caller's asyncio.run). Held only around plain reads and writes: never across an await.
_POOL_LOCK = threading.Lock()
_TASKS = TaskSet("the S3 client pool")
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
) -> tuple[Lease, Any, SignedRequests]:
    """A lease on the client for these options on the running loop, made if needed; give
    it back with :func:`release`.

    Raises:
        NoCredentials, StoreError: as :func:`~._s3client.open_client`.
    """
    loop = asyncio.get_running_loop()
    key = (loop, *_key(config, endpoint))
    while True:
        lease, getter = _assign(loop, key, config, endpoint, bucket, url)
        try:
            fast = await wait_shared(getter)
        except BaseException:
            lease.refs -= 1
            raise
        if not lease.closed:
            return lease, lease.client, fast
        lease.refs -= 1  # closed while it was being made (the loop is ending): a new one


def _assign(
    loop: asyncio.AbstractEventLoop,
    key: tuple[Any, ...],
    config: S3Config,
    endpoint: str | None,
    bucket: str,
    url: str,
) -> tuple[Lease, asyncio.Task[SignedRequests]]:
    """Take a reference on the lease for ``key`` and return it with the task that makes its
    ``bucket`` usable, starting what is missing. Decides only: no await, so no I/O, in here.

    Cases: (1) no usable lease: a new one, and the task that makes its client and the first
    bucket's GET path; (2) a lease without this bucket: the task that adds its GET path once
    the client is made; (3) a lease with it: the task already running or done.
    """
    with _POOL_LOCK:
        for stale in [k for k, lease in _POOL.items() if lease.loop.is_closed()]:
            _LEFT_BEHIND.append(_POOL.pop(stale))
        lease = _POOL.get(key)
        if lease is None or lease.closed:  # (1)
            lease = _POOL[key] = Lease(loop, key)
            opening = _TASKS.spawn(_open(lease, config, endpoint, bucket, url), name=f"open {url}")
            opening.add_done_callback(_retrieved)
            lease.opening = lease.signers[bucket] = opening
        elif bucket not in lease.signers:  # (2)
            adding = _TASKS.spawn(_add_bucket(lease, config, bucket, url), name=f"open {url}")
            adding.add_done_callback(_retrieved)
            lease.signers[bucket] = adding
        lease.refs += 1
        return lease, lease.signers[bucket]


def _retrieved(task: asyncio.Task[Any]) -> None:
    # Its waiters get its error; when all of them stopped waiting, nobody reads it, which
    # asyncio would log as never retrieved.
    forget_errors([task])


async def _open(
    lease: Lease, config: S3Config, endpoint: str | None, bucket: str, url: str
) -> SignedRequests:
    fast: SignedRequests | None = None
    try:
        lease.cm, lease.client, fast = await open_client(config, endpoint, bucket, url)
        holder = _hold(lease)
        await holder.__anext__()
        lease.holder = holder
    except BaseException:
        _drop(lease)  # the next store tries again
        if fast is not None:  # made, then cancelled: closed, not left open
            await shield(fast.aclose())
        cm, lease.cm = lease.cm, None
        if cm is not None:
            await shield(cm.__aexit__(None, None, None))
        raise
    return fast


async def _add_bucket(lease: Lease, config: S3Config, bucket: str, url: str) -> SignedRequests:
    assert lease.opening is not None
    try:
        await wait_shared(lease.opening)
        return await open_signed(lease.client, config, bucket, url)
    except BaseException:
        with _POOL_LOCK:
            if lease.signers.get(bucket) is asyncio.current_task():
                del lease.signers[bucket]  # the next store of this bucket tries again
        raise


def _drop(lease: Lease) -> None:
    lease.closed = True
    with _POOL_LOCK:
        if _POOL.get(lease.key) is lease:
            del _POOL[lease.key]


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
    if lease.shut:
        return
    lease.shut = True
    _drop(lease)  # decided first: no store takes it from here on
    holder, lease.holder = lease.holder, None
    try:
        # What is still being made for it is finished first, then closed with the rest.
        tasks = set(lease.signers.values())
        if lease.opening is not None:
            tasks.add(lease.opening)
        tasks.discard(asyncio.current_task())
        pending = [task for task in tasks if not task.done()]
        if pending:
            await shield(asyncio.wait(pending))
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().aclose()
        cm, lease.cm = lease.cm, None
        if cm is not None:
            await cm.__aexit__(None, None, None)
    finally:
        if holder is not None:
            await holder.aclose()  # finishes at once: the lease is closed already


def _close_idle_at_exit() -> None:
    global _exiting
    _exiting = True
    with _POOL_LOCK:
        leases = list(_POOL.values())
    for lease in leases:
        loop = lease.loop
        if lease.refs > 0 or loop.is_closed() or not loop.is_running():
            continue
        future = asyncio.run_coroutine_threadsafe(_close(lease), loop)
        with contextlib.suppress(Exception):  # exiting: a client that will not close is dropped
            future.result(timeout=5)


def _forget() -> None:
    global _POOL_LOCK, _TASKS
    _POOL_LOCK = threading.Lock()  # another thread may have held it at the fork
    _LEFT_BEHIND.extend(_POOL.values())
    _POOL.clear()
    _TASKS = TaskSet("the S3 client pool")  # the parent's tasks belong to the parent's loop


after_fork_in_child(_forget)
# In the step of pending saves: idle clients close now, and those of saves still running as
# soon as their store gives them back.
at_exit(ExitStep.FINISH_SAVES, _close_idle_at_exit)
