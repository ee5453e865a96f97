"""Following a pack while its save writes it: the mirror uploads it as it grows.

(A full version, not differential, is its own data: its file is followed the same way.)

Uploading a version only after its local commit makes the mirror's copy arrive after the
local write *and* the upload, one after the other. Feeding the mirror from the save's
staging memory instead would hold slabs until the mirror took them (a slow mirror would
stall the next snapshot). So the mirror reads the local file back as it grows:

- the save's pack sink (:class:`TailedSink`) reports, after each write, how many leading
  bytes of its file are written for good (an ``O_DIRECT`` writer holds back up to a bounce
  buffer), and when the pack commits or is given up;
- the mirror's upload (:meth:`Tail.chunks`) reads those bytes back through its own
  descriptors, opened on the temporary file as the write begins, so that it reads exactly
  this save's bytes whatever later happens to the file's name. It reads around the page
  cache (``O_DIRECT``) into aligned buffers where the file system allows it: the pack was
  written around it, and filling the page cache to read it back costs more CPU than the
  whole upload (0.5 CPU seconds per 256 MiB on this project's test machine, against 0.02
  for a direct read). Each buffer is lent to the mirror's writer (a
  :class:`~asyncstore.stores.Loan`: its parts keep views, no copy) and read into again
  once returned; the writer's own back-pressure bounds how many are out;
- its last chunk comes only once the manager says the version naming the pack committed
  locally (:meth:`Tail.release`): the mirror's multipart upload completes after that, and
  the mirror never holds a pack (or version) that the local store does not.

A save that fails, is cancelled or writes no pack ends the chunks with :class:`Untailed`:
the upload is aborted and nothing appears in the mirror.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import mmap
import os
from collections import deque
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

from .._concurrency import TaskSet, forget_errors, to_thread
from .._iov import ALIGN
from ..errors import AsyncStoreError, IntegrityError
from ..stores import Loan
from ._target import Sink, StoreSink

__all__ = ["Tail", "TailedSink", "Untailed"]


# Read buffers not lent out, by size, kept from save to save (up to _KEPT of each size): a
# fresh buffer costs a page fault per 4 KiB page on its first read (about 0.4 core-s per
# GiB read on this project's test machine), a kept one nothing.
_FREE: dict[int, list[mmap.mmap]] = {}
_KEPT = 16
# Chunks read ahead of the upload, while its writer waits for parts to leave. A read that
# comes during the save's last fsync waits for the device's write cache to be flushed
# (0.25-0.3 s of a 256 MiB save on this project's test machine), and so did the upload; with
# reads ahead, it sends what was read while the file was written.
_AHEAD = 4


def _read_buffer(size: int) -> mmap.mmap:
    # A page-aligned buffer (for direct reads), every page faulted in with one system call.
    free = _FREE.get(size)
    if free:
        return free.pop()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


def _keep(size: int, buffer: mmap.mmap) -> None:
    free = _FREE.setdefault(size, [])
    if len(free) < _KEPT:
        free.append(buffer)


class Untailed(AsyncStoreError):
    """The pack is not uploaded as it is written (its save failed or wrote no pack, or its
    store is not a local directory): its version is uploaded after the commit instead."""


class Tail:
    """One pack being written locally, as the mirror's upload sees it.

    Written to by the save (:meth:`attach`, :meth:`grew`, :meth:`committed`,
    :meth:`fail`) and the manager (:meth:`release`), read by the upload (:meth:`chunks`),
    all on one event loop.
    """

    def __init__(self, key: str) -> None:
        self.key = key  # the pack's key, in the local store and the mirror alike
        self._fd: int | None = None
        self._direct_fd: int | None = None  # the same file, read around the page cache
        self._direct_refused = False  # a direct read failed with EINVAL: not tried again
        self._settled = 0  # leading bytes of the file written for good
        self._size: int | None = None  # the whole pack's size, once it committed
        self._released = False  # the version naming it committed
        self._failure: Untailed | None = None
        self._changed = asyncio.Event()
        self.early_bytes = 0  # bytes read for the mirror before the release
        self.upload: asyncio.Task[None] | None = None  # the mirror's upload of the pack

    # -- the save's side ---------------------------------------------------------------------

    def attach(self, sink: Sink) -> Sink:
        """Follow the file ``sink`` writes (open, not written to yet); return the sink the
        save must write through. A sink that is not a local file is not followed."""
        progress = sink.settled() if isinstance(sink, StoreSink) else None
        if not isinstance(sink, StoreSink) or progress is None:
            self.fail(Untailed(f"{sink.url} is not a local file"))
            return sink
        try:
            self._fd = os.open(progress[0], os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self.fail(Untailed(f"cannot read {sink.url} back as it is written: {exc}"))
            return sink
        with contextlib.suppress(OSError):  # no direct I/O here (tmpfs): the page cache
            self._direct_fd = os.open(progress[0], os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        return TailedSink(sink, self)

    def grew(self, settled: int) -> None:
        """The file's first ``settled`` bytes are written for good."""
        if settled > self._settled:
            self._settled = settled
            self._changed.set()

    def committed(self, size: int) -> None:
        """The pack committed locally with ``size`` bytes: the file holds all of them."""
        self._size = self._settled = size
        self._changed.set()

    def release(self) -> None:
        """The version naming the pack committed locally: its upload may complete."""
        self._released = True
        if self._size is None and self._failure is None:
            self.fail(Untailed("the save wrote no pack"))
        self._changed.set()

    def fail(self, failure: BaseException) -> None:
        """The pack will not commit, or its version will not (``failure`` says why): the
        upload is abandoned."""
        if self._failure is None:
            self._failure = (
                failure
                if isinstance(failure, Untailed)
                else Untailed(f"the save failed: {failure!r}")
            )
        self._changed.set()

    def start(self, tasks: TaskSet, upload: Coroutine[Any, Any, None]) -> None:
        """Run ``upload``, the mirror's upload of the pack, in ``tasks``; the descriptors
        close once it has ended, however (never started, cancelled, failed)."""
        try:
            self.upload = tasks.spawn(upload, name="mirror tail", detached=True)
        except BaseException:
            self.close()
            raise
        self.upload.add_done_callback(lambda _: self.close())

    async def finish(self) -> None:
        """:meth:`release`, then wait for the upload (which never raises)."""
        self.release()
        if self.upload is not None:
            await asyncio.wait([self.upload])

    def check(self) -> None:
        """Raise the reason the pack is not followed, if there is one already.

        Raises:
            Untailed: the save failed, wrote no pack, or was not followed.
        """
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Close the descriptors the upload reads through (once it has ended)."""
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct_fd = None

    # -- the upload's side -------------------------------------------------------------------

    async def chunks(self, chunk_bytes: int) -> AsyncGenerator[tuple[memoryview, Loan], None]:
        """The pack's bytes in order, ``chunk_bytes`` (a multiple of 4096) at a time, each as
        soon as it is written; the last once the version committed. Up to 4 chunks are
        read ahead of the one the consumer holds.

        Each chunk comes with the :class:`~asyncstore.stores.Loan` of its buffer: the chunk
        stays valid until the loan is returned, and the consumer releases the loan once it
        has handed the chunk on (a writer that keeps a view retains it). Buffers come back
        for later chunks as their loans are returned; a new one is made when none has.

        Raises:
            Untailed: the save failed, wrote no pack, or was not followed.
            IntegrityError: the file ended before what the save reported.
        """
        # Reads in flight or done, in order: (offset, length, read, its buffer).
        reads: deque[tuple[int, int, asyncio.Future[memoryview], mmap.mmap]] = deque()
        planned = 0  # bytes whose reads have started

        def read_ahead() -> bool:
            # Start the reads of the chunks written, up to _AHEAD not handed on yet; whether
            # the pack is whole (every read started once ``reads`` empties).
            nonlocal planned
            end = self._settled
            whole = self._size is not None and self._released
            while len(reads) < _AHEAD and (
                end - planned >= chunk_bytes or (whole and planned < end)
            ):
                n = min(chunk_bytes, end - planned)
                buffer = _read_buffer(chunk_bytes)
                reading = to_thread(self._read, memoryview(buffer), planned, n, background=True)
                reads.append((planned, n, asyncio.ensure_future(reading), buffer))
                planned += n
            return whole

        try:
            while True:
                self.check()
                if not reads:
                    whole = read_ahead()
                    if not reads:
                        if whole:
                            return
                        self._changed.clear()
                        await self._changed.wait()
                        continue
                offset, n, read, buffer = reads[0]
                data = await read
                reads.popleft()
                if len(data) != n:
                    _keep(chunk_bytes, buffer)
                    raise IntegrityError(
                        f"{self.key}: the file read back ends at {offset + len(data)} bytes, "
                        f"though {offset + n} were written"
                    )
                if not self._released:
                    self.early_bytes += n
                read_ahead()  # read on while the consumer waits to send this one
                yield data, Loan(functools.partial(_keep, chunk_bytes, buffer))
        finally:
            # Reads not handed on: stopped, each once its thread is done with its buffer
            # (even if this is cancelled again meanwhile: the descriptors close after this),
            # and their buffers kept.
            pending = [read for _, _, read, _ in reads]
            for read in pending:
                read.cancel()
            while not all(read.done() for read in pending):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(pending)
            forget_errors(pending)
            for _, _, _, buffer in reads:
                _keep(chunk_bytes, buffer)

    def _read(self, buffer: memoryview, offset: int, n: int) -> memoryview:
        # ``n`` bytes from ``offset`` (a multiple of ALIGN) into ``buffer``: fewer only at
        # the end of the file. Direct reads ask for whole blocks; the bytes past ``n`` (of
        # a block still being written, or past the end) are not used.
        # Several reads run at once (in threads): the descriptors stay open until close().
        direct = self._direct_fd
        if direct is not None and not self._direct_refused:
            try:
                got = os.preadv(direct, [buffer[: -(-n // ALIGN) * ALIGN]], offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Refused after all (a larger block size): the page cache from here on.
                self._direct_refused = True
            else:
                return buffer[: min(got, n)]
        assert self._fd is not None  # the save attached the file before it grew
        return buffer[: os.preadv(self._fd, [buffer[:n]], offset)]


class TailedSink(Sink):
    """A local pack's sink that tells its :class:`Tail` how far the file is written."""

    def __init__(self, sink: StoreSink, tail: Tail) -> None:
        self.url = sink.url
        self._sink = sink
        self._tail = tail

    @property
    def direct_bytes(self) -> int:
        return self._sink.direct_bytes

    async def write(self, data: memoryview | bytes | bytearray, loan: Loan | None = None) -> None:
        await self._sink.write(data, loan)
        progress = self._sink.settled()
        if progress is not None:
            self._tail.grew(progress[1])

    def unlend(self) -> None:
        self._sink.unlend()

    async def commit(self) -> None:
        await self._sink.commit()
        self._tail.committed(self._sink.bytes_written)

    async def abort(self, exc: BaseException) -> None:
        self._tail.fail(exc)
        await self._sink.abort(exc)
