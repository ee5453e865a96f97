"""What an S3 store's operations, readers and writers share: :class:`S3StoreBase`, the
client's lifetime and the request plumbing (slots, retries, error translation).

It sits below :mod:`.s3` (the operations), :mod:`._s3read` and :mod:`._s3write`, which all
build on it, so that imports go one way: ``s3`` → ``_s3read``/``_s3write`` → ``_s3base`` →
``_s3pool`` → ``_s3client`` → ``_s3fast``/``_s3responses``/``_s3config``.

No I/O happens under a lock here either: a store's first request starts the connection (a
lease from :mod:`._s3pool`) and the bucket check in tasks of the store's own, which every
concurrent request awaits; closing the store stops waiting for them instead of waiting
behind them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import msgspec
from botocore import exceptions as bex

from .._concurrency import TaskSet, forget_errors, shield, wait_shared, with_retries
from ..errors import AsyncStoreError, NotFound, PermissionDenied, StoreError, StoreUnavailable
from . import _s3pool
from ._basestore import BaseStore
from ._s3client import NoCredentials, no_credentials_message, resolved_endpoint
from ._s3config import S3Config
from ._s3fast import S3HTTPError, SignedRequests
from ._s3responses import (
    DENIED_CODES,
    NOT_FOUND_CODES,
    Precondition,
    describe,
    error_code,
    retryable,
)
from ._streams import BaseWriter

__all__ = ["S3StoreBase"]

_T = TypeVar("_T")


class S3StoreBase(BaseStore):
    """The half of :class:`~asyncstore.S3Store` that its operations, readers and writers
    share: the bucket, the options, the client and the request plumbing."""

    def __init__(self, bucket: str, prefix: str = "", config: S3Config | None = None) -> None:
        super().__init__(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")
        self._bucket = bucket
        self._root = f"{prefix}/" if prefix else ""
        self._config = config or S3Config()
        self._endpoint = resolved_endpoint(self._config)
        self._slots = asyncio.Semaphore(self._config.max_inflight)
        self._client: Any = None
        self._lease: _s3pool.Lease | None = None
        self._fast: SignedRequests | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        # The I/O that every request waits for before its first: the lease on a client and
        # the bucket check, each run once, in a task that concurrent requests share.
        self._tasks = TaskSet(f"the store {self.url}")
        self._connecting: asyncio.Task[Any] | None = None
        self._checking: asyncio.Task[None] | None = None
        # Whether the bucket is known to exist: checked (and created) once with create=True,
        # and once on the first missing key, to tell a missing bucket from a missing key.
        self._bucket_exists = False
        # Writers still open: aclose() aborts their uploads while it still has a client.
        self._writers: weakref.WeakSet[BaseWriter] = weakref.WeakSet()

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket

    @property
    def config(self) -> S3Config:
        """The store's options (secrets are masked in its repr)."""
        return self._config

    @property
    def endpoint_url(self) -> str | None:
        """The endpoint in use, ``None`` for AWS's default."""
        return self._endpoint

    @property
    def identity(self) -> str:
        """See :attr:`Store.identity`: the URL and the endpoint, since one bucket name can
        name different buckets on different servers."""
        return f"{self.url} at {self._endpoint or 'AWS'}"

    @property
    def remote(self) -> bool:
        """``True``: every byte crosses the network (see :attr:`Store.remote`)."""
        return True

    def reopen_args(self) -> tuple[str, dict[str, Any]]:
        """The URL and the store's options (credentials included, as they were given)."""
        return self.url, msgspec.structs.asdict(self._config)

    # -- client ------------------------------------------------------------------------------

    async def _on_open(self) -> None:
        try:
            await self._get_client()
        except BaseException:
            # 'async with' failed (creating the bucket, say): no aclose() will follow, so
            # let go of the client here. Used again, the store makes a new one.
            await shield(self._release_client())
            raise

    async def _get_client(self, key: str = "") -> Any:
        client = self._client
        if client is None:
            client = await self._shared(key, "_connecting", self._connect)
        elif self._client_loop is not asyncio.get_running_loop():
            raise self._wrong_loop()
        if self._config.create and not self._bucket_exists:
            await self._shared(key, "_checking", lambda key: self._check_bucket(client))
        return client

    async def _shared(self, key: str, slot: str, start: Callable[[str], Awaitable[_T]]) -> _T:
        """Await the task in ``slot``, started with ``start(key)`` by the first caller.

        A caller that is cancelled stops waiting and leaves the task to the others; when the
        store is closed meanwhile, the task is cancelled, and its waiters get StoreClosed.
        """
        self._check_open()
        task: asyncio.Task[_T] | None = getattr(self, slot)
        if task is None:
            task = self._tasks.spawn(self._clearing(slot, start(key)), name=slot.strip("_"))
            setattr(self, slot, task)
        elif task.get_loop() is not asyncio.get_running_loop():
            raise self._wrong_loop()
        try:
            return await wait_shared(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise self._closed_error() from None
            raise

    async def _clearing(self, slot: str, work: Awaitable[_T]) -> _T:
        # Done, the slot empties: after a failure the next request tries again.
        try:
            return await work
        finally:
            if getattr(self, slot) is asyncio.current_task():
                setattr(self, slot, None)

    async def _connect(self, key: str) -> Any:
        try:
            lease, client, fast = await _s3pool.acquire(
                self._config, self._endpoint, self._bucket, self.url
            )
        except NoCredentials as exc:
            where = self.where(key) if key else self.url
            raise PermissionDenied(no_credentials_message(where, self._endpoint)) from exc
        self._lease, self._client, self._fast = lease, client, fast
        self._client_loop = asyncio.get_running_loop()
        return client

    async def _check_bucket(self, client: Any) -> None:
        await self._create_bucket(client)
        self._bucket_exists = True

    async def _create_bucket(self, client: Any) -> None:
        """Create the bucket unless it exists (``create=True``); idempotent across processes.

        Raises:
            PermissionDenied: the credentials may not create buckets.
            StoreError: the name belongs to another account.
        """
        if await self._bucket_found(client):
            return

        async def create(client: Any) -> None:
            region = getattr(client.meta, "region_name", None)
            extra: dict[str, Any] = {}
            if self._endpoint is None and region and region != "us-east-1":
                # AWS wants the region spelt out everywhere but in us-east-1.
                extra["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:
                await client.create_bucket(Bucket=self._bucket, **extra)
            except bex.ClientError as exc:
                if error_code(exc)[0] != "BucketAlreadyOwnedByYou":
                    raise  # created meanwhile by another process: what was asked for

        server = self._endpoint or "AWS"
        try:
            await self._call_with(client, "", "create bucket", create)
        except PermissionDenied as exc:
            raise PermissionDenied(
                f"{self.url}: not allowed to create bucket {self._bucket!r} at {server} "
                f"({exc}); create it with credentials that may (s3:CreateBucket), or ask its "
                "owner to"
            ) from exc
        except StoreError as exc:
            if "BucketAlreadyExists" not in str(exc) or await self._bucket_found(client):
                raise
            raise StoreError(
                f"{self.url}: bucket name {self._bucket!r} is taken by another account at "
                f"{server}; choose another name"
            ) from exc

    async def _bucket_found(self, client: Any) -> bool | None:
        """Whether the bucket exists (HEAD); ``None`` when the HEAD is denied."""

        async def head(client: Any) -> None:
            await client.head_bucket(Bucket=self._bucket)

        try:
            await self._call_with(client, "", "check bucket", head)
        except NotFound:
            return False
        except PermissionDenied:
            return None
        return True

    def _missing_bucket(self, key: str) -> NotFound:
        what = f" (asked for {self.where(key)})" if key else ""
        return NotFound(
            f"bucket {self._bucket!r} does not exist at {self._endpoint or 'AWS'}{what}: it is "
            "the bucket that is missing, not the key. Check its name, or create it: "
            f"open_store({self.url!r}, create=True, ...) creates it on first use"
        )

    def _wrong_loop(self) -> StoreError:
        # Not recreated on the new loop: the old client's connections belong to the old loop
        # (closed, typically, by asyncio.run) and could only be leaked, not closed.
        return StoreError(
            f"{self.url} was first used on another event loop, and its connections belong to "
            "that loop (one asyncio.run() per store); open the store inside the loop that "
            "uses it ('async with open_store(...)' in each asyncio.run), or open one per loop"
        )

    async def _on_close(self) -> None:
        # A writer left open would otherwise keep its multipart upload (and its stored parts)
        # forever: with the client gone, its own abort could not reach S3. Then the client
        # goes back: one being leased right now is not waited for (the pool finishes it for
        # the next store); one requested after this point is refused, as the store is
        # already marked closed.
        for writer in list(self._writers):
            await writer.abort_now()
        await self._release_client()

    async def _release_client(self) -> None:
        pending = [task for task in (self._connecting, self._checking) if task is not None]
        self._connecting = self._checking = None
        here = asyncio.get_running_loop()
        pending = [task for task in pending if task.get_loop() is here]
        for task in pending:
            task.cancel()
        if pending:
            await shield(asyncio.wait(pending))
            forget_errors(pending)  # their waiters got them, or are gone
        lease, self._client, self._lease, self._fast = self._lease, None, None, None
        if lease is None:
            return
        if self._client_loop is not here:
            # Closed from another loop: the connections cannot be touched from here
            # (their loop is usually closed already); only the lease is given back.
            _s3pool.release_elsewhere(lease)
            return
        # Shared with the other stores of the same options: the pool closes it.
        await _s3pool.release(lease)

    def _holds_resources(self) -> bool:
        return getattr(self, "_client", None) is not None

    # -- request plumbing -------------------------------------------------------------------

    def _replaced(self, key: str) -> StoreError:
        return StoreError(
            f"{self.where(key)} was replaced by another writer while it was being read (its "
            "ETag changed); nothing of the new version was mixed in: read it again"
        )

    def _error(self, exc: Exception, key: str, attempts: int = 1) -> Exception:
        where = self.where(key) if key else self.url
        if isinstance(exc, Precondition):
            return StoreError(f"{where} kept changing while it was read; retry when it is stable")
        if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
            return PermissionDenied(no_credentials_message(where, self._endpoint))
        code, status = error_code(exc)
        if code == "NoSuchBucket":
            return self._missing_bucket(key)
        if code in NOT_FOUND_CODES or status == 404:
            return NotFound(f"{where} does not exist")
        if code in DENIED_CODES or status == 403:
            return PermissionDenied(
                f"{where}: access denied ({describe(exc)}); check the credentials and the "
                "bucket policy"
            )
        if retryable(exc):
            return StoreUnavailable(
                f"{where}: the store failed {attempts} time(s) in a row, last with "
                f"{describe(exc)}; check that {self._endpoint or 'S3'} is reachable and healthy"
            )
        return StoreError(f"{where}: {describe(exc)}")

    async def _call(
        self, key: str, what: str, attempt: Callable[[Any], Awaitable[_T]], *, slot: bool = True
    ) -> _T:
        """Run ``attempt(client)`` with retries, inside a request slot, translating errors."""
        return await self._call_with(await self._get_client(key), key, what, attempt, slot=slot)

    async def _call_with(
        self,
        client: Any,
        key: str,
        what: str,
        attempt: Callable[[Any], Awaitable[_T]],
        *,
        slot: bool = True,
    ) -> _T:
        async def once() -> _T:
            if not slot:
                return await attempt(client)
            async with self._slots:
                return await attempt(client)

        cfg = self._config
        try:
            return await with_retries(
                once,
                max_attempts=cfg.max_attempts,
                base_delay=cfg.retry_base_delay,
                max_delay=cfg.retry_max_delay,
                retryable=retryable,
                exhausted=lambda exc, n: self._error(exc, key, n),
                what=f"{what} {self.where(key) if key else self.url}",
            )
        except AsyncStoreError:
            raise  # already translated (NotFound and PermissionDenied are OSErrors too)
        except (
            bex.BotoCoreError,
            bex.ClientError,
            S3HTTPError,
            aiohttp.ClientError,
            OSError,
        ) as exc:
            raise self._error(exc, key) from exc
