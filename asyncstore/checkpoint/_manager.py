"""``Checkpointer``: a training run's checkpoints as numbered versions in one store, with
retention and resume from the newest version that verifies.

A version is one checkpoint object named by its step, zero-padded so that names sort as
steps do (``step-000001000.ckpt``). The set of versions is what the store holds: each save
is atomic (a version is there whole or not at all), so the list is right after any crash,
and no index can disagree with it.

Differential versions (the default) keep their chunks in packs under ``packs/``: each save
writes the chunks no earlier version holds into a new pack, and points into the older packs
for the rest (see :mod:`._packs` for when a pack goes).

A distributed version (saved by ``torch.distributed.checkpoint`` through
``asyncstore.torch.dcp``, every rank writing its shards) is a directory,
``step-000001000.dcp/``, laid out as :mod:`._distributed` says: it counts once its
``.metadata`` is there, and retention and ``delete`` remove it whole, ``.metadata`` first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from .._concurrency import TaskSet
from .._config import DEFAULT_SAVE_CHUNK_BYTES, DEFAULT_STAGING_BYTES, SaveConfig, build
from .._dirs import make_dir
from .._resource import AsyncResource
from ..errors import AsyncStoreError, InvalidArgument, NotFound
from ..stores import Store, is_local, local_path, open_store
from ._dcpversion import DistributedVersion
from ._handle import SaveHandle, SaveResult
from ._leases import LeaseHolder
from ._mirror import Uploader
from ._packs import PackBook, pack_name
from ._runconfig import CheckpointerConfig, CheckpointerStats, VerifyReport
from ._runview import RunView
from ._save import build_save_config, save_packed, start_save
from ._tail import Tail
from ._versions import (
    CHAIN,
    SAVED,
    Version,
    dcp_prefix,
    version_key,
)

__all__ = ["Checkpointer", "CheckpointerConfig", "CheckpointerStats", "Version", "VerifyReport"]

logger = logging.getLogger("asyncstore.checkpoint")


class Checkpointer(AsyncResource):
    """A training run's checkpoints: numbered versions in one store, retention, and resume
    from the newest version that verifies.

    Args:
        url: where the versions live (``"s3://bucket/run1"``, ``"file:///ckpt/run1"``, a
            local path); each is one object ``step-000001000.ckpt`` under it.
        keep_last: how many of the newest versions that can load retention keeps (with
            any damaged ones newer than the last of them). The newest version is the one
            saved last (``Version.saved``), also after a rollback to a lower step.
            Retention runs after each :meth:`save` of this checkpointer only: opening,
            listing, loading and verifying never delete.
        keep_every: also keep every version whose step is a multiple of this, for good.
        differential: write only the chunks that changed since the versions kept: an
            unchanged chunk (same size and xxh3) is stored as a reference to the pack of
            the version that wrote it (under ``packs/``). A pack goes once no version points
            into it. ``False`` writes each version as one self-contained object.
        full_every: with ``differential``, every this many saves one is written whole (a
            new chain): it bounds how many versions one damaged pack can take down, and
            lets packs of older chains go once their versions do. ``metadata`` then holds
            ``chain``, the version's place in its chain (0: written whole).
        compression, level, chunk_bytes, staging_bytes, exclude, priority: as for
            :func:`asyncstore.save`, for every save of the run (:meth:`save` and the
            distributed versions' writers); ``chunk_bytes`` is also the unit a
            differential save compares.
        save_config: the same options as one :class:`~asyncstore.SaveConfig` (whose
            ``metadata`` is stored with every version), instead of the keywords.
        store_options: options for :func:`open_store`.
        mirror: a second store (typically ``"s3://…"``, with ``url`` a fast local
            directory): each version commits at ``url`` first, then is copied to the
            mirror in the background, read back and compared. Retention never deletes a
            local version that the mirror does not hold yet; a version missing or damaged
            at ``url`` is read from the mirror; uploads a crash interrupted resume when
            the checkpointer is next used. A failing mirror gives warnings and retries,
            never errors in :meth:`save`.
        mirror_options: options for :func:`open_store` of the mirror.
        mirror_timeout: seconds a listing (``versions``, ``load``, retention) waits for the
            mirror before going on with the local versions alone, with a warning.
        close_timeout: seconds closing waits for uploads still running before it
            abandons them with a warning (they stay local; the next checkpointer on the
            run uploads them); ``None``: no limit.

    Use it as an async context manager. :meth:`save` returns after the snapshot, as
    :func:`asyncstore.save` does; the upload and retention run once the version commits,
    and closing waits for them.

    Raises:
        InvalidArgument: a bad option (named in the message), or a local ``url`` or
            ``mirror`` that cannot be a directory (a missing one is created).
        PermissionDenied: this process may not create that directory.
    """

    _unclosed_hint = "use 'async with Checkpointer(...)' or await aclose()"

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        compression: Literal["auto", "zstd"] | None = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        priority: Literal["low", "normal"] = "low",
        differential: bool = True,
        full_every: int = 10,
        chunk_bytes: int = DEFAULT_SAVE_CHUNK_BYTES,
        level: int = 1,
        exclude: Iterable[str] = (),
        save_config: SaveConfig | None = None,
        store_options: dict[str, Any] | None = None,
        mirror: str | os.PathLike[str] | None = None,
        mirror_options: dict[str, Any] | None = None,
        mirror_timeout: float = 10.0,
        close_timeout: float | None = 300.0,
    ) -> None:
        for name, value in (("store_options", store_options), ("mirror_options", mirror_options)):
            if value is not None and not isinstance(value, dict):
                raise InvalidArgument(f"{name}={value!r}: pass a dict of open_store options")
        if mirror is None and mirror_options:
            raise InvalidArgument("mirror_options were given without mirror; pass both")
        save = build_save_config("Checkpointer", save_config, locals())
        self._config = build(
            CheckpointerConfig,
            {
                "keep_last": keep_last,
                "keep_every": keep_every,
                "differential": differential,
                "full_every": full_every,
                "mirror_timeout": mirror_timeout,
                "close_timeout": close_timeout,
                "save": save,
            },
            "Checkpointer",
        )
        self._store_options = dict(store_options or {})
        for name, where in (("url", url), ("mirror", mirror)):
            if where is not None and is_local(os.fspath(where)):
                # A run's directory that can never be made is refused here, by name; one
                # that exists is left as it is (it may be read-only: listing and loading
                # work, and a save says why it cannot write).
                make_dir(
                    local_path(os.fspath(where)),
                    name,
                    "choose a directory this process can create, or an existing run",
                )
        self._store: Store = open_store(os.fspath(url), **self._store_options)
        self._mirror: Store | None = (
            None if mirror is None else open_store(os.fspath(mirror), **(mirror_options or {}))
        )
        self._tasks = TaskSet(f"the checkpointer at {self._store.url}")
        self._saving: set[str] = set()  # keys of this checkpointer's saves not yet ended
        self._packs = PackBook()
        self._uploader = (
            None if self._mirror is None else Uploader(self._store, self._mirror, self._packs)
        )
        self._view = RunView(self._store, self._mirror, self._packs, self._config.mirror_timeout)
        self._stats = CheckpointerStats()
        self._retaining = asyncio.Lock()  # one retention at a time: each sees the last's work
        # Distributed versions handed out here (dcp_version, for asyncstore.torch's
        # writers): a step one of them is still writing is not a leftover to remove.
        self._dcp_versions: weakref.WeakSet[DistributedVersion] = weakref.WeakSet()

    @property
    def config(self) -> CheckpointerConfig:
        """The checkpointer's options, validated."""
        return self._config

    @property
    def url(self) -> str:
        """Where the versions live."""
        return self._store.url

    @property
    def store_options(self) -> dict[str, Any]:
        """The options the run's store was opened with (a copy), to open it elsewhere."""
        return dict(self._store_options)

    def _resource_name(self) -> str:
        return f"the Checkpointer at {self._store.url}"

    async def _on_open(self) -> None:
        if self._mirror is not None:
            # Uploads a crash or an early close interrupted go on now.
            self._tasks.spawn(self._resume_uploads(), name="resume uploads", detached=True)

    async def _on_close(self) -> None:
        try:
            try:
                async with asyncio.timeout(self._config.close_timeout):
                    while self._tasks:
                        await self._tasks.join()  # uploads and retention after the last saves
            except TimeoutError:
                logger.warning(
                    "closing the checkpointer at %s: uploads still running after %.0f s "
                    "(close_timeout) are abandoned; their versions stay local, and the next "
                    "checkpointer on this run uploads them",
                    self._store.url,
                    self._config.close_timeout,
                )
            await self._tasks.aclose()
            if self._uploader is not None:
                await self._uploader.aclose()
        finally:
            try:
                await self._store.aclose()
            finally:
                if self._mirror is not None:
                    await self._mirror.aclose()

    # -- saving --------------------------------------------------------------------------------

    async def save(
        self, state: Any, step: int, *, metadata: dict[str, Any] | None = None
    ) -> SaveHandle:
        """Save ``state`` as the version of ``step``; return once it is snapshotted.

        ``await`` the handle for the :class:`SaveResult` (the commit). Once the version
        commits (and, with a mirror, its upload ends), retention deletes the versions
        ``keep_last`` and ``keep_every`` do not keep; the version just saved is the newest,
        whatever its step. Saving a step that exists replaces that version, atomically.
        ``metadata`` is stored with the version, beside its ``step``, ``saved`` (the time
        of this call) and, for a differential save, ``chain``.

        Raises:
            InvalidArgument: ``step`` is not an int >= 0, or a bad ``metadata``.
            StoreClosed: the checkpointer was closed.
        """
        await self._ensure_open()
        self._check_step(step)
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidArgument(f"metadata={metadata!r}: pass a dict with str keys, or None")
        config = self._config
        run = config.save
        # The run's options, with this version's metadata beside the run's (checked here).
        run = msgspec.structs.replace(
            run, metadata={**run.metadata, **(metadata or {}), "step": step, SAVED: time.time()}
        )
        key = version_key(step)
        self._view.damaged.discard((self._store.url, key))
        if self._uploader is not None:
            self._uploader.renew(key)  # deleted before: this save's upload may go ahead
        self._saving.add(key)
        pins: set[str] = set()
        lease: LeaseHolder | None = None
        tail: Tail | None = None
        try:
            if config.differential:
                pack = pack_name(key)
                # Under the collection lock: the packs found are pinned before a collection
                # can decide on them (a version committing meanwhile may leave the base to
                # retention). Pinned before the new pack exists, until the version naming
                # them commits or the save fails.
                async with self._packs.lock:
                    known, ids, chain = await self._view.base()
                    if chain >= config.full_every or not known:
                        known, ids, chain = {}, {}, 0  # a full save: a new chain starts
                    pins = {ref.pack for ref in known.values()} | {pack}
                    self._packs.pin(self._store, pins)
                    # And for other processes: their collections and gc() keep them too.
                    lease = LeaseHolder(self._store, pins | {key})
                    await lease.hold()
                run = msgspec.structs.replace(run, metadata={**run.metadata, CHAIN: chain})
                tail = None if self._uploader is None else Tail(pack)  # see _tail
                handle = await save_packed(state, self._store, key, pack, known, ids, run, tail)
            else:
                lease = LeaseHolder(self._store, {key})
                await lease.hold()
                tail = None if self._uploader is None else Tail(key)  # the version's file
                handle = await start_save(state, (self._store, key), run, tail=tail)
        except BaseException as exc:
            if tail is not None:
                tail.fail(exc)
                tail.close()
            self._saving.discard(key)
            await self._packs.unpin(self._store, pins)
            if lease is not None:
                await lease.release()
            raise
        handle._when_done(lambda task: self._count(task, step))
        if tail is not None and self._uploader is not None:
            tail.start(self._tasks, self._uploader.tail(key, tail))
        after = self._after_commit(handle, step, key, pins, lease, tail)
        self._tasks.spawn(after, name="retention", detached=True)
        return handle

    def _count(self, task: asyncio.Task[SaveResult], step: int) -> None:
        # As the save ends, before its awaiters resume: stats() is current once an awaited
        # handle returns.
        stats = self._stats
        if task.cancelled() or task.exception() is not None:
            stats.failed += 1
            return
        result = task.result()
        stats.saves += 1
        stats.blocking_seconds += result.snapshot_seconds
        stats.last_blocking_seconds = result.snapshot_seconds
        stats.last_total_seconds = result.total_seconds
        stats.bytes_written += result.stored_bytes
        stats.bytes_skipped += result.skipped_bytes

    async def _after_commit(
        self,
        handle: SaveHandle,
        step: int,
        key: str,
        pins: set[str],
        lease: LeaseHolder,
        tail: Tail | None,
    ) -> None:
        # The key stays in _saving until its upload ends: gc and the resumed uploads leave
        # it alone meanwhile.
        try:
            try:
                await handle.wait()  # counted in the stats by _count
                if tail is not None:
                    # The pack's upload completes (held here until then), and the
                    # version's finds it there.
                    await tail.finish()
            except BaseException as exc:
                if tail is not None:
                    tail.fail(exc)
                return  # the save's own error goes to whoever awaits its handle
            finally:
                # Named by a committed version now (or never to be).
                await self._packs.unpin(self._store, pins)
                await lease.release()
            if self._uploader is not None:
                await self._uploader.upload(key, time.time())
        finally:
            self._saving.discard(key)
        await self._retain()

    def stats(self) -> CheckpointerStats:
        """A snapshot of what this checkpointer did: saves, blocking and total seconds,
        bytes written and skipped, versions deleted, uploads to the mirror."""
        stats = msgspec.structs.replace(self._stats)
        return stats if self._uploader is None else self._uploader.counted(stats)

    async def _retain(self) -> None:
        # After a save of this checkpointer, with its own policy. The version just saved
        # needs no protection of its own: it is the newest (saved last), so in the window,
        # unless a save called after it committed meanwhile. Runs while closing too (close
        # waits for it): no open-state check here.
        config = self._config
        try:
            await self._apply_policy(config.keep_last, config.keep_every)
        except (AsyncStoreError, OSError) as exc:
            # Nothing is lost by retention not running: the next save's tries again.
            logger.warning("retention at %s did not finish (%s)", self._store.url, exc)

    async def _apply_policy(
        self,
        keep_last: int,
        keep_every: int | None,
        *,
        verify: bool = False,
        dry_run: bool = False,
    ) -> list[int]:
        # Decide on the run as a whole (both stores), then delete each victim everywhere,
        # then the packs no version points into. ``verify``: a version counts as loadable
        # only if every checksum verifies (prune), not only its manifest and packs.
        async with self._retaining:
            doomed = await self._view.victims(keep_last, keep_every, self._saving, verify=verify)
            if dry_run:
                return [version.step for version in doomed]
            for version in doomed:
                await self._delete_everywhere(version)
                self._stats.deleted += 1
            for store in self._view.stores():
                try:
                    await self._view.collect(store)
                except (AsyncStoreError, OSError) as exc:  # the next collection tries again
                    logger.warning("unused packs in %s stay for now (%s)", store.url, exc)
            return [version.step for version in doomed]

    def _uploading(self) -> set[str]:
        return set() if self._uploader is None else set(self._uploader.uploading)

    async def _delete_everywhere(self, version: Version) -> None:
        # Its upload stopped first (else it would bring the version back), then here, then
        # the mirror: a version deleted here but not there (a crash between) is listed from
        # the mirror, and the next delete or retention finishes.
        if self._uploader is not None:
            await self._uploader.abandon(version.key)
        for store in self._view.stores():
            await self._view.delete_step(store, version.step)

    async def prune(
        self, keep_last: int, keep_every: int | None = None, *, dry_run: bool = False
    ) -> list[int]:
        """Apply retention to the versions there now, with this policy instead of the
        checkpointer's, and return the steps deleted, oldest first (with ``dry_run=True``,
        those it would delete; nothing is deleted).

        As retention does (see the class), it keeps the window from the newest version
        back to the ``keep_last``-th that loads, and every version whose step is a
        multiple of ``keep_every``; here "loads" means every checksum verifies, so a
        damaged version never counts toward ``keep_last``. Then the packs no version points
        into any more go. With a mirror it decides on both stores together, deletes from
        both, and keeps a local version the mirror does not hold yet.

        Raises:
            InvalidArgument: ``keep_last`` is not an int >= 1, or ``keep_every`` is neither
                ``None`` nor an int >= 1.
            IntegrityError: the run holds versions but none verifies: nothing is deleted.
        """
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is None and name == "keep_every":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name}={value!r}: pass an int >= 1")
        if not isinstance(dry_run, bool):
            raise InvalidArgument(f"dry_run={dry_run!r}: pass True or False")
        await self._ensure_open()
        return await self._apply_policy(keep_last, keep_every, verify=True, dry_run=dry_run)

    # -- the mirror ----------------------------------------------------------------------------

    async def _resume_uploads(self) -> None:
        # What the mirror lacks (not uploaded yet, or its copy stale or damaged), newest
        # first: it matters most. No retention here: opening a run (to list or load it,
        # perhaps with other keep_last/keep_every values) never deletes anything.
        assert self._uploader is not None
        for version in await self._view.to_upload(self._saving):
            committed = time.time() if version.mtime is None else version.mtime
            await self._uploader.upload(version.key, committed)

    # -- what is there -------------------------------------------------------------------------

    async def versions(self) -> list[Version]:
        """Every committed version, oldest first: in the order they were saved
        (``Version.saved``; for a run saved step after step, the order of the steps), so
        the last is the newest, also after a rollback. With a mirror, those of either store
        (``Version.where`` says which holds it). Reads each version's manifest once (for
        its sizes, state and save time), from the local copy where there is one."""
        await self._ensure_open()
        return await self._view.describe(await self._view.listing())

    async def latest(self) -> Version | None:
        """The newest committed version (not verified), or ``None`` when there is none."""
        versions = await self.versions()
        return versions[-1] if versions else None

    async def delete(self, step: int) -> None:
        """Delete the version of ``step`` (from the mirror too). An upload of it in flight
        is stopped first (its unfinished parts discarded) and is not retried, so the mirror
        never brings it back; saving the step again uploads the new version as usual.

        Raises:
            NotFound: there is no such version.
        """
        key = version_key(self._check_step(step))
        await self._ensure_open()
        if self._uploader is not None:
            # Its upload stops first and does not start again: it would bring it back.
            await self._uploader.abandon(key)
        found = False
        for store in self._view.stores():
            if not any(v.step == step for v in await self._view.list_store(store)):
                continue
            found = True
            await self._view.delete_step(store, step)
            await self._view.collect(store)
        if not found:
            raise NotFound(f"{self._store.url}/{key} does not exist: no version of step {step}")

    def _check_step(self, step: object) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgument(f"step={step!r}: pass a version's step, an int >= 0")
        return step

    # -- loading -------------------------------------------------------------------------------

    async def load(
        self,
        step: int | None = None,
        *,
        strict: bool = False,
        map_location: Any = None,
        keys: list[str] | None = None,
        into: dict[str, Any] | None = None,
    ) -> Any:
        """Load a version: the one of ``step``, or the newest that verifies.

        With ``step=None``, a newest version that fails its checks (a flipped byte, a
        truncated file) is skipped with a warning, and the one before it is tried, down to
        the oldest; ``strict=True`` raises instead. With a mirror, a version missing or
        damaged here is read from the mirror. ``map_location``, ``keys`` and ``into`` as
        for :func:`asyncstore.load`.

        Raises:
            NotFound: there is no version (of ``step``, or at all).
            InvalidArgument: the version is a distributed one (``Version.kind == "dcp"``):
                every rank loads it with ``torch.distributed.checkpoint.load`` and
                :meth:`asyncstore.torch.Checkpointer.dcp_reader`.
            IntegrityError: the version of ``step`` is damaged; or with ``strict=True``, the
                newest one is (the message names it); or every version is.
        """
        if not isinstance(strict, bool):
            raise InvalidArgument(f"strict={strict!r}: pass True or False")
        await self._ensure_open()
        options = {"map_location": map_location, "keys": keys, "into": into}
        if step is not None:
            return await self._view.load_step(self._check_step(step), options)
        return await self._view.load_newest(options, strict=strict)

    async def verify(self, step: int, *, raise_on_error: bool = False) -> VerifyReport:
        """Check every checksum of the version of ``step`` (each copy, with a mirror; for
        a distributed version, its ``.metadata`` and every rank's object it names).

        Returns a :class:`VerifyReport`; with ``raise_on_error=True`` a damaged version
        raises its :class:`IntegrityError` instead.

        Raises:
            NotFound: there is no such version.
        """
        self._check_step(step)
        await self._ensure_open()
        return await self._view.verify_step(step, raise_on_error=raise_on_error)

    # -- distributed versions ------------------------------------------------------------------

    def dcp_url(self, step: int) -> str:
        """The directory of the distributed version of ``step``
        (``<url>/step-000001000.dcp``), where every rank reads and writes it.

        Raises:
            InvalidArgument: ``step`` is not an int >= 0.
        """
        return f"{self._store.url}/{dcp_prefix(self._check_step(step))}".rstrip("/")

    async def dcp_version(self, step: int) -> DistributedVersion:
        """Begin saving the distributed version of ``step`` from this process: what a DCP
        storage writer (``asyncstore.torch``'s ``dcp_writer``) writes it with, and reports
        to as it goes. Until it commits, :meth:`gc` and later saves leave its objects alone.

        Raises:
            InvalidArgument: ``step`` is not an int >= 0, or the checkpointer has a mirror
                (every rank writes straight to the run's store).
            StoreClosed: the checkpointer was closed.
        """
        url = self.dcp_url(step)
        if self._mirror is not None:
            raise InvalidArgument(
                f"dcp_writer: the checkpointer at {self.url} has a mirror, which distributed "
                "saves do not use (every rank writes straight to the store): point a "
                "Checkpointer without mirror at the shared store (s3://...) instead"
            )
        await self._ensure_open()
        version = DistributedVersion(self, step, url)
        self._dcp_versions.add(version)
        return version

    def dcp_damaged(self, step: int) -> None:
        """Note that a load found the distributed version of ``step`` damaged: listings
        say so (``Version.state``) until it is saved again."""
        self._view.damaged.add((self._store.url, dcp_prefix(step)))

    def _dcp_writing(self) -> set[int]:
        # Steps that writers of this process are still saving (not committed, not dropped).
        return {v.step for v in list(self._dcp_versions) if not v.committed}

    async def gc(self) -> int:
        """Remove what killed saves and uploads left, here and on the mirror: temp files and
        unfinished multipart uploads of versions and packs, packs that no version points
        into, distributed saves that never completed (no ``.metadata``) and the rank
        objects of distributed saves that a later save of the same step replaced. Returns
        how many items were removed.

        What a save or upload of any process is still busy with is left alone: each holds a
        *lease* (``leases/<token>.lease``, in the store it writes to) naming the versions
        and packs it writes or points into, from before it writes anything until its
        version commits. A lease holds while its writer may be running: on this machine
        while its process lives, elsewhere until it has not been renewed for 5 minutes.
        Dead leases are removed (and counted). Distributed saves take no lease: run it when
        no distributed save is in flight.
        """
        await self._ensure_open()
        writing = {self._store.url: set(self._saving)}
        if self._mirror is not None:
            writing[self._mirror.url] = self._uploading()
        return await self._view.remove_leftovers(writing, self._dcp_writing())
