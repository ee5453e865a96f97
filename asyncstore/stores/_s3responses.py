"""Reading S3's answers: what a failure means and whether a body is whole.

It owns the classification every S3 request goes through: which errors are retried
(throttling, server errors, broken connections, cut bodies), which mean "denied" or "does not
exist", how each is described in a message; and the checks that a body has the length its
headers promised, since a middlebox closing a connection early can make a cut body look
complete.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from botocore import exceptions as bex

from ._base import ObjectInfo
from ._s3fast import S3HTTPError

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
        # A body that does not match the checksum sent with it was damaged on the way (the
        # server stored nothing): send it again.
        "BadDigest",
        "IncompleteBody",
    }
)
DENIED_CODES = frozenset(
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
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})

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


def error_code(exc: BaseException) -> tuple[str, int]:
    """S3's error code and the HTTP status of an error answer; ``("", 0)`` for any other."""
    if isinstance(exc, S3HTTPError):
        return exc.code, exc.status
    if isinstance(exc, bex.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return str(error.get("Code", "")), int(status or 0)
    return "", 0


def retryable(exc: BaseException) -> bool:
    """Whether trying the request again may succeed: the server or the way there failed."""
    if isinstance(exc, ShortBody):
        return True
    if isinstance(exc, bex.ClientError | S3HTTPError):
        code, status = error_code(exc)
        return status >= 500 or status == 429 or code in _RETRY_CODES
    return isinstance(exc, _NETWORK_ERRORS)


def describe(exc: BaseException) -> str:
    """``exc`` in a few words for an error message: the status and code of an S3 error."""
    if isinstance(exc, S3HTTPError | ShortBody):
        return str(exc)
    if isinstance(exc, bex.ClientError):
        code, status = error_code(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        return f"HTTP {status} {code}{': ' + message if message else ''}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Precondition(Exception):
    """The object changed between two requests of one operation (If-Match failed)."""


class ShortBody(Exception):
    """A response whose body is not the length its headers (or the request) promised.

    A connection closed early by a middlebox looks like the end of a close-delimited body, so
    the length is checked on every read. Retried like a broken connection: the bytes are not
    damaged at rest, the transfer was; after the last attempt it becomes
    :class:`StoreUnavailable`.
    """


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``"bytes 0-1023/4096"`` -> ``(0, 1024, 4096)``: the span ``[first, stop)`` and the total
    (``None`` for ``*``); ``None`` when absent; :class:`ShortBody` when unreadable."""
    if not value:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes" or not first.isdigit() or not last.isdigit():
        raise ShortBody(f"unreadable Content-Range {value!r}")
    if not (total.isdigit() or total == "*"):
        raise ShortBody(f"unreadable Content-Range {value!r}")
    return int(first), int(last) + 1, int(total) if total.isdigit() else None


def check_body(got: int, start: int, content_range: str | None, content_length: Any) -> int:
    """Check a body of ``got`` bytes asked from offset ``start``; return the object's size.

    The span of ``Content-Range`` (a 206) or else ``Content-Length`` (a 200, the whole object)
    is what the server promised; a body of any other length was cut on the way. With neither
    header the length cannot be checked, which is refused too: short bytes are never data.
    """
    parsed = parse_content_range(content_range)
    if parsed is not None:
        first, stop, total = parsed
        if first != start:
            raise ShortBody(f"asked for bytes from {start}, got {content_range!r}")
        if got != stop - first:
            raise ShortBody(f"truncated body: got {got} of {stop - first} bytes")
        return total if total is not None else stop
    if content_length is None or not str(content_length).strip().isdigit():
        raise ShortBody(
            f"a body of {got} bytes without Content-Length or Content-Range: its length "
            "cannot be checked"
        )
    if got != int(content_length):
        raise ShortBody(f"truncated body: got {got} of {int(content_length)} bytes")
    return got


def object_info(key: str, head: dict[str, Any], size: int | None = None) -> ObjectInfo:
    """What the headers of an answer say about ``key`` (``size`` overrides Content-Length)."""
    etag = head.get("ETag")
    modified = head.get("LastModified")
    if size is None:
        if head.get("ContentLength") is None:
            # Not 0: a size taken as 0 makes a reader end at once with no bytes.
            raise ShortBody("the answer has no Content-Length: the size is unknown")
        size = int(head["ContentLength"])
    return ObjectInfo(
        key=key,
        size=size,
        etag=etag.strip('"') if isinstance(etag, str) else None,
        mtime=modified.timestamp() if modified is not None else None,
    )
