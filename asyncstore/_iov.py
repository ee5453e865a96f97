"""Vectored reads and writes (``preadv``/``pwritev``) over lists of buffers, and the
alignment direct I/O asks of them."""

from __future__ import annotations

import os

__all__ = ["ALIGN", "IOV_MAX", "advance"]

ALIGN = 4096
"""A multiple of every logical block size in use (512 and 4096 bytes): what direct I/O asks
of a buffer's address, a length and a file offset, and what staging buffers are aligned to."""

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""Most buffers one vectored call takes."""


def advance(buffers: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes of ``buffers`` in place, after a call that moved only
    part of them: the buffers it finished go, and the next one starts where it stopped."""
    while buffers and done >= len(buffers[0]):
        done -= len(buffers[0])
        buffers.pop(0)
    if buffers and done:
        buffers[0] = buffers[0][done:]
