"""Lean signed GETs and PUTs for S3, beside the botocore client.

Reading training data is a stream of small GETs, and botocore spends most of a small GET's CPU
on generic machinery: event hooks, endpoint rules, user-agent assembly, response parsing. On
the benchmark machine a signed aiohttp GET ran 2 to 4 times faster than botocore's
``get_object`` in the same run (see docs/benchmarks.md). This path signs each request with
botocore's own SigV4 signer and sends it with aiohttp directly.

Uploads (a ``PutObject``, an ``UploadPart``) take the same path, at the transport's CPU
floor: the body is sent from memory as it lies (slices of a memoryview, no copy) with an
unsigned payload (``UNSIGNED-PAYLOAD``: no SHA-256 of every byte on the client, nor its
check on the server) and ``x-amz-checksum-crc32c``, which the server checks before it stores
anything (a body damaged on the way is refused with ``BadDigest`` and sent again) and returns,
so the writer can tell it checked. CRC32C runs at over 10 GB/s in ``awscrt``'s C (with the
CPU's CRC instructions, the GIL released, any buffer taken as it lies); MD5 and SHA-256 at a
few hundred MB/s.

The object URL is the one botocore itself would use: it is taken once from a presigned URL,
so endpoint rules, addressing style and key quoting stay botocore's.
"""

from __future__ import annotations

import base64
import inspect
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import aiohttp.payload
import yarl
from awscrt import checksums
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import NoCredentialsError

__all__ = ["S3HTTPError", "SignedRequests", "crc32c_of"]

_PLACEHOLDER = "asyncstore-probe-key"
_UNSIGNED = "UNSIGNED-PAYLOAD"
# A body goes to the socket in slices of this size: large enough for few writes, small
# enough that the transport's buffer (which copies what the socket does not take at once)
# stays small.
_SLICE = 256 << 10
_XML_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")


class S3HTTPError(Exception):
    """An error answer of the fast path: the HTTP status and S3's error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}" if message else f"HTTP {status}")
        self.status = status
        self.code = code
        self.message = message


def crc32c_of(*data: bytes | memoryview) -> str:
    """The CRC32C of the buffers ``data``, one after the other, as S3 spells it
    (``x-amz-checksum-crc32c``): base64 of the big-endian 32-bit value. Releases the GIL
    over large buffers."""
    crc = 0
    for buffer in data:
        crc = checksums.crc32c(buffer, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def combined_crc32c(parts: list[str]) -> str:
    """The checksum S3 gives a multipart object: the CRC32C of its parts' CRC32Cs (raw
    bytes, in part order), ``-`` and the part count."""
    raw = b"".join(base64.b64decode(part) for part in parts)
    return f"{crc32c_of(raw)}-{len(parts)}"


class _Slices(aiohttp.payload.Payload):
    """A request body sent from memory as it lies: slices of its memoryviews, in order, no
    copy (a part of a multipart upload may be views of several buffers)."""

    _value: list[memoryview]

    def __init__(self, data: list[memoryview]) -> None:
        super().__init__(data, content_type="application/octet-stream")
        self._total = self._size = sum(view.nbytes for view in data)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        left = self._total if content_length is None else min(content_length, self._total)
        for view in self._value:
            view = view[:left]
            for start in range(0, len(view), _SLICE):
                await writer.write(view[start : start + _SLICE])  # drains past its high mark
            left -= len(view)
            if not left:
                return


class _BodySigner(S3SigV4Auth):  # type: ignore[misc]
    """botocore's S3 signer for a request whose body it does not hold: the payload's hash
    (``UNSIGNED-PAYLOAD``, or the SHA-256 computed beforehand) is given. botocore would hash
    the empty body it holds, or the whole body on the event loop."""

    def __init__(self, credentials: Any, region: str, payload: str) -> None:
        super().__init__(credentials, "s3", region)
        self._payload = payload

    def payload(self, request: Any) -> str:
        return self._payload


class SignedRequests:
    """Signed GETs and PUTs of one bucket's objects over a private aiohttp session."""

    def __init__(
        self,
        base_url: str,
        credentials: Any,
        region: str,
        *,
        connections: int,
        connect_timeout: float,
        read_timeout: float,
    ) -> None:
        self._base = base_url
        self._credentials = credentials
        self._region = region
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections),
            timeout=aiohttp.ClientTimeout(sock_connect=connect_timeout, sock_read=read_timeout),
            # Bodies are bytes as stored: never let a proxy's gzip change them.
            auto_decompress=False,
        )

    @classmethod
    async def create(cls, client: Any, session: Any, bucket: str, config: Any) -> SignedRequests:
        """Build the fast path to ``bucket`` from a live aiobotocore client and its session.

        Raises whatever botocore raises when it cannot presign (for example no credentials).
        """
        url = await client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": _PLACEHOLDER}, ExpiresIn=60
        )
        parts = urlsplit(url)
        if not parts.path.endswith("/" + _PLACEHOLDER):
            raise ValueError(f"unexpected presigned URL layout for bucket {bucket!r}")
        base = f"{parts.scheme}://{parts.netloc}{parts.path[: -len(_PLACEHOLDER)]}"
        if config.aws_access_key_id and config.aws_secret_access_key:
            credentials: Any = Credentials(
                config.aws_access_key_id, config.aws_secret_access_key, config.aws_session_token
            )
        else:
            credentials = await session.get_credentials()
            if credentials is None:
                raise NoCredentialsError()
        return cls(
            base,
            credentials,
            client.meta.region_name,
            connections=config.max_inflight + 4,
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
        )

    async def get(
        self, key: str, start: int, end: int, if_match: str | None
    ) -> tuple[bytes, dict[str, str]]:
        """GET bytes ``[start, end)`` of ``key`` (a full key, bucket prefix included).

        Returns the body and the response headers. Raises :class:`S3HTTPError` for an error
        answer and aiohttp's errors for connection failures. The body is returned as
        received: a close-delimited body cut short by a middlebox looks complete to aiohttp,
        so the caller checks its length against ``Content-Range``/``Content-Length``.
        """
        url, signed = await self._ranged(key, start, end, if_match)
        # encoded=True: send the path exactly as signed; requoting would break the signature.
        async with self._session.get(yarl.URL(url, encoded=True), headers=signed) as response:
            body = await response.read()
            if response.status >= 300:
                raise _error(response.status, body)
            return body, dict(response.headers)

    async def get_into(
        self, key: str, start: int, out: list[memoryview], if_match: str | None
    ) -> tuple[int, Mapping[str, str]]:
        """GET bytes of ``key`` from ``start`` straight into ``out`` (views whose lengths add
        up to the range): each block received is copied once, into place.

        Returns how many bytes arrived (the caller checks it against the range and
        ``Content-Range``) and the response headers. Raises :class:`S3HTTPError` for an
        error answer and aiohttp's errors for connection failures; more bytes than
        ``out`` holds raise ``OverflowError``.
        """
        end = start + sum(view.nbytes for view in out)
        url, signed = await self._ranged(key, start, end, if_match)
        async with self._session.get(yarl.URL(url, encoded=True), headers=signed) as response:
            if response.status >= 300:
                raise _error(response.status, await response.read())
            got = 0
            views, index, at = out, 0, 0
            async for block in response.content.iter_any():
                piece = memoryview(block)
                got += len(piece)
                while piece:
                    if index == len(views):
                        raise OverflowError(f"more than the {end - start} bytes asked for")
                    view = views[index]
                    n = min(view.nbytes - at, len(piece))
                    view[at : at + n] = piece[:n]
                    piece, at = piece[n:], at + n
                    if at == view.nbytes:
                        index, at = index + 1, 0
            return got, response.headers.copy()

    async def put(
        self,
        key: str,
        body: list[memoryview],
        *,
        crc32c: str | None,
        sha256: str | None = None,
        query: dict[str, str] | None = None,
    ) -> Mapping[str, str]:
        """PUT ``body`` (byte views, sent one after the other) to ``key`` (a full key), with
        ``query`` (``partNumber`` and ``uploadId`` for a part); returns the response headers.

        ``crc32c`` (from :func:`crc32c_of`) goes in ``x-amz-checksum-crc32c`` for the server
        to check. The payload is unsigned unless ``sha256`` (its hex digest) is given, for a
        server that wants signed payloads. Raises :class:`S3HTTPError` for an error answer
        and aiohttp's errors for connection failures.
        """
        url = self._base + quote(key, safe="/~")
        if query:
            url += "?" + urlencode(sorted(query.items()), quote_via=quote, safe="~")
        headers = {"Content-Length": str(sum(view.nbytes for view in body))}
        if crc32c is not None:
            headers["x-amz-checksum-crc32c"] = crc32c
        request = await self._signed("PUT", url, headers, payload=sha256 or _UNSIGNED)
        async with self._session.put(
            yarl.URL(url, encoded=True), data=_Slices(body), headers=request
        ) as response:
            answer = await response.read()
            if response.status >= 300:
                raise _error(response.status, answer)
            return response.headers.copy()  # names in any case: "ETag", "Etag"

    async def _ranged(
        self, key: str, start: int, end: int, if_match: str | None
    ) -> tuple[str, dict[str, str]]:
        # The URL and signed headers of a GET of bytes [start, end) of ``key``.
        url = self._base + quote(key, safe="/~")
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if if_match:
            headers["If-Match"] = f'"{if_match}"'
        return url, await self._signed("GET", url, headers)

    async def _signed(
        self, method: str, url: str, headers: dict[str, str], payload: str | None = None
    ) -> dict[str, str]:
        # The headers of ``method url`` with botocore's SigV4 signature added; ``payload``
        # is the body's x-amz-content-sha256 (for a request with a body, which the signer
        # never sees).
        frozen = self._credentials.get_frozen_credentials()
        if inspect.isawaitable(frozen):  # aiobotocore's refreshable credentials
            frozen = await frozen
        request = AWSRequest(method=method, url=url, headers=headers)
        if payload is None:
            S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
        else:
            _BodySigner(frozen, self._region, payload).add_auth(request)
        return dict(request.headers.items())

    async def aclose(self) -> None:
        """Close the HTTP session and its connections."""
        await self._session.close()


def _error(status: int, body: bytes) -> S3HTTPError:
    # S3's XML error answer: its code and message.
    code = _XML_CODE.search(body)
    message = _XML_MESSAGE.search(body)
    return S3HTTPError(
        status,
        code.group(1).decode(errors="replace") if code else str(status),
        message.group(1).decode(errors="replace") if message else "",
    )
