"""``Checkpointer``: a training run's checkpoints as numbered versions in one store, with
retention and resume from the newest version that verifies.

A version is one checkpoint object named by its step, zero-padded so that names sort as
steps do (``step-000001000.ckpt``). The set of versions is what the store holds: each save
is atomic (a version is there whole or not at all), so the list is right after any crash,
and no index can disagree with it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Annotated, Any, Literal

import msgspec

from .._concurrency import TaskSet
from .._config import DEFAULT_STAGING_BYTES, build
from .._resource import AsyncResource
from ..errors import IntegrityError, InvalidArgument, NotFound
from ..stores import CleansUpWrites, Store, open_store
from ._handle import SaveHandle
from ._load import load as _load
from ._save import save as _save

__all__ = ["Checkpointer", "CheckpointerConfig", "CheckpointerStats", "Version", "VerifyReport"]

logger = logging.getLogger("asyncstore.checkpoint")

PREFIX = "step-"
SUFFIX = ".ckpt"
DIGITS = 9
_NAME = re.compile(rf"^{PREFIX}(\d{{{DIGITS},}}){re.escape(SUFFIX)}$")


def version_key(step: int) -> str:
    """The key of the version of ``step``: ``step-000001000.ckpt``."""
    return f"{PREFIX}{step:0{DIGITS}d}{SUFFIX}"


class CheckpointerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of :class:`Checkpointer`; see its docstring for each."""

    keep_last: Annotated[int, msgspec.Meta(ge=1)] = 3
    """Three: a damaged newest version still leaves two to fall back on, at three times a
    checkpoint's size on disk."""

    keep_every: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Nothing kept for good unless asked: long-term versions are a choice of the run."""

    compression: Literal["auto", "zstd"] | None = "auto"
    """As for :func:`asyncstore.save`."""

    staging_bytes: Annotated[int, msgspec.Meta(ge=4096)] = DEFAULT_STAGING_BYTES
    """As for :func:`asyncstore.save`."""

    priority: Literal["low", "normal"] = "low"
    """As for :func:`asyncstore.save`."""


class Version(msgspec.Struct, frozen=True):
    """One committed version of a run's checkpoints.

    Attributes:
        step: the training step it was saved at.
        key: its key in the store (``step-000001000.ckpt``).
        size: bytes stored.
        mtime: when it was committed (Unix seconds, from the store; ``None`` if unknown).
        where: ``"local"`` or ``"mirror"``: the store that holds it.
    """

    step: int
    key: str
    size: int
    mtime: float | None
    where: Literal["local", "mirror"] = "local"


class CheckpointerStats(msgspec.Struct):
    """What a :class:`Checkpointer` did so far (a snapshot: see :meth:`Checkpointer.stats`).

    Attributes:
        saves: versions committed.
        failed: saves that raised or were cancelled.
        blocking_seconds: time callers waited in :meth:`~Checkpointer.save` (the snapshots),
            summed.
        last_blocking_seconds, last_total_seconds: the newest committed save's snapshot,
            and its time from the call to the commit.
        bytes_written: bytes stored by committed saves.
        bytes_skipped: bytes not rewritten because an earlier version holds them (0 until
            differential saves).
        deleted: versions retention removed.
    """

    saves: int = 0
    failed: int = 0
    blocking_seconds: float = 0.0
    last_blocking_seconds: float = 0.0
    last_total_seconds: float = 0.0
    bytes_written: int = 0
    bytes_skipped: int = 0
    deleted: int = 0


class VerifyReport(msgspec.Struct, frozen=True):
    """What :meth:`Checkpointer.verify` found.

    Attributes:
        step: the version checked.
        ok: every chunk matched its checksum.
        error: what was wrong, when not ``ok``.
    """

    step: int
    ok: bool
    error: str | None = None


class Checkpointer(AsyncResource):
    """A training run's checkpoints: numbered versions in one store, retention, and resume
    from the newest version that verifies.

    Args:
        url: where the versions live (``"s3://bucket/run1"``, ``"file:///ckpt/run1"``, a
            local path); each is one object ``step-000001000.ckpt`` under it.
        keep_last: how many of the newest versions retention keeps.
        keep_every: also keep every version whose step is a multiple of this, for good.
        compression, staging_bytes, priority: as for :func:`asyncstore.save`.
        store_options: options for :func:`open_store`.

    Use it as an async context manager. :meth:`save` returns after the snapshot, as
    :func:`asyncstore.save` does; retention runs once the version commits, and closing
    waits for it.

    Raises:
        InvalidArgument: a bad option (named in the message).
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
        store_options: dict[str, Any] | None = None,
    ) -> None:
        if store_options is not None and not isinstance(store_options, dict):
            raise InvalidArgument(
                f"store_options={store_options!r}: pass a dict of open_store options"
            )
        self._config = build(
            CheckpointerConfig,
            {
                "keep_last": keep_last,
                "keep_every": keep_every,
                "compression": compression,
                "staging_bytes": staging_bytes,
                "priority": priority,
            },
            "Checkpointer",
        )
        self._store: Store = open_store(os.fspath(url), **(store_options or {}))
        self._tasks = TaskSet(f"the checkpointer at {self._store.url}")
        self._saving: set[str] = set()  # keys of this checkpointer's saves not yet ended
        self._stats = CheckpointerStats()

    @property
    def config(self) -> CheckpointerConfig:
        """The checkpointer's options, validated."""
        return self._config

    @property
    def url(self) -> str:
        """Where the versions live."""
        return self._store.url

    def _resource_name(self) -> str:
        return f"the Checkpointer at {self._store.url}"

    async def _on_close(self) -> None:
        try:
            while self._tasks:
                await self._tasks.join()  # retention after the last saves
            await self._tasks.aclose()
        finally:
            await self._store.aclose()

    # -- saving --------------------------------------------------------------------------------

    async def save(
        self, state: Any, step: int, *, metadata: dict[str, Any] | None = None
    ) -> SaveHandle:
        """Save ``state`` as the version of ``step``; return once it is snapshotted.

        ``await`` the handle for the :class:`SaveResult` (the commit). Once the version
        commits, retention deletes the versions ``keep_last`` and ``keep_every`` do not keep
        (only ones older than it). Saving a step that exists replaces that version,
        atomically. ``metadata`` is stored with the version, beside its ``step``.

        Raises:
            InvalidArgument: ``step`` is not an int >= 0, or a bad ``metadata``.
            StoreClosed: the checkpointer was closed.
        """
        await self._ensure_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgument(f"step={step!r}: pass the training step, an int >= 0")
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidArgument(f"metadata={metadata!r}: pass a dict with str keys, or None")
        config = self._config
        key = version_key(step)
        self._saving.add(key)
        try:
            handle = await _save(
                state,
                (self._store, key),
                compression=config.compression,
                staging_bytes=config.staging_bytes,
                priority=config.priority,
                metadata={**(metadata or {}), "step": step},
            )
        except BaseException:
            self._saving.discard(key)
            raise
        self._tasks.spawn(self._after_commit(handle, step, key), name="retention", detached=True)
        return handle

    async def _after_commit(self, handle: SaveHandle, step: int, key: str) -> None:
        try:
            result = await handle.wait()
        except BaseException:
            self._stats.failed += 1
            return  # the save's own error goes to whoever awaits its handle
        finally:
            self._saving.discard(key)
        stats = self._stats
        stats.saves += 1
        stats.blocking_seconds += result.snapshot_seconds
        stats.last_blocking_seconds = result.snapshot_seconds
        stats.last_total_seconds = result.total_seconds
        stats.bytes_written += result.stored_bytes
        await self._retain(newest=step)

    def stats(self) -> CheckpointerStats:
        """A snapshot of what this checkpointer did: saves, blocking and total seconds,
        bytes written and skipped, versions deleted."""
        return msgspec.structs.replace(self._stats)

    async def _retain(self, newest: int) -> None:
        # Counted up to the version just committed, which is always kept: a newer one may
        # belong to another save, and is not this retention's to judge.
        # Runs while closing too (close waits for it): no open-state check here.
        versions = [v for v in await self._list() if v.step <= newest]
        kept = {v.step for v in versions[-self._config.keep_last :]}
        every = self._config.keep_every
        for version in versions:
            if version.step in kept or (every is not None and version.step % every == 0):
                continue
            await self._store.delete(version.key)
            self._stats.deleted += 1

    # -- what is there -------------------------------------------------------------------------

    async def versions(self) -> list[Version]:
        """Every committed version, oldest first."""
        await self._ensure_open()
        return await self._list()

    async def _list(self) -> list[Version]:
        found: list[Version] = []
        async for info in self._store.list(PREFIX):
            match = _NAME.match(info.key)
            if match is None:
                continue  # not a version: another file in the same place
            found.append(Version(int(match.group(1)), info.key, info.size, info.mtime))
        found.sort(key=lambda v: v.step)
        return found

    async def latest(self) -> Version | None:
        """The newest committed version (not verified), or ``None`` when there is none."""
        versions = await self.versions()
        return versions[-1] if versions else None

    async def delete(self, step: int) -> None:
        """Delete the version of ``step``.

        Raises:
            NotFound: there is no such version.
        """
        key = version_key(self._check_step(step))
        await self._ensure_open()
        await self._store.stat(key)  # NotFound, naming it, when there is none
        await self._store.delete(key)

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
        the oldest; ``strict=True`` raises instead. ``map_location``, ``keys`` and ``into``
        as for :func:`asyncstore.load`.

        Raises:
            NotFound: there is no version (of ``step``, or at all).
            IntegrityError: the version of ``step`` is damaged; or with ``strict=True``, the
                newest one is (the message names it); or every version is.
        """
        if not isinstance(strict, bool):
            raise InvalidArgument(f"strict={strict!r}: pass True or False")
        await self._ensure_open()
        options = {"map_location": map_location, "keys": keys, "into": into}
        if step is not None:
            key = version_key(self._check_step(step))
            return await _load((self._store, key), **options)
        versions = await self.versions()
        if not versions:
            raise NotFound(f"{self._store.url} holds no checkpoint versions ({PREFIX}*{SUFFIX})")
        failures: list[str] = []
        for version in reversed(versions):
            try:
                return await _load((self._store, version.key), **options)
            except (IntegrityError, NotFound) as exc:
                # NotFound: deleted by another process's retention since it was listed.
                if strict:
                    raise IntegrityError(
                        f"the newest version, step {version.step} "
                        f"({self._store.url}/{version.key}), does not load: {exc}"
                    ) from exc
                failures.append(f"step {version.step}: {exc}")
                logger.warning(
                    "checkpoint version step %d at %s does not load (%s); trying the one before it",
                    version.step,
                    f"{self._store.url}/{version.key}",
                    exc,
                )
        raise IntegrityError(f"no version at {self._store.url} loads: " + "; ".join(failures))

    async def verify(self, step: int, *, raise_on_error: bool = False) -> VerifyReport:
        """Check every checksum of the version of ``step``.

        Returns a :class:`VerifyReport`; with ``raise_on_error=True`` a damaged version
        raises its :class:`IntegrityError` instead.

        Raises:
            NotFound: there is no such version.
        """
        key = version_key(self._check_step(step))
        await self._ensure_open()
        try:
            # Loading reads and checks every chunk; the tensors are dropped at once.
            await _load((self._store, key), map_location="cpu")
        except IntegrityError as exc:
            if raise_on_error:
                raise
            return VerifyReport(step, False, str(exc))
        return VerifyReport(step, True)

    async def gc(self) -> int:
        """Remove what killed saves left (temp files, unfinished multipart uploads) under
        version names; returns how many items were removed.

        This checkpointer's own saves in flight are left alone, and so is a local temp file
        whose writer is alive. S3 cannot tell a killed save's upload from a live one's: run
        it when no other process saves to this run.
        """
        await self._ensure_open()
        store = self._store
        if not isinstance(store, CleansUpWrites):
            return 0
        removed = 0
        for key in await store.abandoned_writes(PREFIX):
            if _NAME.match(key) and key not in self._saving:
                removed += await store.clean_up_writes(key)
        return removed
