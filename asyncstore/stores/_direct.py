"""Appending to a file around the page cache (``O_DIRECT``), for large objects written once.

A buffered write copies every byte into the page cache, and the kernel later writes the
dirty pages back; for a multi-GB checkpoint that costs a core's worth of copying and, once
the dirty limit is reached, throttles the writer far below the device's speed. With
``O_DIRECT`` the device reads the caller's buffer itself. The kernel then asks that the
buffer's address, the length and the file offset be multiples of the logical block size:

- data whose address lines up with its file offset (modulo :data:`ALIGN`) goes straight from
  the caller's buffer: a partial block at its head or tail is merged through a small aligned
  bounce buffer;
- anything else (compressed chunks, small headers) is copied through the bounce buffer, which
  is written out whenever it fills.

The last partial block is written through an ordinary descriptor. Where the file system
refuses ``O_DIRECT`` (tmpfs, some network file systems), or a direct write fails with
``EINVAL``, the appender carries on with ordinary writes: slower, never wrong.

Not thread-safe: one thread at a time (the local writer serialises its calls).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from .._iov import ALIGN

__all__ = ["ALIGN", "DirectAppender", "address_of"]

# The bounce buffer: large enough that unaligned data leaves in few, large writes.
_BOUNCE = 4 << 20
# Below this, data is copied through the bounce buffer even when it lines up: not worth a
# system call of its own.
_DIRECT_MIN = 64 << 10


def address_of(data: memoryview) -> int | None:
    """The address of a writable buffer's first byte; ``None`` for read-only buffers."""
    if data.readonly or not data.c_contiguous:
        return None
    if not len(data):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


class DirectAppender:
    """Appends bytes to the file behind ``fd`` (open for writing, empty), bypassing the page
    cache where the file system allows it.

    Call :meth:`finish` after the last :meth:`write`; until then up to one bounce buffer of
    data may be held back. ``fd`` stays the caller's to fsync and close.
    """

    def __init__(self, path: str, fd: int) -> None:
        self._fd = fd
        self._direct_fd: int | None
        try:
            self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            # No direct I/O on this file system (EINVAL), or the file cannot be opened a
            # second time for writing (a read-only umask): the caller's descriptor serves.
            self._direct_fd = None
        self._bounce = mmap.mmap(-1, _BOUNCE)  # page-aligned
        self._bounce_view = memoryview(self._bounce)
        self._start = 0  # file offset of the bounce buffer's first byte (aligned)
        self._pending = 0  # bytes waiting in the bounce buffer
        self.direct_bytes = 0  # bytes that went from the caller's buffers, without a copy

    @property
    def direct(self) -> bool:
        """Whether writes still bypass the page cache."""
        return self._direct_fd is not None

    @property
    def position(self) -> int:
        """Bytes appended so far."""
        return self._start + self._pending

    @property
    def settled(self) -> int:
        """Bytes in the file for good: a reader of the file sees them, and they never change
        (the bounce buffer's part is not there yet)."""
        return self._start

    def write(self, data: memoryview) -> None:
        """Append ``data`` (a flat byte view); the caller may reuse it once this returns."""
        if self._direct_fd is None:
            self._drain()
            self._pwrite(self._fd, data, self._start)
            self._start += len(data)
            return
        address = address_of(data)
        position = self.position
        if address is None or len(data) < _DIRECT_MIN or (address - position) % ALIGN:
            self._stage(data)
            return
        head = -position % ALIGN
        self._stage(data[:head])  # completes the bounce buffer's last block
        self._flush()  # leaves nothing: the position is aligned now
        body = (len(data) - head) // ALIGN * ALIGN
        if self._direct_fd is None:  # that flush was refused direct I/O: no more tries
            self._pwrite(self._fd, data[head : head + body], self._start)
        elif self._write_direct(data[head : head + body]):
            self.direct_bytes += body
        self._start += body
        self._stage(data[head + body :])

    def finish(self) -> None:
        """Write what the bounce buffer still holds; the file then has every byte."""
        self._flush()
        self._drain()  # less than a block: through the page cache

    def close(self) -> None:
        """Close the direct descriptor (not the caller's ``fd``)."""
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None

    # -- internals ---------------------------------------------------------------------------

    def _stage(self, data: memoryview) -> None:
        while len(data):
            room = _BOUNCE - self._pending
            n = min(room, len(data))
            self._bounce_view[self._pending : self._pending + n] = data[:n]
            self._pending += n
            data = data[n:]
            if self._pending == _BOUNCE:
                self._flush()

    def _drain(self) -> None:
        # Everything the bounce buffer holds, through the ordinary descriptor.
        if self._pending:
            self._pwrite(self._fd, self._bounce_view[: self._pending], self._start)
            self._start += self._pending
            self._pending = 0

    def _flush(self) -> None:
        # Write the bounce buffer's whole blocks; a partial last block stays, moved to the
        # front (there is none when the position is aligned).
        blocks = self._pending // ALIGN * ALIGN
        if not blocks:
            return
        if self._direct_fd is None:
            self._pwrite(self._fd, self._bounce_view[:blocks], self._start)
        else:
            self._write_direct(self._bounce_view[:blocks])
        self._start += blocks
        tail = self._pending - blocks
        if tail:
            self._bounce_view[:tail] = self._bounce_view[blocks : self._pending]
        self._pending = tail

    def _write_direct(self, data: memoryview) -> bool:
        # ``data`` is aligned in address and length, and goes at the aligned self._start.
        # Whether it went direct (not through the page cache after a refusal).
        if not len(data):
            return True
        assert self._direct_fd is not None
        try:
            self._pwrite(self._direct_fd, data, self._start)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # A block size larger than ALIGN, or a device that refuses it after all: the
            # rest goes through the page cache (rewriting any part already written).
            self.close()
            self._pwrite(self._fd, data, self._start)
            return False
        return True

    @staticmethod
    def _pwrite(fd: int, data: memoryview, offset: int) -> None:
        while len(data):
            written = os.pwrite(fd, data, offset)
            if written <= 0:
                raise OSError(errno.EIO, "the file accepted no bytes")
            data = data[written:]
            offset += written
