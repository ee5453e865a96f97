"""One client connection of the fault proxy: its state, the requests whose responses are
still to be relayed, the writer to the client that stops at an armed reset's byte budget,
and closing it with a TCP RST.

:mod:`asyncstore.testing._proxy` decides what happens to each request; this module holds
what it decides about.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

from .._concurrency import TaskSet


class ResetNow(Exception):
    """Raised by the response relay once the armed reset's byte budget is spent."""


def rst(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP RST instead of an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Downstream:
    """Writes to the client, raising :class:`ResetNow` when an armed byte budget is spent."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.budget: int | None = None  # response bytes left before a reset; None: no reset

    async def write(self, data: bytes) -> None:
        """Pass ``data`` on, up to the budget; raise :class:`ResetNow` once it is spent."""
        if self.budget is not None:
            data = data[: self.budget]
            self.budget -= len(data)
        if data:
            self.writer.write(data)
            await self.writer.drain()
        if self.budget == 0:
            raise ResetNow


@dataclass
class Pending:
    """A forwarded request whose response has not been relayed completely yet."""

    method: str
    reset_after: int | None  # response bytes to pass before a reset; None: no reset
    rewrite: tuple[str, str | None] | None = None  # middlebox (encoding, cut); None: relay


class Connection:
    """State of one proxied client connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.pending: deque[Pending] = deque()
        self.body_done = True
        self.stalled = False
        self.handler: asyncio.Task[Any] | None = None  # the task serving this connection
        self.relays = TaskSet("a FaultProxy connection")

    def close(self) -> None:
        """Close both sides, stop the relays, and cancel the handler unless it is the caller."""
        self.writer.close()
        if self.upstream is not None:
            self.upstream[1].close()
        self.relays.cancel()
        if self.handler is not None and self.handler is not asyncio.current_task():
            self.handler.cancel()
