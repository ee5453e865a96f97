"""``s3://bucket/prefix``: objects in any S3-compatible server, through aiobotocore.

Requests in flight are bounded by ``max_inflight``; every request is retried with backoff
(:mod:`._retry`) on throttling, server errors, timeouts and broken connections, and never on
other client errors. botocore's own retries are switched off so that one policy, with one
attempt count, governs everything.

Large transfers are split into ``part_bytes`` pieces: a ``get`` of a large object fetches its
ranges in parallel, pinned to one version of the object with ``If-Match``; a write becomes a
multipart upload with several parts in flight, aborted if anything fails.

This module owns the store (:class:`S3Store`): the client's lifetime, the request plumbing
and every operation but streaming. Beside it, :mod:`._s3config` holds its options
(:class:`S3Config`, importable without aiobotocore), :mod:`._s3client` creates clients,
:mod:`._s3responses` classifies answers and errors, :mod:`._s3write` uploads and
:mod:`._s3read` streams.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import anyio
import msgspec
from botocore import exceptions as bex

from .._concurrency import bounded_map, shield, with_retries
from ..errors import AsyncStoreError, NotFound, PermissionDenied, StoreError, StoreUnavailable
from . import _s3pool
from ._base import BaseReader, BaseStore, BaseWriter, ObjectInfo
from ._keys import check_key, check_prefix
from ._s3client import NoCredentials, no_credentials_message, resolved_endpoint
from ._s3config import S3Config
from ._s3fast import S3HTTPError, SignedGetter
from ._s3read import S3Reader
from ._s3responses import (
    DENIED_CODES,
    NOT_FOUND_CODES,
    Precondition,
    ShortBody,
    check_body,
    describe,
    error_code,
    object_info,
    retryable,
)
from ._s3write import S3Writer, payload

__all__ = ["S3Config", "S3Store"]

_T = TypeVar("_T")


class S3Store(BaseStore):
    """A store in an S3 bucket, under an optional prefix.

    Open it with ``open_store("s3://bucket/prefix", **options)``; see :class:`S3Config` for
    the options. The client connects on first use (or in ``async with``) and belongs to the
    event loop that used it first. Stores opened with the same endpoint, credentials and
    client settings on one event loop share one client; closing a store gives its share
    back, and the client stays open for the next store (see :mod:`._s3pool`).
    """

    def __init__(self, bucket: str, prefix: str = "", config: S3Config | None = None) -> None:
        super().__init__(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")
        self._bucket = bucket
        self._root = f"{prefix}/" if prefix else ""
        self._config = config or S3Config()
        self._endpoint = resolved_endpoint(self._config)
        self._slots = anyio.Semaphore(self._config.max_inflight)
        self._client: Any = None
        self._lease: _s3pool.Lease | None = None
        self._fast: SignedGetter | None = None
        self._client_lock = anyio.Lock()
        self._client_loop: asyncio.AbstractEventLoop | None = None
        # Whether the bucket is known to exist: checked (and created) once with create=True,
        # and once on the first missing key, to tell a missing bucket from a missing key.
        self._bucket_exists = False
        self._bucket_lock = anyio.Lock()
        # Writers still open: aclose() aborts their uploads while it still has a client.
        self._writers: weakref.WeakSet[S3Writer] = weakref.WeakSet()

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
        if self._client is not None:
            if self._client_loop is not asyncio.get_running_loop():
                raise self._wrong_loop()
            return self._client
        async with self._client_lock:
            self._check_open()
            if self._client is None:
                try:
                    lease, client, self._fast = await _s3pool.acquire(
                        self._config, self._endpoint, self._bucket, self.url
                    )
                except NoCredentials as exc:
                    where = self.where(key) if key else self.url
                    raise PermissionDenied(no_credentials_message(where, self._endpoint)) from exc
                self._lease, self._client = lease, client
                self._client_loop = asyncio.get_running_loop()
        if self._client_loop is not asyncio.get_running_loop():
            raise self._wrong_loop()  # created by another loop while this one waited
        client = self._client
        if self._config.create and not self._bucket_exists:
            async with self._bucket_lock:
                if not self._bucket_exists:
                    await self._create_bucket(client)
                    self._bucket_exists = True
        return client

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
        # forever: with the client gone, its own abort could not reach S3. Then, under the
        # lock: a client being created right now is finished first and closed here; one
        # requested after this point is refused, as the store is already marked closed.
        for writer in list(self._writers):
            await writer.abort_now()
        await self._release_client()

    async def _release_client(self) -> None:
        async with self._client_lock:
            lease, self._client, self._lease, self._fast = self._lease, None, None, None
            if lease is None:
                return
            if self._client_loop is not asyncio.get_running_loop():
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

    # -- get -----------------------------------------------------------------------------

    async def _range(
        self, key: str, start: int, end: int, etag: str | None
    ) -> tuple[bytes, int, str | None]:
        """Fetch ``[start, end)``; return the bytes, the object's size and its ETag."""

        async def attempt(_: Any) -> tuple[bytes, int, str | None]:
            assert self._fast is not None
            try:
                data, headers = await self._fast.get(self._root + key, start, end, etag)
            except S3HTTPError as exc:
                if exc.code == "InvalidRange" or exc.status == 416:
                    # The range starts at or past the end (or the object is empty): slicing
                    # semantics say b"". A missing key answers NoSuchKey instead, so the
                    # object does exist.
                    return b"", -1, None
                if exc.code == "PreconditionFailed" or exc.status == 412:
                    raise Precondition from exc
                raise
            tag = headers.get("ETag")
            content_range = headers.get("Content-Range")
            if content_range is None:
                # The server ignored Range and sent the whole object: check it from 0.
                total = check_body(len(data), 0, None, headers.get("Content-Length"))
                data = data[start:end]
            else:
                total = check_body(len(data), start, content_range, None)
                if start + len(data) != min(end, total):
                    # A consistent header can still promise less than was asked for.
                    raise ShortBody(
                        f"asked for bytes {start}-{end - 1}, got {content_range!r} of {total}"
                    )
            return data, total, tag.strip('"') if tag else None

        return await self._call(key, "get", attempt)

    async def get_pinned(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        """Bytes ``[start, end)`` of exactly the version ``etag`` (from :meth:`stat`).

        For a reader of several ranges of one object (the checkpoint loader): a concurrent
        overwrite then raises :class:`StoreError` saying so, instead of mixing two versions
        that only a checksum would catch, as "damaged".
        """
        self._check_open()
        return await self._get(check_key(key, self.url), start, end, pin=etag)

    async def _get(self, key: str, start: int, end: int | None, *, pin: str | None = None) -> bytes:
        if end is not None and start == end:
            await self._stat(key)  # an empty range still says whether the key exists
            return b""
        part = self._config.part_bytes
        for _ in range(3):
            first_end = start + part if end is None else min(end, start + part)
            try:
                data, total, etag = await self._range(key, start, first_end, pin)
            except Precondition as exc:
                raise self._replaced(key) from exc
            stop = total if end is None else min(end, total)
            if total < 0 or start + len(data) >= stop:
                return data
            # A large object: fetch the rest in parallel, all from the version the first
            # response came from (If-Match), so a concurrent overwrite cannot mix versions.
            offsets = range(start + len(data), stop, part)

            async def fetch(offset: int, etag: str | None = etag, stop: int = stop) -> bytes:
                piece, _, _ = await self._range(key, offset, min(offset + part, stop), etag)
                return piece

            try:
                # Every range at once: the store's request slots bound what is in flight.
                pieces = await bounded_map(fetch, offsets, limit=len(offsets), name="get range")
            except Precondition:
                if pin is not None:
                    raise self._replaced(key) from None
                continue  # overwritten mid-read: start again on the new version
            return b"".join([data, *pieces])  # each piece's length was checked in _range
        raise self._error(Precondition(), key)

    # -- put, stat, delete, list -------------------------------------------------------------

    async def _put(self, key: str, data: memoryview) -> ObjectInfo:
        if len(data) > self._config.part_bytes:
            writer = S3Writer(self, key)
            async with writer:
                await writer.write_in_place(data)
            assert writer.info is not None
            return writer.info
        body = _bytes(data)

        async def attempt(client: Any) -> dict[str, Any]:
            return dict(
                await client.put_object(
                    Bucket=self._bucket, Key=self._root + key, Body=payload(body)
                )
            )

        resp = await self._call(key, "put", attempt)
        info = object_info(key, {"ETag": resp.get("ETag")}, size=len(data))
        return msgspec.structs.replace(info, mtime=time.time())

    async def _stat(self, key: str) -> ObjectInfo:
        async def attempt(client: Any) -> ObjectInfo:
            head = await client.head_object(Bucket=self._bucket, Key=self._root + key)
            return object_info(key, head)

        try:
            return await self._call(key, "stat", attempt)
        except NotFound:
            # A HEAD answers a bare 404 for a missing bucket too: tell the two apart, once.
            if self._bucket_exists:
                raise
            if await self._bucket_found(await self._get_client(key)) is False:
                raise self._missing_bucket(key) from None
            self._bucket_exists = True
            raise

    async def _delete(self, key: str) -> None:
        async def attempt(client: Any) -> None:
            await client.delete_object(Bucket=self._bucket, Key=self._root + key)

        await self._call(key, "delete", attempt)

    async def abandoned_writes(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` that have unfinished multipart uploads.

        S3 cannot tell a killed writer's upload from a live one's: call
        :meth:`clean_up_writes` on these keys only when no other writer of them can be
        running.
        """
        prefix = check_prefix(prefix, self.url)
        self._check_open()
        full = self._root + prefix
        keys: set[str] = set()
        markers: dict[str, str] = {}
        while True:

            async def listing(client: Any, markers: dict[str, str] = markers) -> dict[str, Any]:
                return dict(
                    await client.list_multipart_uploads(Bucket=self._bucket, Prefix=full, **markers)
                )

            page = await self._call(prefix, "list uploads", listing)
            keys.update(u["Key"][len(self._root) :] for u in page.get("Uploads", ()))
            if not page.get("IsTruncated"):
                return sorted(keys)
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }

    async def clean_up_writes(self, key: str) -> int:
        """Abort every unfinished multipart upload of ``key``; returns how many there were.

        A writer killed mid-upload (SIGKILL, a lost machine) cannot abort its own upload, and
        its parts are stored, unseen and billed, until something aborts it. Call this before
        writing ``key`` again — the checkpoint engine does — when no other writer of ``key``
        can be running. (An ``AbortIncompleteMultipartUpload`` lifecycle rule on the bucket
        is the catch-all.)
        """
        key = check_key(key, self.url)
        self._check_open()
        full = self._root + key

        uploads: list[str] = []
        markers: dict[str, str] = {}
        while True:  # every page: a busy prefix can hold more than 1000 uploads

            async def listing(client: Any, markers: dict[str, str] = markers) -> dict[str, Any]:
                return dict(
                    await client.list_multipart_uploads(Bucket=self._bucket, Prefix=full, **markers)
                )

            page = await self._call(key, "list uploads", listing)
            uploads += [u["UploadId"] for u in page.get("Uploads", ()) if u.get("Key") == full]
            if not page.get("IsTruncated"):
                break
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }
        for upload_id in uploads:

            async def abort(client: Any, upload_id: str = upload_id) -> None:
                await client.abort_multipart_upload(
                    Bucket=self._bucket, Key=full, UploadId=upload_id
                )

            await self._call(key, "abort upload", abort)
        return len(uploads)

    async def _list(self, prefix: str, start_after: str) -> AsyncIterator[ObjectInfo]:
        token: str | None = None
        cut = len(self._root)
        while True:

            async def attempt(client: Any, token: str | None = token) -> dict[str, Any]:
                extra: dict[str, str] = {}
                if token:
                    extra["ContinuationToken"] = token
                elif start_after:
                    extra["StartAfter"] = self._root + start_after
                return dict(
                    await client.list_objects_v2(
                        Bucket=self._bucket, Prefix=self._root + prefix, MaxKeys=1000, **extra
                    )
                )

            page = await self._call(prefix, "list", attempt)
            for item in page.get("Contents", ()):
                modified = item.get("LastModified")
                yield ObjectInfo(
                    key=item["Key"][cut:],
                    size=int(item.get("Size", 0)),
                    etag=str(item.get("ETag", "")).strip('"') or None,
                    mtime=modified.timestamp() if modified is not None else None,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _open_writer(self, key: str) -> BaseWriter:
        writer = S3Writer(self, key)
        self._writers.add(writer)
        return writer

    def _open_reader(self, key: str, chunk_bytes: int) -> BaseReader:
        return S3Reader(self, key, chunk_bytes)


def _bytes(view: memoryview) -> bytes:
    """The view as bytes, without a copy when it already covers a whole bytes object."""
    source = view.obj
    if isinstance(source, bytes) and len(source) == view.nbytes:
        return source
    return view.tobytes()


# Shown where users meet it (reprs, tracebacks: asyncstore.S3Store), whichever import
# reached it first: the package imports this module only when it is first used.
S3Store.__module__ = "asyncstore"
