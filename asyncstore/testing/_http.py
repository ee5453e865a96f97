"""HTTP/1.1 framing for the fault proxy: reading message heads, copying bodies delimited by
``Content-Length`` or chunked coding, building the S3-style error responses it injects, and
re-framing (and cutting) response bodies the way :meth:`FaultProxy.middlebox` promises.

Nothing here knows about faults or connections; :mod:`asyncstore.testing._proxy` decides what
to do with each message and uses these helpers to move its bytes.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

STREAM_LIMIT = 1 << 20  # longest request/response head or chunk-size line accepted
CHUNK = 1 << 16  # bytes copied at a time, and the chunk size of re-framed chunked bodies
_ERROR_CODES = {429: "SlowDown", 500: "InternalError", 503: "ServiceUnavailable"}
ENCODINGS = ("close", "chunked")
"""Body framings :meth:`FaultProxy.middlebox` re-frames response bodies into."""
CUTS = ("header", "first", "middle", "last")
"""Where :meth:`FaultProxy.middlebox` cuts a rewritten response: inside its head, before the
first body byte, in the middle of the body, just before its last byte."""

Write = Callable[[bytes], Awaitable[None]]
"""Where a copied body goes: an async function given each piece in order."""


@dataclass
class Head:
    """A parsed HTTP request or response head."""

    raw: bytes
    start_line: str
    headers: dict[str, str]

    @classmethod
    def parse(cls, raw: bytes) -> Head:
        """Parse a head as received, its final blank line included; field names lowercased."""
        lines = raw.decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                key = name.strip().lower()
                # Repeated fields are equivalent to one comma-joined field (RFC 9110 5.3).
                value = value.strip()
                headers[key] = f"{headers[key]}, {value}" if key in headers else value
        return cls(raw, lines[0], headers)

    @property
    def chunked(self) -> bool:
        """Whether the body uses chunked transfer coding."""
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def content_length(self) -> int:
        """The declared body length, 0 when absent."""
        return int(self.headers.get("content-length", "0") or 0)


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    """Read one message head; None on a clean EOF before its first byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise ConnectionError("connection closed inside a message head") from exc
        return None
    return Head.parse(raw)


async def _copy_exact(reader: asyncio.StreamReader, write: Write, size: int) -> None:
    while size > 0:
        data = await reader.read(min(size, CHUNK))
        if not data:
            raise ConnectionError("connection closed inside a message body")
        size -= len(data)
        await write(data)


async def _copy_chunked(reader: asyncio.StreamReader, write: Write) -> None:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        await write(size_line)
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            break
        await _copy_exact(reader, write, size + 2)  # chunk data plus its CRLF
    while True:  # trailer fields, ended by an empty line
        line = await reader.readuntil(b"\r\n")
        await write(line)
        if line == b"\r\n":
            return


async def copy_body(reader: asyncio.StreamReader, write: Write, head: Head) -> None:
    """Copy the body that follows ``head`` to ``write``, framing bytes included.

    A body with neither ``Content-Length`` nor chunked coding counts as empty: the caller
    handles one that runs until the connection closes.

    Raises:
        ConnectionError: if the connection closes inside the body.
    """
    if head.chunked:
        await _copy_chunked(reader, write)
    else:
        await _copy_exact(reader, write, head.content_length)


async def discard(_: bytes) -> None:
    """A :data:`Write` that drops what it is given, to consume a body nobody will see."""


def unchunk(framed: bytes) -> bytes:
    """The payload of a complete chunked body (chunk extensions and trailers dropped)."""
    out: list[bytes] = []
    pos = 0
    while True:
        eol = framed.index(b"\r\n", pos)
        size = int(framed[pos:eol].split(b";", 1)[0].strip(), 16)
        if size == 0:
            return b"".join(out)
        out.append(framed[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2


def rewrite(head: Head, body: bytes, encoding: str, cut: str | None) -> tuple[bytes, int]:
    """Re-frame a response as ``encoding``; return it and how many of its bytes to send.

    The head keeps every field but the framing ones (``Content-Length``,
    ``Transfer-Encoding``, ``Connection``), so a client can only learn the body's length from
    ``Content-Range``, or not at all.
    """
    lines = [head.start_line]
    for line in head.raw.decode("latin-1").split("\r\n")[1:]:
        name = line.partition(":")[0].strip().lower()
        if line and name not in ("content-length", "transfer-encoding", "connection"):
            lines.append(line)
    if encoding == "chunked":
        lines.append("Transfer-Encoding: chunked")
        pieces = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        lines.append("Connection: close")  # the body ends where the connection does
        framed = body
    new_head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def position(index: int) -> int:
        """Offset in ``framed`` of body byte ``index``."""
        if encoding != "chunked":
            return index
        whole, within = divmod(index, CHUNK)
        before = whole * (len(b"%x\r\n" % CHUNK) + CHUNK + 2)
        size = min(CHUNK, len(body) - whole * CHUNK)
        return before + len(b"%x\r\n" % size) + within

    response = new_head + framed
    if cut is None:
        return response, len(response)
    if cut == "header":
        return response, len(new_head) // 2
    if cut == "first" or not body:
        return response, len(new_head)
    index = len(body) // 2 if cut == "middle" else len(body) - 1
    return response, len(new_head) + position(index)


def error_response(status: int, request: Head, request_id: str, close: bool) -> bytes:
    """An S3-style XML error response to ``request``, as the bytes to send.

    Args:
        status: the HTTP status; 429, 500 and 503 carry the error code S3 gives them.
        request: the request answered; a HEAD gets the head alone.
        request_id: the ``x-amz-request-id`` and ``<RequestId>`` of the response.
        close: whether the response announces that the connection closes after it.
    """
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Injected Fault"
    code = _ERROR_CODES.get(status, "InjectedFault")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>Fault injected by asyncstore FaultProxy"
        f"</Message><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    ).encode()
    # A response to HEAD announces the length but must not carry the body.
    return head if request.start_line.startswith("HEAD ") else head + body
