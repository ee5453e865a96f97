"""Copying a checkpoint version to a mirror store, and the uploads of a checkpointer.

A copy is streamed in bounded memory, and checked before it counts as mirrored: against
the MD5 the server reports (S3 ETags), or else read back and compared. A differential
version's packs go first (those the mirror lacks: compared by identity, not size), the
version last: the mirror never holds a version whose packs are not all there.

:class:`Uploader` runs a checkpointer's uploads: one at a time, retried with backoff, and
abandoned when the version is deleted, so that a deleted version never comes back from
the mirror. A save's new pack goes while the save writes it (:meth:`Uploader.tail`, see
:mod:`._tail`); the version's upload after its commit then finds the pack there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

from .._concurrency import with_retries
from ..errors import AsyncStoreError, IntegrityError, NotFound
from ..stores import CheckedUploads, LentWrites, Loan, Store
from ._leases import LeaseHolder
from ._packfile import PackId
from ._packfile import whole as pack_whole
from ._runconfig import CheckpointerStats
from ._tail import Tail, Untailed

if TYPE_CHECKING:
    from ._packs import PackBook

__all__ = [
    "COPY_CHUNK_BYTES",
    "UPLOAD_ATTEMPTS",
    "UPLOAD_RETRY_SECONDS",
    "Uploader",
    "copy_object",
    "copy_version",
]

logger = logging.getLogger("asyncstore.checkpoint")

UPLOAD_ATTEMPTS = 5
UPLOAD_RETRY_SECONDS = 1.0
"""An upload to the mirror is tried this many times, the waits (the library's one retry
policy: full jitter) doubling from this; then it waits for the next checkpointer on the run
(a mirror down for a minute costs warnings)."""

COPY_CHUNK_BYTES = 8 << 20
"""Bytes read and written at a time: large enough for few requests per version, small
enough that an upload beside training holds little memory (plus the S3 writer's parts)."""


async def copy_version(
    source: Store,
    target: Store,
    key: str,
    packs: list[str],
    ids: list[tuple[int, int]] | None = None,
    *,
    name: str | None = None,
    force: bool = False,
) -> int:
    """Copy the version ``key`` and the ``packs`` it points into from ``source`` to
    ``target`` (the version as ``name``, by default ``key``; packs keep their keys, which
    are relative to the version's directory), each checked; return the bytes copied.

    A pack the target holds already is not copied again when it is the one the version
    recorded (``ids``, the manifest's ``pack_ids``: size and index checksum); a pack of an
    earlier release, which has no identity, when its size matches. ``force`` copies every
    pack (to repair a target whose pack failed its checks further in).

    Raises:
        NotFound: ``key`` or a pack is no longer in ``source`` (deleted meanwhile).
        IntegrityError: a copy read back differs; it was deleted from ``target``.
        StoreUnavailable, StoreError: a store failed.
    """
    copied = 0
    recorded = dict(zip(packs, ids or [], strict=False))
    for pack in packs:
        if not force and await _holds(source, target, pack, recorded.get(pack)):
            continue
        copied += await copy_object(source, target, pack)
    return copied + await copy_object(source, target, key, name)


async def _holds(source: Store, target: Store, pack: str, recorded: tuple[int, int] | None) -> bool:
    # Whether ``target`` holds ``pack`` already: the one recorded (size and index
    # checksum), or for an earlier release's pack, which has no identity, one of its size.
    if recorded is not None:
        return await pack_whole(target, pack, PackId(*recorded)) is None
    try:
        return (await target.stat(pack)).size == (await source.stat(pack)).size
    except NotFound:
        return False


async def copy_object(source: Store, target: Store, key: str, name: str | None = None) -> int:
    """Copy the object ``key`` from ``source`` to ``target`` (as ``name``, by default
    ``key``) and check the copy; return its size.

    The target's writer makes the copy appear whole or not at all. Where the target's server
    checked every part against the checksum sent with it (S3's CRC32C, see
    :class:`CheckedUploads`), that is the check; otherwise the copy is read back and its
    xxh3 compared with the bytes sent.

    Raises:
        NotFound: ``key`` is no longer in ``source`` (deleted meanwhile).
        IntegrityError: the copy read back differs; it was deleted from ``target``.
        StoreUnavailable, StoreError: a store failed.
    """
    name = key if name is None else name
    async with source.open_reader(key, chunk_bytes=COPY_CHUNK_BYTES) as reader:
        return await send_checked(target, name, reader, f"{source.url}/{key}")


async def send_checked(
    target: Store,
    name: str,
    chunks: AsyncIterable[bytes | memoryview | tuple[memoryview, Loan]],
    origin: str,
) -> int:
    """Write ``chunks`` to ``target`` as ``name``, all at once or not at all, and check the
    copy as :func:`copy_object` does; return its size. ``origin`` names where the bytes
    come from, for the error.

    Each chunk is done with once the next is asked for (its buffer may be reused), unless
    it comes with a :class:`~asyncstore.stores.Loan` (see :meth:`Tail.chunks`): then a
    writer that takes lent memory keeps a view of it, and the loan is released here once
    the chunk is written. An error from ``chunks`` aborts the write: nothing appears under
    ``name``.
    """
    sent = xxhash.xxh3_64()
    size = 0
    writer = target.open_writer(name)
    async with writer:
        async for chunk in chunks:
            if not isinstance(chunk, tuple):
                sent.update(chunk)
                size += len(chunk)
                await writer.write(chunk)
                continue
            view, loan = chunk
            sent.update(view)
            size += len(view)
            try:
                if isinstance(writer, LentWrites):
                    await writer.write_lent(view, loan)
                else:
                    await writer.write(view)
            finally:
                loan.release()
    if isinstance(writer, CheckedUploads) and writer.server_checked:
        return size  # the server checked each part against the bytes sent
    back = xxhash.xxh3_64()
    read = 0
    async with target.open_reader(name, chunk_bytes=COPY_CHUNK_BYTES) as reader:
        async for chunk in reader:
            back.update(chunk)
            read += len(chunk)
    if read != size or back.intdigest() != sent.intdigest():
        await target.delete(name)
        raise IntegrityError(
            f"{target.url}/{name}: the copy read back differs from {origin} "
            f"({read} bytes against {size}); it was deleted and is uploaded again"
        )
    return size


class Uploader:
    """The uploads of one checkpointer's versions from its store to its mirror.

    One at a time (bounded memory beside training), each retried with doubling waits
    (:func:`~asyncstore._concurrency.with_retries`) and a warning, then left for the next
    checkpointer on the run. :meth:`abandon` stops the
    upload of a version being deleted and keeps it from starting again; an upload that
    finds, once done, that its version was deleted meanwhile (by another process) removes
    its copy again.
    """

    def __init__(self, local: Store, mirror: Store, packs: PackBook) -> None:
        self.local = local
        self.mirror = mirror
        self._packs = packs
        self._slot = asyncio.Lock()  # one upload at a time
        self.uploading: set[str] = set()  # keys being copied now
        self._running: dict[str, asyncio.Task[None]] = {}
        self._abandoned: set[str] = set()
        self.uploads = 0
        self.failures = 0
        self.last_seconds = 0.0
        self.last_lag_seconds = 0.0
        self.bytes = 0  # copied to the mirror, checked
        self.early_bytes = 0  # of those, read back while their save was still writing
        # A key whose pack the mirror took as it was written: when that began, the pin and
        # lease that keep the pack there (nothing names it yet) until the version is, and
        # whether the file sent was the version itself (a full version: nothing to copy).
        self._tailed: dict[str, tuple[float, contextlib.AsyncExitStack, bool]] = {}
        self._tailing: dict[str, asyncio.Task[None]] = {}  # file key -> its tail, running

    async def aclose(self) -> None:
        """Let go of the packs held for versions whose uploads never came (the
        checkpointer closed first)."""
        tailed, self._tailed = self._tailed, {}
        for _, holding, _ in tailed.values():
            await holding.aclose()

    def counted(self, stats: CheckpointerStats) -> CheckpointerStats:
        """``stats`` with this uploader's counters."""
        return msgspec.structs.replace(
            stats,
            uploads=self.uploads,
            upload_failures=self.failures,
            last_upload_seconds=self.last_seconds,
            last_upload_lag_seconds=self.last_lag_seconds,
            bytes_uploaded=self.bytes,
            bytes_uploaded_early=self.early_bytes,
        )

    def renew(self, key: str) -> None:
        """``key`` is being saved again: its uploads may go ahead."""
        self._abandoned.discard(key)

    async def abandon(self, key: str) -> None:
        """Stop the upload of ``key`` (cancelled, its unfinished parts discarded by the
        writer) and keep it from starting again until :meth:`renew`; return once it ended."""
        self._abandoned.add(key)
        task = self._running.get(key)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def upload(self, key: str, committed: float) -> bool:
        """Copy ``key`` (committed locally at ``committed``, Unix seconds) to the mirror,
        retried with backoff; ``False`` when it gave up or was abandoned.

        A version whose pack went to the mirror as it was written (:meth:`tail`) counts its
        upload's time from the pack's start, and keeps the pack held there until now; a
        version that is its own data (not differential) and went that way is not copied
        again.
        """
        tailed, holding, whole = self._tailed.pop(key, (None, contextlib.AsyncExitStack(), False))
        async with holding:
            return await self._upload(key, committed, tailed, whole)

    async def _upload(self, key: str, committed: float, tailed: float | None, whole: bool) -> bool:
        started = time.monotonic()

        async def attempt() -> bool:
            nonlocal started
            started = time.monotonic()
            return await self._run(key, lambda: self._copy(key, whole))

        def retrying(exc: Exception, attempt: int, delay: float) -> None:
            self.failures += 1
            logger.warning(
                "uploading %s to the mirror %s failed (%s); retrying in %.1f s",
                key,
                self.mirror.url,
                exc,
                delay,
            )

        def gave_up(exc: Exception, attempts: int) -> Exception:
            self.failures += 1
            logger.warning(
                "uploading %s to the mirror %s failed %d times (%s); it stays local, "
                "and the next checkpointer on this run uploads it",
                key,
                self.mirror.url,
                attempts,
                exc,
            )
            return _GaveUp()

        try:
            if not await with_retries(
                attempt,
                max_attempts=UPLOAD_ATTEMPTS,
                base_delay=UPLOAD_RETRY_SECONDS,
                max_delay=math.inf,  # doubling all the way: attempts bound the wait
                retryable=_worth_retrying,
                exhausted=gave_up,
                what=f"upload of {key}",
                on_retry=retrying,
            ):
                return False
        except NotFound:
            return False  # deleted here meanwhile: nothing to upload
        except _GaveUp:
            return False
        self.uploads += 1
        self.last_seconds = time.monotonic() - (started if tailed is None else tailed)
        # Wall clock: a resumed upload's version was committed by an earlier process.
        self.last_lag_seconds = max(0.0, time.time() - committed)
        return True

    async def tail(self, key: str, tail: Tail) -> None:
        """Upload the pack ``tail`` follows while the save of ``key`` writes it, reading the
        local file back as it grows; the mirror's copy completes once the version commits
        locally (:meth:`Tail.release`). The :meth:`upload` of ``key`` that follows then
        finds the pack in the mirror and copies the version alone.

        Never raises but a cancellation: a save that fails or writes no pack, an abandoned
        key or a failing mirror leave the pack to :meth:`upload` (which retries and warns).
        """
        running = asyncio.current_task()
        assert running is not None
        # The same file saved again (a full version of the same step) goes after the one
        # before it, so that the mirror ends with the newer.
        while (previous := self._tailing.get(tail.key)) is not None:
            await asyncio.wait([previous])
        self._tailing[tail.key] = running
        try:
            # Outside the upload slot: it waits for the local write most of the time, and
            # the previous version's upload must not wait behind it.
            await self._run(key, lambda: self._send_tail(key, tail), slot=False)
        except Untailed:
            pass
        except Exception as exc:  # the upload after the commit tries again, and warns
            logger.info(
                "uploading %s to the mirror %s while it was written failed (%s); it is "
                "uploaded once its version commits",
                tail.key,
                self.mirror.url,
                exc,
            )
        finally:
            del self._tailing[tail.key]

    async def _run(
        self, key: str, work: Callable[[], Coroutine[Any, Any, None]], *, slot: bool = True
    ) -> bool:
        # ``work`` for ``key`` (in the upload slot, one at a time, unless ``slot`` is
        # False), where abandon() can cancel it; False when it was abandoned (before it
        # started, or cancelled by abandon()).
        async with self._slot if slot else contextlib.nullcontext():
            if key in self._abandoned:
                return False
            task = asyncio.ensure_future(work())
            self._running[key] = task
            self.uploading.add(key)
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task.cancelled() and not (current and current.cancelling()):
                    return False  # abandoned: the version is being deleted
                raise
            finally:
                self.uploading.discard(key)
                del self._running[key]
        return True

    @contextlib.asynccontextmanager
    async def _holding(self, key: str, packs: set[str]) -> AsyncIterator[None]:
        # Packs being copied before the version that names them: pinned here until it
        # commits there, and leased for other processes' collections and gc().
        self._packs.pin(self.mirror, packs)
        lease = LeaseHolder(self.mirror, packs | {key})
        try:
            await lease.hold()
            yield
        finally:
            await self._packs.unpin(self.mirror, packs)
            await lease.release()

    async def _send_tail(self, key: str, tail: Tail) -> None:
        tail.check()  # a save that failed before this began: nothing to send
        started = time.monotonic()
        async with contextlib.AsyncExitStack() as holding:
            await holding.enter_async_context(self._holding(key, {tail.key}))
            origin = f"{self.local.url}/{tail.key}"
            async with contextlib.aclosing(tail.chunks(COPY_CHUNK_BYTES)) as chunks:
                size = await send_checked(self.mirror, tail.key, chunks, origin)
            # Held on until the version's upload: a collection would take the pack meanwhile.
            self._tailed[key] = (started, holding.pop_all(), tail.key == key)
        self.bytes += size
        self.early_bytes += tail.early_bytes

    async def _copy(self, key: str, whole: bool) -> None:
        # ``whole``: the tail sent the version itself (a full version): nothing to copy.
        copied = 0
        if not whole:
            info = await self.local.stat(key)
            stamp = (info.mtime, info.etag)
            manifest = await self._packs.manifest(self.local, key, info.size, stamp)
            # A pack an earlier save's tail is still sending (a version that names its
            # packs can commit as soon as theirs did): copied only if that tail fails.
            tailing = [self._tailing[p] for p in manifest.packs if p in self._tailing]
            if tailing:
                await asyncio.wait(tailing)
            async with self._holding(key, set(manifest.packs)):
                copied = await copy_version(
                    self.local, self.mirror, key, manifest.packs, manifest.pack_ids
                )
        # Deleted here while it was copied (by another process: this one abandons its
        # uploads first)? Then the copy would bring it back: it goes too.
        try:
            await self.local.stat(key)
        except NotFound:
            logger.info("%s was deleted during its upload; removing its copy", key)
            await self.mirror.delete(key)
            self._packs.forget(self.mirror, key)
            raise
        self.bytes += copied


class _GaveUp(Exception):
    """An upload failed every attempt (logged already): it waits for the next checkpointer."""


def _worth_retrying(exc: BaseException) -> bool:
    # A store's failures (and the OS errors under them) may pass; a deleted source does not.
    return isinstance(exc, AsyncStoreError | OSError) and not isinstance(exc, NotFound)
