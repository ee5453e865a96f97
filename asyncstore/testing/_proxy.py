"""A fault-injecting HTTP/1.1 TCP proxy for exercising client retry and timeout paths.

This module owns :class:`FaultProxy`: its fault settings and counters, its event loop thread,
and the handling of each client connection (which requests to fail, stall, reset or forward,
and relaying the server's responses back). How HTTP messages are framed on the wire lives in
:mod:`asyncstore.testing._http`; what one client connection holds, in
:mod:`asyncstore.testing._connection`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from ._connection import Connection, Downstream, Pending, ResetNow, rst
from ._http import (
    CHUNK,
    CUTS,
    ENCODINGS,
    STREAM_LIMIT,
    Head,
    copy_body,
    discard,
    error_response,
    read_head,
    rewrite,
    unchunk,
)

_log = logging.getLogger("asyncstore.testing")


class FaultProxy:
    """TCP proxy on 127.0.0.1 in front of an HTTP/1.1 server that injects faults on demand.

    It parses request boundaries on each (keep-alive) client connection, so faults apply to
    individual requests. The proxy runs its own event loop in a daemon thread, so it can be
    driven from synchronous tests and from tests running any event loop. Faults and
    ``latency`` (seconds to wait before forwarding each request upstream; injected errors
    are not delayed) may be changed from any thread at any time; they apply to requests
    whose head arrives afterwards. Precedence: stall, then fail, then reset.

    Counters (plain ints, safe to read from any thread): ``connections`` (accepted client
    connections, refused ones included), ``requests`` (request heads received),
    ``requests_forwarded``, ``failed`` (error responses injected), ``resets`` (connections
    reset by :meth:`reset_next`), ``rewritten`` and ``cut`` (responses re-framed and cut by
    :meth:`middlebox`). ``seen`` holds the last 1,000 request heads received, each as its
    start line and its headers (names lowercased): what a client sent, signature included.

    Args:
        upstream_host: host of the server to forward to.
        upstream_port: port of the server to forward to.
    """

    connections: int
    requests: int
    requests_forwarded: int
    failed: int
    resets: int
    rewritten: int
    cut: int
    corrupted: int
    seen: collections.deque[tuple[str, dict[str, str]]]

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self.latency = 0.0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[Connection] = set()
        self._middlebox: str | None = None  # the encoding of middlebox(); None: off
        self._cut: str | None = None
        self._middlebox_match: str | None = None
        self.reset()

    @property
    def url(self) -> str:
        """Base URL of the proxy, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    # -- fault control (any thread) -----------------------------------------------------

    def fail_next(self, n: int, status: int = 503, match: str | None = None) -> None:
        """Answer the next ``n`` requests (over all connections) with an S3-style error.

        The request and its body are consumed but not forwarded; the connection stays
        usable, unless the request has a body and expects ``100-continue``: it is then
        answered at once and closed, since the client may or may not send the body (botocore
        sends ``Expect: 100-continue`` on every PutObject and UploadPart). Replaces any
        pending count.

        Args:
            n: number of requests to fail.
            status: HTTP status to answer with (400-599). 500 carries error code
                ``InternalError``, 503 ``ServiceUnavailable``, 429 ``SlowDown``.
            match: fail only requests whose request line (method, path and query) contains
                this text, e.g. ``"partNumber=2"``; others pass untouched and do not count.

        Raises:
            ValueError: if ``n`` is negative or ``status`` is not an error status.
        """
        if n < 0 or not 400 <= status <= 599:
            raise ValueError(f"invalid fail_next(n={n}, status={status})")
        with self._lock:
            self._fail_left, self._fail_status, self._fail_match = n, status, match

    def reset_next(self, n: int, after_bytes: int = 0, match: str | None = None) -> None:
        """Forward the next ``n`` requests, then reset their connections with a TCP RST.

        The reset happens once ``after_bytes`` bytes of the final response (interim ``100
        Continue`` responses are passed on and not counted) have been passed to the client;
        with 0 it happens when the first byte of the final response arrives, so the server
        has processed the request but the client learns nothing of the outcome. A response
        shorter than ``after_bytes`` is delivered whole, then the connection is reset.
        Bytes already handed to the kernel may or may not reach the client. Replaces any
        pending count.

        Args:
            n: number of requests whose connection is reset.
            after_bytes: response bytes to pass through before the reset.
            match: reset only requests whose request line contains this text, e.g.
                ``"uploadId="``; others pass untouched and do not count.

        Raises:
            ValueError: if ``n`` or ``after_bytes`` is negative.
        """
        if n < 0 or after_bytes < 0:
            raise ValueError(f"invalid reset_next(n={n}, after_bytes={after_bytes})")
        with self._lock:
            self._reset_left, self._reset_after, self._reset_match = n, after_bytes, match

    def corrupt_next(self, n: int, match: str | None = None) -> None:
        """Flip one byte in the body of each of the next ``n`` requests that have one (a
        ``Content-Length`` body, not a chunked one): the server stores what it received, as
        after a fault on the wire or in a middlebox that no checksum of TCP's caught.
        Replaces any pending count.

        Args:
            n: number of request bodies to damage.
            match: only requests whose request line contains this text, e.g.
                ``"partNumber=2"``; others pass untouched and do not count.

        Raises:
            ValueError: if ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"invalid corrupt_next(n={n})")
        with self._lock:
            self._corrupt_left, self._corrupt_match = n, match

    def middlebox(
        self,
        encoding: str | None,
        cut: str | None = None,
        n: int = 1,
        match: str | None = None,
    ) -> None:
        """Act as a middlebox that re-frames the bodies of responses to GET requests.

        While on, every response to a GET whose request line contains ``match`` (every GET
        when ``None``) is read whole from the server and sent on with its body framed as
        ``encoding``: ``"close"`` (no ``Content-Length``; the body ends when the proxy closes
        the connection, which it does after the response) or ``"chunked"``
        (``Transfer-Encoding: chunked``, in 64 KiB chunks). With ``cut``, the next ``n`` of
        those responses are cut short and the connection closed with an orderly FIN, the
        way a middlebox that gives up looks to the client: at ``"header"`` (half the
        head), ``"first"`` (the whole head, no body byte), ``"middle"`` (half the body) or
        ``"last"`` (all but the body's last byte). Responses after those pass whole, still
        re-framed. Responses to other methods (HEAD, PUT, ...) pass untouched. Faults set
        with :meth:`fail_next`, :meth:`reset_next` and :meth:`stall` come first. Replaces
        any earlier setting; ``middlebox(None)`` or :meth:`reset` turns it off.

        Args:
            encoding: ``"close"``, ``"chunked"`` or ``None`` (off).
            cut: one of ``"header"``, ``"first"``, ``"middle"``, ``"last"``, or ``None`` to
                re-frame without cutting.
            n: how many responses to cut.
            match: re-frame only GETs whose request line contains this text.

        Raises:
            ValueError: for an unknown encoding or cut, or a negative ``n``.
        """
        if encoding is not None and encoding not in ENCODINGS:
            raise ValueError(f"invalid middlebox(encoding={encoding!r}): one of {ENCODINGS}")
        if cut is not None and cut not in CUTS:
            raise ValueError(f"invalid middlebox(cut={cut!r}): one of {CUTS}")
        if n < 0:
            raise ValueError(f"invalid middlebox(n={n})")
        with self._lock:
            self._middlebox = encoding
            self._cut, self._cut_left = cut, (n if cut is not None else 0)
            self._middlebox_match = match

    def stall(self, on: bool) -> None:
        """While on, read new requests but neither answer nor forward them.

        Turning it off closes the connections of stalled requests rather than reviving them.

        Args:
            on: whether to stall.
        """
        with self._lock:
            self._stall = on
        if not on:
            self._in_loop(lambda: self._close_conns(lambda c: c.stalled))

    def refuse(self, on: bool) -> None:
        """While on, close new connections at once (with a reset) and close existing ones.

        Args:
            on: whether to refuse connections.
        """
        with self._lock:
            self._refuse = on
        if on:
            self._in_loop(lambda: self._close_conns(lambda c: True))

    def reset(self) -> None:
        """Clear all faults and latency and zero the counters.

        Connections of stalled requests are closed, as with ``stall(False)``.
        """
        with self._lock:
            self.latency = 0.0
            self._fail_left, self._fail_status, self._fail_match = 0, 503, None
            self._reset_left, self._reset_after, self._reset_match = 0, 0, None
            self._stall = self._refuse = False
            self._middlebox = self._cut = self._middlebox_match = None
            self._cut_left = 0
            self._corrupt_left, self._corrupt_match = 0, None
            self.connections = self.requests = self.requests_forwarded = 0
            self.failed = self.resets = self.rewritten = self.cut = self.corrupted = 0
            self.seen = collections.deque(maxlen=1000)
        self._in_loop(lambda: self._close_conns(lambda c: c.stalled))

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start listening on a free 127.0.0.1 port (see ``port``); no-op when running.

        After :meth:`stop`, starting again listens on the same port as before.

        Raises:
            OSError: if the listening socket cannot be created.
        """
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="FaultProxy", daemon=True)
        self._thread.start()
        try:
            self._run(self._listen(), timeout=10.0)
        except BaseException:
            self.stop()
            raise
        _log.info("FaultProxy %s -> %s:%d", self.url, self.upstream_host, self.upstream_port)

    def stop(self) -> None:
        """Close the listener and every connection, and stop the proxy's thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._run(self._shutdown(), timeout=5.0)
        except Exception:
            _log.exception("FaultProxy shutdown failed")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5.0)
        if not thread.is_alive():
            loop.close()
        self._loop = None
        self._thread = None

    def __enter__(self) -> FaultProxy:
        """Start the proxy (see :meth:`start`) and return it."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the proxy (see :meth:`stop`)."""
        self.stop()

    def _run(self, coro: Coroutine[Any, Any, None], timeout: float) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn)

    def _close_conns(self, which: Callable[[Connection], bool]) -> None:
        for conn in list(self._conns):
            if which(conn):
                conn.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, limit=STREAM_LIMIT, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_conns(lambda c: True)
        # Includes handlers of just-accepted connections that are not registered yet.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # -- per-connection work (event loop thread) ----------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self.connections += 1
            refuse = self._refuse
        if refuse:
            rst(writer)
            return
        conn = Connection(reader, writer)
        conn.handler = asyncio.current_task()
        self._conns.add(conn)
        try:
            await self._serve_requests(conn)
        except asyncio.CancelledError:
            # Python 3.11's start_server logs a cancelled connection handler as an error, and
            # cancellation (by close or stop) is the normal end of a stalled request.
            pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError, OSError) as exc:  # fmt: skip
            _log.debug("FaultProxy connection ended: %r", exc)
        finally:
            self._conns.discard(conn)
            conn.close()

    async def _serve_requests(self, conn: Connection) -> None:
        while (head := await read_head(conn.reader)) is not None:
            # The client waits for "100 Continue" before sending a body, or may give up
            # waiting and send it anyway, so an unforwarded body has no reliable end.
            expect_continue = "100-continue" in head.headers.get("expect", "").lower() and (
                head.chunked or head.content_length > 0
            )
            with self._lock:
                self.requests += 1
                self.seen.append((head.start_line, dict(head.headers)))
                action, status, reset_after = "forward", 0, None
                rewrite: tuple[str, str | None] | None = None
                if self._stall:
                    action = "stall"
                elif self._fail_left > 0 and (
                    self._fail_match is None or self._fail_match in head.start_line
                ):
                    self._fail_left -= 1
                    self.failed += 1
                    action, status = "fail", self._fail_status
                elif self._reset_left > 0 and (
                    self._reset_match is None or self._reset_match in head.start_line
                ):
                    self._reset_left -= 1
                    reset_after = self._reset_after
                elif (
                    self._middlebox is not None
                    and head.start_line.startswith("GET ")
                    and (self._middlebox_match is None or self._middlebox_match in head.start_line)
                ):
                    cut = None
                    if self._cut_left > 0:
                        self._cut_left -= 1
                        cut = self._cut
                    rewrite = (self._middlebox, cut)
            if action == "stall":
                conn.stalled = True
                if not expect_continue:
                    await copy_body(conn.reader, discard, head)
                await asyncio.Event().wait()  # until stall(False), refuse() or stop() cancels
            elif action == "fail":
                if not expect_continue:
                    await copy_body(conn.reader, discard, head)
                with self._lock:
                    request_id = f"asyncstore-fault-{self.failed}"
                conn.writer.write(error_response(status, head, request_id, expect_continue))
                await conn.writer.drain()
                if expect_continue:
                    return
            else:
                if self.latency > 0:
                    await asyncio.sleep(self.latency)
                await self._forward(conn, head, reset_after, rewrite)

    async def _forward(
        self,
        conn: Connection,
        head: Head,
        reset_after: int | None,
        rewrite: tuple[str, str | None] | None = None,
    ) -> None:
        if conn.upstream is None:
            # Opened lazily so that injected errors never leave an upstream exchange half done.
            conn.upstream = await asyncio.open_connection(
                self.upstream_host, self.upstream_port, limit=STREAM_LIMIT
            )
            conn.relays.spawn(self._relay_responses(conn), name="FaultProxy relay", detached=True)
        up_writer = conn.upstream[1]

        corrupt = False
        with self._lock:
            self.requests_forwarded += 1
            if (
                self._corrupt_left > 0
                and not head.chunked
                and head.content_length > 1
                and (self._corrupt_match is None or self._corrupt_match in head.start_line)
            ):
                self._corrupt_left -= 1
                self.corrupted += 1
                corrupt = True

        async def write_up(data: bytes) -> None:
            nonlocal corrupt
            if corrupt and len(data) > 0:
                damaged = bytearray(data)
                damaged[len(damaged) // 2] ^= 0x01
                data, corrupt = bytes(damaged), False
            up_writer.write(data)
            await up_writer.drain()

        # Registered before the head goes out, so the relay always finds it.
        method = head.start_line.split(" ", 1)[0].upper()
        conn.pending.append(Pending(method, reset_after, rewrite))
        conn.body_done = False
        up_writer.write(head.raw)
        await up_writer.drain()
        await copy_body(conn.reader, write_up, head)
        conn.body_done = True

    async def _relay_responses(self, conn: Connection) -> None:
        """Pass upstream responses to the client until either side closes or a reset is due."""
        down = Downstream(conn.writer)
        try:
            reset = await self._relay_loop(conn, down)
        except ResetNow:
            reset = True
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError, IndexError, OSError) as exc:  # fmt: skip
            _log.debug("FaultProxy upstream relay ended: %r", exc)
            reset = down.budget is not None
        # Upstream closing while a reset is armed still ends in a reset, as promised.
        if reset or any(p.reset_after is not None for p in conn.pending):
            await self._reset_client(conn)
        else:
            conn.close()

    async def _relay_loop(self, conn: Connection, down: Downstream) -> bool:
        """Relay responses one by one; return whether the client connection must be reset."""
        assert conn.upstream is not None
        up_reader = conn.upstream[0]
        while (head := await read_head(up_reader)) is not None:
            request = conn.pending[0] if conn.pending else Pending("GET", None)
            status = int(head.start_line.split(" ", 2)[1])
            if 100 <= status < 200:
                # Interim responses pass outside the byte budget, so a reset with a small
                # budget still lets the request body reach the server.
                conn.writer.write(head.raw)
                await conn.writer.drain()
                continue
            if request.rewrite is not None and status not in (204, 304):
                if conn.pending:
                    conn.pending.popleft()
                await self._relay_rewritten(conn, up_reader, head, *request.rewrite)
                return False  # closed after a close-delimited or cut body: see there
            down.budget = request.reset_after
            await down.write(head.raw)
            if conn.pending:
                conn.pending.popleft()
            if request.method == "HEAD" or status in (204, 304):
                pass
            elif head.chunked or "content-length" in head.headers:
                await copy_body(up_reader, down.write, head)
            else:
                while data := await up_reader.read(CHUNK):  # body runs until EOF
                    await down.write(data)
                return down.budget is not None
            if down.budget is not None:
                return True  # the whole response fitted in the byte budget
            if not conn.body_done:
                return False  # answered before the client sent its whole body; cannot resync
        return down.budget is not None

    async def _relay_rewritten(
        self,
        conn: Connection,
        up_reader: asyncio.StreamReader,
        head: Head,
        encoding: str,
        cut: str | None,
    ) -> None:
        """Send one response re-framed by the middlebox, cut if asked.

        The connection is closed afterwards in every case (an orderly FIN), which a
        close-delimited body needs anyway and which a keep-alive client survives.
        """
        parts: list[bytes] = []

        async def collect(data: bytes) -> None:
            parts.append(data)

        if head.chunked or "content-length" in head.headers:
            await copy_body(up_reader, collect, head)
            if head.chunked:  # keep the payload, not the server's framing
                parts = [unchunk(b"".join(parts))]
        else:
            while data := await up_reader.read(CHUNK):
                parts.append(data)
        response, send = rewrite(head, b"".join(parts), encoding, cut)
        with self._lock:
            self.rewritten += 1
            if cut is not None:
                self.cut += 1
        conn.writer.write(response[:send])
        await conn.writer.drain()

    async def _reset_client(self, conn: Connection) -> None:
        # Flush asyncio's buffer first: an RST discards whatever has not reached the kernel.
        conn.writer.transport.set_write_buffer_limits(high=0)
        with contextlib.suppress(ConnectionError):
            await conn.writer.drain()
        with self._lock:
            self.resets += 1
        rst(conn.writer)
        conn.close()
