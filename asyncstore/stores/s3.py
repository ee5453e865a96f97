"""``s3://bucket/prefix``: objects in any S3-compatible server, through aiobotocore.

Requests in flight are bounded by ``max_inflight``; every request is retried with backoff
(:mod:`._retry`) on throttling, server errors, timeouts and broken connections, and never on
other client errors. botocore's own retries are switched off so that one policy, with one
attempt count, governs everything.

Large transfers are split into ``part_bytes`` pieces: a ``get`` of a large object fetches its
ranges in parallel, pinned to one version of the object with ``If-Match``; a write becomes a
multipart upload with several parts in flight, aborted if anything fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

import aiohttp
import anyio
import msgspec
from botocore import exceptions as bex

from .._concurrency import TaskSet, forget_errors, wait_shared
from ..errors import AsyncStoreError, NotFound, PermissionDenied, StoreError, StoreUnavailable
from . import _redact
from ._base import BaseReader, BaseStore, BaseWriter, ObjectInfo
from ._keys import check_key
from ._retry import with_retries
from ._s3fast import S3HTTPError, SignedGetter

__all__ = ["S3Config", "S3Store"]

_T = TypeVar("_T")
_logger = logging.getLogger("asyncstore.s3")

_MiB = 1 << 20
_MIN_PART = 5 * _MiB  # S3's minimum size for every part but the last
_MAX_PART = 5 * 1024 * _MiB
_MAX_PARTS = 10_000
_SMALL_BODY = 1 << 20  # bodies up to this size go to aiohttp as bytes (see _payload)

_SECRET_FIELDS = ("aws_secret_access_key", "aws_session_token")


class S3Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of an S3 store (``open_store("s3://bucket/prefix", **options)``).

    Credentials not given here come from the standard AWS chain (environment variables, shared
    config and credentials files, instance metadata).
    """

    endpoint_url: str | None = None
    """The server, for S3-compatible services (``http://127.0.0.1:8333``). Defaults to
    ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``, then AWS itself."""

    region: str | None = None
    """The region to sign requests for; by default the AWS chain's, else ``us-east-1``."""

    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    profile: str | None = None
    """A named profile of the shared AWS config files."""

    max_inflight: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    """Requests in flight at once (an open reader holds one). S3 clients degrade beyond about
    32 concurrent requests each: latency climbs while throughput stays flat."""

    part_bytes: Annotated[int, msgspec.Meta(ge=_MIN_PART, le=_MAX_PART)] = 16 * _MiB
    """Size of multipart-upload parts and of the ranges a large ``get`` fetches in parallel.
    16 MiB keeps per-request overhead under a few percent at local-network speeds while a
    failed part costs little to resend."""

    upload_max_inflight: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    """Parts of one upload in flight at once. A writer holds at most this many parts plus the
    one it is filling: 80 MiB at the defaults."""

    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    """Attempts per request, the first included, before :class:`StoreUnavailable`."""

    retry_base_delay: Annotated[float, msgspec.Meta(gt=0)] = 0.1
    """First backoff cap in seconds; it doubles with each retry (full jitter)."""

    retry_max_delay: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Largest backoff cap in seconds."""

    connect_timeout: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """Seconds to establish a connection."""

    read_timeout: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """Seconds to wait for the next bytes of a response before retrying the request."""

    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """``auto`` uses path-style URLs with a custom ``endpoint_url`` (what S3-compatible
    servers expect) and botocore's choice otherwise."""

    def _masked_fields(self) -> list[tuple[str, Any]]:
        # Never let a secret reach a log line or a traceback through a repr.
        return [
            (name, "***" if name in _SECRET_FIELDS and getattr(self, name) is not None
             else getattr(self, name))
            for name in self.__struct_fields__
        ]  # fmt: skip

    def __repr__(self) -> str:
        """The options, with the secret key and the session token masked (also ``str``)."""
        fields = ", ".join(f"{name}={value!r}" for name, value in self._masked_fields())
        return f"S3Config({fields})"

    def __rich_repr__(self) -> Any:
        """What ``rich`` prints: msgspec's own would show the secrets."""
        yield from self._masked_fields()


def _resolved_endpoint(config: S3Config) -> str | None:
    return (
        config.endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


_SESSIONS: dict[tuple[str | None, int], Any] = {}
_SESSIONS_LOCK = threading.Lock()


def _session(profile: str | None) -> Any:
    """A botocore session per profile and thread, reused by every store.

    Creating a client parses S3's service model, about 0.3 s of CPU; a session caches the
    parsed model, so the second store opened in a process (a data-loader worker, a test) pays
    nothing. One per thread, because botocore sessions are not safe to share across threads.
    """
    from aiobotocore.session import AioSession

    key = (profile, threading.get_ident())
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            session = AioSession(profile=profile) if profile else AioSession()
            _SESSIONS[key] = session
    return session


def _no_expect_header(params: dict[str, Any], **_: Any) -> None:
    """Send request bodies without ``Expect: 100-continue``.

    botocore asks for it on every streamed upload. It costs a round trip per PUT before the
    first body byte moves, and aiohttp writes the headers of such a request outside its error
    handling, so a connection reset at that moment surfaces as an unretrieved task exception
    besides the error the caller gets. Without it, a rejected upload wastes its body's
    bandwidth instead, which the retry policy bounds anyway.
    """
    params.get("headers", {}).pop("Expect", None)


async def _keep_credentials_out_of_logs(session: Any, config: S3Config) -> None:
    """Mask this store's credentials in botocore's DEBUG log (see :mod:`._redact`).

    The values come from the options or, when those have none, from the AWS chain the client
    resolved, so credentials from the environment or a profile are masked too.
    """
    secrets = [config.aws_secret_access_key, config.aws_session_token]
    if config.aws_secret_access_key is None:
        with contextlib.suppress(Exception):  # no credentials: nothing to mask
            credentials = await session.get_credentials()
            if credentials is not None:
                frozen = credentials.get_frozen_credentials()
                if inspect.isawaitable(frozen):  # aiobotocore's refreshable credentials
                    frozen = await frozen
                secrets += [frozen.secret_key, frozen.token]
    for secret in secrets:
        _redact.remember_secret(secret)
    _redact.install()


# -- error classification -----------------------------------------------------------------------

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
        "BadDigest",
        "IncompleteBody",
    }
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
        "AccountProblem",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})

# Failures of the connection itself, wherever they surface: botocore wraps aiohttp's errors
# raised while sending, but errors while reading a body come through as aiohttp's own.
_NETWORK_ERRORS: tuple[type[BaseException], ...] = (
    bex.EndpointConnectionError,
    bex.ConnectionClosedError,
    bex.ConnectTimeoutError,
    bex.ReadTimeoutError,
    bex.ResponseStreamingError,
    bex.HTTPClientError,
    bex.IncompleteReadError,
    aiohttp.ClientError,
    ConnectionError,
    TimeoutError,
)


def _code(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, S3HTTPError):
        return exc.code, exc.status
    if isinstance(exc, bex.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return str(error.get("Code", "")), int(status or 0)
    return "", 0


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, _ShortBody):
        return True
    if isinstance(exc, bex.ClientError | S3HTTPError):
        code, status = _code(exc)
        return status >= 500 or status == 429 or code in _RETRY_CODES
    return isinstance(exc, _NETWORK_ERRORS)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, S3HTTPError | _ShortBody):
        return str(exc)
    if isinstance(exc, bex.ClientError):
        code, status = _code(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        return f"HTTP {status} {code}{': ' + message if message else ''}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Precondition(Exception):
    """The object changed between two requests of one operation (If-Match failed)."""


class _ShortBody(Exception):
    """A response whose body is not the length its headers (or the request) promised.

    A connection closed early by a middlebox looks like the end of a close-delimited body, so
    the length is checked on every read. Retried like a broken connection: the bytes are not
    damaged at rest, the transfer was; after the last attempt it becomes
    :class:`StoreUnavailable`.
    """


def _parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``"bytes 0-1023/4096"`` -> ``(0, 1024, 4096)``: the span ``[first, stop)`` and the total
    (``None`` for ``*``); ``None`` when absent; :class:`_ShortBody` when unreadable."""
    if not value:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes" or not first.isdigit() or not last.isdigit():
        raise _ShortBody(f"unreadable Content-Range {value!r}")
    if not (total.isdigit() or total == "*"):
        raise _ShortBody(f"unreadable Content-Range {value!r}")
    return int(first), int(last) + 1, int(total) if total.isdigit() else None


def _check_body(got: int, start: int, content_range: str | None, content_length: Any) -> int:
    """Check a body of ``got`` bytes asked from offset ``start``; return the object's size.

    The span of ``Content-Range`` (a 206) or else ``Content-Length`` (a 200, the whole object)
    is what the server promised; a body of any other length was cut on the way. With neither
    header the length cannot be checked, which is refused too: short bytes are never data.
    """
    parsed = _parse_content_range(content_range)
    if parsed is not None:
        first, stop, total = parsed
        if first != start:
            raise _ShortBody(f"asked for bytes from {start}, got {content_range!r}")
        if got != stop - first:
            raise _ShortBody(f"truncated body: got {got} of {stop - first} bytes")
        return total if total is not None else stop
    if content_length is None or not str(content_length).strip().isdigit():
        raise _ShortBody(
            f"a body of {got} bytes without Content-Length or Content-Range: its length "
            "cannot be checked"
        )
    if got != int(content_length):
        raise _ShortBody(f"truncated body: got {got} of {int(content_length)} bytes")
    return got


class S3Store(BaseStore):
    """A store in an S3 bucket, under an optional prefix.

    Open it with ``open_store("s3://bucket/prefix", **options)``; see :class:`S3Config` for
    the options. The client connects on first use (or in ``async with``) and belongs to the
    event loop that used it first.
    """

    def __init__(self, bucket: str, prefix: str = "", config: S3Config | None = None) -> None:
        super().__init__(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")
        self._bucket = bucket
        self._root = f"{prefix}/" if prefix else ""
        self._config = config or S3Config()
        self._endpoint = _resolved_endpoint(self._config)
        self._slots = anyio.Semaphore(self._config.max_inflight)
        self._client: Any = None
        self._client_cm: Any = None
        self._fast: SignedGetter | None = None
        self._client_lock = anyio.Lock()
        self._client_loop: asyncio.AbstractEventLoop | None = None
        # Writers still open: aclose() aborts their uploads while it still has a client.
        self._writers: weakref.WeakSet[_S3Writer] = weakref.WeakSet()

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
        await self._get_client()

    async def _get_client(self) -> Any:
        if self._client is not None:
            if self._client_loop is not asyncio.get_running_loop():
                raise self._wrong_loop()
            return self._client
        async with self._client_lock:
            self._check_open()
            if self._client is None:
                from aiobotocore.config import AioConfig

                cfg = self._config
                style = cfg.addressing_style
                if style == "auto":
                    style = "path" if self._endpoint else "auto"
                config = AioConfig(
                    # A little above our own limit, so a slot never waits for a connection.
                    max_pool_connections=cfg.max_inflight + 4,
                    connect_timeout=cfg.connect_timeout,
                    read_timeout=cfg.read_timeout,
                    retries={"total_max_attempts": 1},  # ours, not botocore's: see module doc
                    s3={"addressing_style": style},
                    # Integrity is end to end in asyncstore (xxh3 on cache entries and
                    # checkpoint chunks); a CRC per request would cost CPU on every byte twice.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                try:
                    session = _session(cfg.profile)
                    region = cfg.region or session.get_config_variable("region") or "us-east-1"
                    cm = session.create_client(
                        "s3",
                        region_name=region,
                        endpoint_url=self._endpoint,
                        aws_access_key_id=cfg.aws_access_key_id,
                        aws_secret_access_key=cfg.aws_secret_access_key,
                        aws_session_token=cfg.aws_session_token,
                        config=config,
                    )
                    client = await cm.__aenter__()
                    client.meta.events.register_last("before-call.s3", _no_expect_header)
                    await _keep_credentials_out_of_logs(session, cfg)
                except Exception as exc:
                    raise StoreError(
                        f"cannot create an S3 client for {self.url}: {_describe(exc)}"
                    ) from exc
                try:
                    self._fast = await SignedGetter.create(client, session, self._bucket, cfg)
                except Exception as exc:
                    await cm.__aexit__(None, None, None)
                    raise StoreError(
                        f"cannot sign requests for {self.url}: {_describe(exc)}; check that "
                        "credentials are configured (options, environment or AWS profile)"
                    ) from exc
                self._client_cm, self._client = cm, client
                self._client_loop = asyncio.get_running_loop()
        if self._client_loop is not asyncio.get_running_loop():
            raise self._wrong_loop()  # created by another loop while this one waited
        return self._client

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
        async with self._client_lock:
            cm, self._client, self._client_cm = self._client_cm, None, None
            fast, self._fast = self._fast, None
            if self._client_loop is not asyncio.get_running_loop():
                # Closed from another loop: the connections cannot be closed from here
                # (their loop is usually closed already); drop them.
                return
            if fast is not None:
                await fast.aclose()
            if cm is not None:
                await cm.__aexit__(None, None, None)

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
        if isinstance(exc, _Precondition):
            return StoreError(f"{where} kept changing while it was read; retry when it is stable")
        code, status = _code(exc)
        if code == "NoSuchBucket":
            return NotFound(
                f"bucket {self._bucket!r} does not exist at {self._endpoint or 'AWS'}; "
                "create it first"
            )
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFound(f"{where} does not exist")
        if code in _DENIED_CODES or status == 403:
            return PermissionDenied(
                f"{where}: access denied ({_describe(exc)}); check the credentials and the "
                "bucket policy"
            )
        if _retryable(exc):
            return StoreUnavailable(
                f"{where}: the store failed {attempts} time(s) in a row, last with "
                f"{_describe(exc)}; check that {self._endpoint or 'S3'} is reachable and healthy"
            )
        return StoreError(f"{where}: {_describe(exc)}")

    async def _call(
        self, key: str, what: str, attempt: Callable[[Any], Awaitable[_T]], *, slot: bool = True
    ) -> _T:
        """Run ``attempt(client)`` with retries, inside a request slot, translating errors."""
        client = await self._get_client()

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
                retryable=_retryable,
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

    def _info(self, key: str, head: dict[str, Any], size: int | None = None) -> ObjectInfo:
        etag = head.get("ETag")
        modified = head.get("LastModified")
        if size is None:
            if head.get("ContentLength") is None:
                # Not 0: a size taken as 0 makes a reader end at once with no bytes.
                raise _ShortBody("the answer has no Content-Length: the size is unknown")
            size = int(head["ContentLength"])
        return ObjectInfo(
            key=key,
            size=size,
            etag=etag.strip('"') if isinstance(etag, str) else None,
            mtime=modified.timestamp() if modified is not None else None,
        )

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
                    raise _Precondition from exc
                raise
            tag = headers.get("ETag")
            content_range = headers.get("Content-Range")
            if content_range is None:
                # The server ignored Range and sent the whole object: check it from 0.
                total = _check_body(len(data), 0, None, headers.get("Content-Length"))
                data = data[start:end]
            else:
                total = _check_body(len(data), start, content_range, None)
                if start + len(data) != min(end, total):
                    # A consistent header can still promise less than was asked for.
                    raise _ShortBody(
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
            except _Precondition as exc:
                raise self._replaced(key) from exc
            stop = total if end is None else min(end, total)
            if total < 0 or start + len(data) >= stop:
                return data
            # A large object: fetch the rest in parallel, all from the version the first
            # response came from (If-Match), so a concurrent overwrite cannot mix versions.
            offsets = range(start + len(data), stop, part)
            pieces: list[bytes] = [b""] * len(offsets)

            async def fetch(
                index: int,
                offset: int,
                etag: str | None = etag,
                stop: int = stop,
                pieces: list[bytes] = pieces,
            ) -> None:
                piece, _, _ = await self._range(key, offset, min(offset + part, stop), etag)
                pieces[index] = piece

            try:
                async with anyio.create_task_group() as tg:
                    for index, offset in enumerate(offsets):
                        tg.start_soon(fetch, index, offset)
            except BaseExceptionGroup as group:
                leaves = _leaves(group)
                if all(isinstance(leaf, _Precondition) for leaf in leaves):
                    if pin is not None:
                        raise self._replaced(key) from None
                    continue  # overwritten mid-read: start again on the new version
                # Parallel ranges fail for one reason in practice (the server went away):
                # report that error rather than a group the caller would have to unpack.
                raise next(e for e in leaves if not isinstance(e, _Precondition)) from None
            return b"".join([data, *pieces])  # each piece's length was checked in _range
        raise self._error(_Precondition(), key)

    # -- put, stat, delete, list -------------------------------------------------------------

    async def _put(self, key: str, data: memoryview) -> ObjectInfo:
        if len(data) > self._config.part_bytes:
            writer = _S3Writer(self, key)
            async with writer:
                await writer.write_in_place(data)
            assert writer.info is not None
            return writer.info
        body = _bytes(data)

        async def attempt(client: Any) -> dict[str, Any]:
            return dict(
                await client.put_object(
                    Bucket=self._bucket, Key=self._root + key, Body=_payload(body)
                )
            )

        resp = await self._call(key, "put", attempt)
        info = self._info(key, {"ETag": resp.get("ETag")}, size=len(data))
        return msgspec.structs.replace(info, mtime=time.time())

    async def _stat(self, key: str) -> ObjectInfo:
        async def attempt(client: Any) -> ObjectInfo:
            head = await client.head_object(Bucket=self._bucket, Key=self._root + key)
            return self._info(key, head)

        return await self._call(key, "stat", attempt)

    async def _delete(self, key: str) -> None:
        async def attempt(client: Any) -> None:
            await client.delete_object(Bucket=self._bucket, Key=self._root + key)

        await self._call(key, "delete", attempt)

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
        writer = _S3Writer(self, key)
        self._writers.add(writer)
        return writer

    def _open_reader(self, key: str, chunk_bytes: int) -> BaseReader:
        return _S3Reader(self, key, chunk_bytes)


def _bytes(view: memoryview) -> bytes:
    """The view as bytes, without a copy when it already covers a whole bytes object."""
    source = view.obj
    if isinstance(source, bytes) and len(source) == view.nbytes:
        return source
    return view.tobytes()


def _payload(data: bytes) -> bytes | io.BytesIO:
    """A request body for ``data``, made anew for every attempt.

    aiohttp writes a bytes body to the socket in one call, which blocks the event loop while
    the kernel buffer drains and warns above 1 MiB; a ``BytesIO`` is streamed in 64 KiB
    pieces under flow control instead. ``BytesIO(bytes)`` shares the bytes until written to,
    so this costs no copy.
    """
    return io.BytesIO(data) if len(data) > _SMALL_BODY else data


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


class _S3Writer(BaseWriter):
    """Buffers up to one part; a small object becomes one PUT, a large one a multipart upload
    whose parts upload in background tasks, ``upload_max_inflight`` at a time."""

    _store: S3Store

    def __init__(self, store: S3Store, key: str) -> None:
        super().__init__(store, key)
        # A BytesIO, not a bytearray: getvalue() hands its storage over as bytes without a
        # copy, so each byte is copied once on its way to the socket (into this buffer).
        self._buffer = io.BytesIO()
        self._upload_id: str | None = None
        self._uploads = TaskSet(f"the upload of {store.where(key)}")
        self._parts: list[asyncio.Task[dict[str, Any]]] = []  # in part order
        self._creating: asyncio.Future[str] | None = None
        self._next_part = 1

    async def write_in_place(self, data: memoryview) -> None:
        """Write all of an in-memory object, each part a slice of ``data`` (no copy into the
        part buffer): ``data`` must stay unchanged until the writer commits."""
        await self._write(data, copy=False)
        self._written += len(data)

    def _part_bytes(self) -> int:
        # Grow parts every 1000 so that 10,000 parts reach 55,000 x part_bytes (880 GiB at
        # 16 MiB) instead of stopping a long stream at 10,000 x part_bytes.
        return self._store.config.part_bytes * (1 + (self._next_part - 1) // 1000)

    def _take_buffer(self) -> bytes:
        data = self._buffer.getvalue()
        self._buffer = io.BytesIO()
        return data

    async def _write(self, data: memoryview, *, copy: bool = True) -> None:
        offset = 0
        while offset < len(data):
            size = self._part_bytes()
            buffered = self._buffer.tell()
            if not buffered and len(data) - offset >= size and not copy:
                # put() of an in-memory object: each part is one slice of it.
                await self._send(data[offset : offset + size].tobytes())
                offset += size
                continue
            take = min(size - buffered, len(data) - offset)
            self._buffer.write(data[offset : offset + take])
            offset += take
            if buffered + take >= size:
                await self._send(self._take_buffer())

    async def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = await self._create()
        # Back-pressure: wait for the oldest part when the window is full, so memory stays
        # bounded and an upload failure surfaces at the next write, not only at the end.
        limit = self._store.config.upload_max_inflight
        while sum(not t.done() for t in self._parts) >= limit:
            await asyncio.wait(
                [t for t in self._parts if not t.done()], return_when=asyncio.FIRST_COMPLETED
            )
        for task in self._parts:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        number = self._next_part
        self._next_part += 1
        if number > _MAX_PARTS:
            raise StoreError(
                f"{self._store.where(self._key)}: more than {_MAX_PARTS} parts; "
                "open the store with a larger part_bytes"
            )
        self._parts.append(
            self._uploads.spawn(self._upload_part(number, part), name=f"upload part {number}")
        )

    async def _create(self) -> str:
        async def attempt(client: Any) -> str:
            resp = await client.create_multipart_upload(
                Bucket=self._store.bucket, Key=self._store._root + self._key
            )
            return str(resp["UploadId"])

        # In a task of its own, shared with _abort(): once the request is sent, only its answer
        # says which upload to abort, so a cancellation must not drop that answer.
        self._creating = self._uploads.spawn(
            self._store._call(self._key, "start upload", attempt), name="start upload"
        )
        upload_id = await wait_shared(self._creating)
        self._creating = None
        return upload_id

    async def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        async def attempt(client: Any) -> dict[str, Any]:
            resp = await client.upload_part(
                Bucket=self._store.bucket,
                Key=self._store._root + self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=_payload(part),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        return await self._upload_call(f"upload part {number}", attempt)

    async def _upload_call(self, what: str, attempt: Callable[[Any], Awaitable[_T]]) -> _T:
        """A request on this writer's upload; says what happened if the upload is gone."""
        try:
            return await self._store._call(self._key, what, attempt)
        except NotFound as exc:
            if _code(exc.__cause__ or exc)[0] != "NoSuchUpload":
                raise
            # Not "does not exist": the key may well exist. Another writer of this key (a
            # second process saving to it aborts unfinished uploads before it starts, see
            # clean_up_writes) aborted this upload.
            raise StoreError(
                f"nothing was written to {self._store.where(self._key)}: another writer of the "
                "same key aborted this writer's multipart upload (a second process saving to "
                "it aborts unfinished uploads when it starts) and replaces the object; write "
                "each key from one writer at a time"
            ) from exc

    async def _commit(self) -> ObjectInfo:
        if self._upload_id is None:
            # Everything fit in one part: a single PUT, no multipart overhead.
            return await self._store._put(self._key, memoryview(self._take_buffer()))
        if self._buffer.tell():
            await self._send(self._take_buffer())
        parts = [await task for task in self._parts]
        upload_id = self._upload_id

        async def attempt(client: Any) -> dict[str, Any]:
            # Retried like every request: a retry after a lost answer completes the same
            # upload again and succeeds (tested against SeaweedFS through a reset).
            return dict(
                await client.complete_multipart_upload(
                    Bucket=self._store.bucket,
                    Key=self._store._root + self._key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            )

        resp = await self._upload_call("complete upload", attempt)
        self._upload_id = None  # committed: nothing left to abort
        info = self._store._info(self._key, {"ETag": resp.get("ETag")}, size=self._written)
        return msgspec.structs.replace(info, mtime=time.time())

    async def _abort(self) -> None:
        self._buffer = io.BytesIO()
        creating, self._creating = self._creating, None
        if creating is not None and self._upload_id is None:
            # Cancelled while CreateMultipartUpload was in flight (no part was sent yet):
            # learn the id to abort it.
            try:
                self._upload_id = await creating
            except BaseException:
                creating.cancel()  # failed (no upload), or our own cleanup timed out
        await self._uploads.aclose()  # part uploads stop; their errors no longer matter
        forget_errors(self._parts)
        self._parts.clear()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return

        async def attempt(client: Any) -> None:
            await client.abort_multipart_upload(
                Bucket=self._store.bucket, Key=self._store._root + self._key, UploadId=upload_id
            )

        try:
            await self._store._call(self._key, "abort upload", attempt)
        except NotFound:
            pass  # already gone
        except Exception as exc:
            # The data is not visible under the key either way; say what to clean up.
            _logger.warning(
                "could not abort multipart upload %s of %s (%s); a bucket lifecycle rule for "
                "incomplete uploads will remove it",
                upload_id,
                self._store.where(self._key),
                exc,
            )


class _S3Reader(BaseReader):
    """Streams one GET; if the connection breaks mid-body, resumes from the current offset
    with a ranged GET pinned to the same version (If-Match)."""

    _store: S3Store

    def __init__(self, store: S3Store, key: str, chunk_bytes: int) -> None:
        super().__init__(store, key, chunk_bytes)
        self._body: Any = None
        self._offset = 0
        self._size = 0
        self._etag: str | None = None
        self._slot_held = False

    async def _request(self, client: Any) -> dict[str, Any]:
        extra: dict[str, str] = {}
        if self._offset:
            extra["Range"] = f"bytes={self._offset}-"
        if self._etag:
            extra["IfMatch"] = f'"{self._etag}"'
        try:
            resp = dict(
                await client.get_object(
                    Bucket=self._store.bucket, Key=self._store._root + self._key, **extra
                )
            )
        except bex.ClientError as exc:
            if _code(exc)[1] == 412:
                raise _Precondition from exc
            raise
        self._body = resp["Body"]
        try:
            resp["ContentLength"] = await self._expected_length(client, resp)
        except BaseException:
            await self._drop_body()
            raise
        return resp

    async def _expected_length(self, client: Any, resp: dict[str, Any]) -> int:
        """How many bytes this response's body must have, from its headers.

        A resumed read must get a ``Content-Range`` starting at the offset asked for; a
        first read without ``Content-Length`` (a close-delimited or chunked body, rewritten by
        a middlebox) asks the size with a HEAD of the same version, so that a body cut short
        is still noticed by the reader (see :meth:`_read`).
        """
        parsed = _parse_content_range(resp.get("ContentRange"))
        if parsed is not None:
            first, stop, total = parsed
            if first != self._offset or (total is not None and stop != total):
                raise _ShortBody(
                    f"asked for bytes from {self._offset}, got {resp.get('ContentRange')!r}"
                )
            return stop - first
        if self._offset:
            raise _ShortBody("a resumed read was answered without Content-Range")
        if resp.get("ContentLength") is not None:
            return int(resp["ContentLength"])
        etag = str(resp.get("ETag", "")).strip('"')
        try:
            head = await client.head_object(
                Bucket=self._store.bucket,
                Key=self._store._root + self._key,
                **({"IfMatch": f'"{etag}"'} if etag else {}),
            )
        except bex.ClientError as exc:
            if _code(exc)[1] == 412:
                raise _Precondition from exc
            raise
        if head.get("ContentLength") is None:
            raise _ShortBody("neither the GET nor a HEAD announced the size")
        return int(head["ContentLength"])

    async def _open(self) -> ObjectInfo:
        # The reader holds a request slot for its lifetime: its connection is in use all along.
        await self._store._slots.acquire()
        self._slot_held = True
        try:
            resp = await self._store._call(self._key, "read", self._request, slot=False)
        except BaseException:
            self._release()
            raise
        info = self._store._info(self._key, resp)
        self._size, self._etag = info.size, info.etag
        return info

    async def _read(self, size: int) -> bytes:
        parts: list[bytes] = []
        wanted = min(size, self._size - self._offset)
        got = 0
        failures = 0
        while got < wanted:
            try:
                chunk: bytes = await self._body.read(wanted - got)
                if not chunk:
                    raise bex.IncompleteReadError(
                        actual_bytes=self._offset, expected_bytes=self._size
                    )
            except Exception as exc:
                # A body that ends before the size announced (a short read above, or aiohttp
                # noticing a cut chunked body) is resumed from the offset, pinned to the
                # version with If-Match; it never ends the read early.
                if not _retryable(exc):
                    raise self._store._error(exc, self._key) from exc
                failures += 1
                if failures >= self._store.config.max_attempts:
                    raise self._store._error(exc, self._key, failures) from exc
                await self._drop_body()
                try:
                    await self._store._call(self._key, "resume read", self._request, slot=False)
                except _Precondition as changed:
                    raise self._store._error(changed, self._key) from exc
                continue
            parts.append(chunk)
            got += len(chunk)
            self._offset += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with contextlib.suppress(Exception):
                await body.aclose()

    def __del__(self) -> None:
        # Dropped without aclose() (a plain 'async for' left with break): warn, and give the
        # request slot and the connection back, or the store would run out of slots.
        if getattr(self, "_state", "closed") == "open":
            super().__del__()
            body, self._body = self._body, None
            if body is not None:
                with contextlib.suppress(Exception):
                    body.close()
            self._release()

    def _release(self) -> None:
        if self._slot_held:
            self._slot_held = False
            self._store._slots.release()

    async def _on_close(self) -> None:
        try:
            await self._drop_body()
        finally:
            self._release()
