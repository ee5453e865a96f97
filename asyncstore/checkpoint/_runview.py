"""A run as one view over its store and mirror: which versions there are, which copy
serves each, what each one is (size, state, save time), whether it can load; and removing
a version or the packs nothing points into. :class:`Checkpointer` decides when; this
module knows how, in one place."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Hashable
from typing import Any

import msgspec

from ..errors import AsyncStoreError, IntegrityError, InvalidArgument, NotFound
from ..stores import CleansUpWrites, Store
from . import _distributed as dist_layout
from . import _format as fmt
from ._codec import Known
from ._format import PACK_NAME
from ._leases import LEASES, live_keys
from ._load import load as _load
from ._load import verify as _verify
from ._packfile import PackId
from ._packfile import whole as pack_whole
from ._packs import PACKS, PackBook
from ._retention import Candidate, newest_first, victims
from ._runconfig import VerifyReport
from ._versions import (
    CHAIN,
    PREFIX,
    SUFFIX,
    Copy,
    Version,
    dcp_prefix,
    identity,
    in_save_order,
    is_version_key,
    merge,
    saved_of,
    scan,
    version_key,
)

__all__ = ["RunView"]

logger = logging.getLogger("asyncstore.checkpoint")


class RunView:
    """The versions of a run in ``store`` (and ``mirror``), as one list.

    Attributes:
        damaged: copies a load or verify found damaged, as (store URL, key), until the
            step is saved again.
    """

    def __init__(
        self, store: Store, mirror: Store | None, packs: PackBook, mirror_timeout: float
    ) -> None:
        self.store = store
        self.mirror = mirror
        self.packs = packs
        self.mirror_timeout = mirror_timeout
        self.damaged: set[tuple[str, str]] = set()
        self.noted: set[str] = set()  # what listings warned about already
        # Packs found whole, by (store URL, key): their stat and identity at the time.
        self._whole: dict[tuple[str, str], tuple[Hashable, PackId]] = {}

    def stores(self) -> list[Store]:
        return [self.store] if self.mirror is None else [self.store, self.mirror]

    def copies(self, version: Version) -> list[Store]:
        # Where to read a version from: the local copy first.
        stores: list[Store] = []
        if version.where in ("local", "both"):
            stores.append(self.store)
        if self.mirror is not None and version.where in ("mirror", "both"):
            stores.append(self.mirror)
        return stores

    async def scan(self, store: Store) -> tuple[list[Version], list[int]]:
        return await scan(store)

    async def list_store(self, store: Store) -> list[Version]:
        return (await self.scan(store))[0]

    async def listing(self) -> list[Version]:
        # The run's versions, by step: with a mirror, each step served by the copies
        # that agree (see _versions.merge).
        local = await self.list_store(self.store)
        if self.mirror is None:
            return local
        here = await self.weigh(self.store, local)
        try:
            async with asyncio.timeout(self.mirror_timeout):
                there = await self.weigh(self.mirror, await self.list_store(self.mirror))
        except TimeoutError:
            logger.warning(
                "the mirror %s did not answer within %.1f s; listing the local versions only",
                self.mirror.url,
                self.mirror_timeout,
            )
            there = {}
        except (AsyncStoreError, OSError) as exc:
            # A resume must not depend on the mirror: the local versions are listed alone.
            logger.warning(
                "the mirror %s cannot be listed (%s); listing the local versions only",
                self.mirror.url,
                exc,
            )
            there = {}
        merged, notes = merge(here, there)
        for note in notes:
            if note not in self.noted:  # once per process, not at every listing
                self.noted.add(note)
                logger.warning("%s (mirror %s): %s", self.store.url, self.mirror.url, note)
        return merged

    async def _manifest(self, store: Store, version: Version) -> fmt.Manifest | None:
        # The version's manifest in ``store`` (read once per process and object), or None
        # when it does not read (damaged).
        # Raises: NotFound: deleted since it was listed.
        try:
            return await self.packs.manifest(store, version.key, version.size, version.stamp)
        except IntegrityError:
            return None

    async def weigh(self, store: Store, versions: list[Version]) -> dict[int, Copy]:
        # Each version's identity and save time in ``store``, from its manifest (read once
        # per process; None when it does not read). Deleted meanwhile: left out.
        copies = {}
        for version in versions:
            fallback = version.saved or version.mtime or 0.0
            if version.kind == "dcp":
                copies[version.step] = Copy(version, None, fallback)
                continue
            try:
                manifest = await self._manifest(store, version)
            except NotFound:
                continue
            if manifest is None:
                copies[version.step] = Copy(version, None, fallback)
            else:
                copies[version.step] = Copy(version, identity(manifest), saved_of(manifest))
        return copies

    async def describe(self, listed: list[Version]) -> list[Version]:
        described = []
        for version in listed:
            store = self.copies(version)[0]
            state = version.state
            if (store.url, version.key) in self.damaged:
                state = "damaged"
            if version.kind == "dcp":
                described.append(
                    msgspec.structs.replace(version, state=state, stored_bytes=version.size)
                )
                continue
            try:
                manifest = await self._manifest(store, version)
            except NotFound:
                continue  # deleted since it was listed
            if manifest is None:
                described.append(msgspec.structs.replace(version, state="damaged"))
                continue
            described.append(
                msgspec.structs.replace(
                    version,
                    state=state,
                    raw_bytes=manifest.raw_bytes,
                    stored_bytes=manifest.stored_bytes,
                    saved=saved_of(manifest),
                )
            )
        return in_save_order(described)

    async def base(self) -> tuple[Known, dict[str, PackId], int]:
        # What a differential save builds on: the chunks of the newest version here whose
        # manifest reads, the identities of the packs they lie in, and how many
        # differential saves since the last full one led to it. Only the newest: its chunks
        # are the state as last saved, and packs that older chains point into can go once
        # those versions do.
        # Newest by when it was saved: after a rollback, the rolled-back state.
        here = await self.list_store(self.store)
        for version in reversed(await self.describe(here)):
            if version.kind == "dcp":
                continue  # saved by every rank, not by this checkpointer: nothing to build on
            try:
                manifest = await self._manifest(self.store, version)
            except NotFound:
                manifest = None
            if manifest is None:
                continue  # damaged, or deleted meanwhile: build on the one before
            chain = manifest.metadata.get(CHAIN)
            if isinstance(chain, bool) or not isinstance(chain, int) or chain < 0:
                return {}, {}, 0  # not a differential version of this run: start a chain
            ids = await self.whole_packs(version.key, manifest)
            known: Known = {}
            self.packs.chunks_of(manifest, known)
            return {k: ref for k, ref in known.items() if ref.pack in ids}, ids, chain + 1
        return {}, {}, 0

    async def whole_packs(self, key: str, manifest: fmt.Manifest) -> dict[str, PackId]:
        # The packs of ``manifest`` that are what it recorded (size and index checksum): a
        # save points only into those. One that is missing, truncated, replaced or of an
        # earlier release has its chunks written again, so that no version commits on top
        # of a pack that cannot serve it.
        recorded = dict(zip(manifest.packs, map(PackId._make, manifest.pack_ids), strict=False))
        whole: dict[str, PackId] = {}
        for name in manifest.packs:
            expected = recorded.get(name)
            reason = await self.pack_problem(self.store, name, expected)
            if reason is None and expected is not None:
                whole[name] = expected
            elif expected is not None:  # an earlier release's pack is expected: no warning
                logger.warning(
                    "%s/%s: not building on its pack %s (%s); this save writes those chunks again",
                    self.store.url,
                    key,
                    name,
                    reason,
                )
        return whole

    async def pack_problem(self, store: Store, name: str, expected: PackId | None) -> str | None:
        """Why the pack ``name`` in ``store`` is not the one ``expected`` describes (see
        :func:`._packfile.whole`); ``None`` when it is. Its trailer and index are read
        once per state of the object: again only when its size, mtime or ETag changed
        (every save's base and retention ask about the same packs)."""
        if expected is None:
            return await pack_whole(store, name, None)
        try:
            info = await store.stat(name)
        except NotFound:
            return "missing"
        state = ((info.size, info.mtime, info.etag), expected)
        if self._whole.get((store.url, name)) == state:
            return None
        problem = await pack_whole(store, name, expected)
        if problem is None:
            if len(self._whole) > 4096:
                self._whole.clear()  # a run's packs are far fewer: stale entries
            self._whole[(store.url, name)] = state
        return problem

    async def load_version(self, version: Version, options: dict[str, Any]) -> Any:
        if version.kind == "dcp":
            raise InvalidArgument(
                f"step {version.step} ({self.store.url}/{version.key}) is a distributed "
                "checkpoint: load it on every rank with torch.distributed.checkpoint.load("
                f"state, storage_reader=checkpointer.dcp_reader({version.step}))"
            )
        error: Exception | None = None
        copies = self.copies(version)
        for store in copies:
            try:
                return await _load((store, version.key), **options)
            except (IntegrityError, NotFound) as exc:
                # NotFound: deleted by another process's retention since it was listed.
                if isinstance(exc, IntegrityError):
                    self.damaged.add((store.url, version.key))
                if len(copies) > 1:
                    logger.warning("%s/%s does not load (%s)", store.url, version.key, exc)
                error = exc
        assert error is not None
        raise error

    async def load_step(self, step: int, options: dict[str, Any]) -> Any:
        """Load the version of ``step`` with ``load``'s ``options``."""
        for version in await self.listing():  # the listing only: the load reads its manifest
            if version.step == step:
                return await self.load_version(version, options)
        return await _load((self.store, version_key(step)), **options)  # NotFound, naming it

    async def load_newest(self, options: dict[str, Any], *, strict: bool) -> Any:
        """Load the newest version that loads (with ``strict``, the newest or an error),
        with ``load``'s ``options``; each one passed over is logged."""
        # In the order they were saved: the newest last.
        versions = await self.describe(await self.listing())
        if not versions:
            raise NotFound(f"{self.store.url} holds no checkpoint versions ({PREFIX}*{SUFFIX})")
        failures: list[str] = []
        for version in reversed(versions):
            try:
                return await self.load_version(version, options)
            except (IntegrityError, NotFound) as exc:
                if strict:
                    raise IntegrityError(
                        f"the newest version, step {version.step} "
                        f"({self.store.url}/{version.key}), does not load: {exc}"
                    ) from exc
                failures.append(f"step {version.step}: {exc}")
                logger.warning(
                    "checkpoint version step %d at %s does not load (%s); trying the one before it",
                    version.step,
                    f"{self.store.url}/{version.key}",
                    exc,
                )
        raise IntegrityError(f"no version at {self.store.url} loads: " + "; ".join(failures))

    async def verify_step(self, step: int, *, raise_on_error: bool) -> VerifyReport:
        """Check every checksum of every copy of the version of ``step``, noting what it
        finds in :attr:`damaged`."""
        key = version_key(step)
        version = next((v for v in await self.listing() if v.step == step), None)
        if version is None:
            raise NotFound(f"{self.store.url}/{key} does not exist: no version of step {step}")
        for store in self.copies(version):
            try:
                if version.kind == "dcp":
                    await self.verify_distributed(store, version)
                else:
                    await _verify((store, key))
            except IntegrityError as exc:
                self.damaged.add((store.url, version.key))
                if raise_on_error:
                    raise
                return VerifyReport(step, False, str(exc))
            self.damaged.discard((store.url, version.key))
        return VerifyReport(step, True)

    async def to_upload(self, saving: set[str]) -> list[Version]:
        """The versions the mirror lacks (not uploaded yet, or its copy stale or damaged),
        newest first, each verified here first: an upload must not spread damage that
        happened here since the save (a damaged one is marked so and left out). ``saving``:
        keys this process is saving (their uploads follow their commits)."""
        try:
            versions = await self.describe(await self.listing())
        except (AsyncStoreError, OSError) as exc:
            logger.warning("versions not uploaded yet stay local for now (%s)", exc)
            return []
        chosen = []
        for version in reversed(versions):
            if (
                version.where != "local"
                or version.kind != "checkpoint"
                or version.state == "damaged"
                or version.key in saving
            ):
                continue
            try:
                await _verify((self.store, version.key))
            except IntegrityError as exc:
                self.damaged.add((self.store.url, version.key))
                logger.warning(
                    "%s/%s is damaged (%s); not uploading it", self.store.url, version.key, exc
                )
                continue
            except NotFound:
                continue
            chosen.append(version)
        return chosen

    async def victims(
        self, keep_last: int, keep_every: int | None, saving: set[str], *, verify: bool
    ) -> list[Version]:
        """The versions retention deletes with this policy, decided on the run as a whole
        (both stores; see :mod:`._retention`), oldest first. ``saving``: keys this process
        is still saving or uploading (kept). ``verify``: a version counts as loadable only
        if every checksum verifies (prune), not only its manifest and packs.

        Raises:
            IntegrityError: with ``verify``, the run holds versions and none verifies.
        """
        described = await self.describe(await self.listing())
        candidates = [
            Candidate(
                v.step,
                float(position),  # the save order (see _versions.in_save_order)
                v.key in saving
                # With a mirror, a version only here is the only copy until uploaded.
                or (self.mirror is not None and v.where == "local" and v.kind != "dcp"),
            )
            for position, v in enumerate(described)
        ]
        by_step = {v.step: v for v in described}
        checked: list[Candidate] = []
        good = 0
        for candidate in newest_first(candidates):
            if good < keep_last:
                loadable = await self.loadable(by_step[candidate.step], verify)
                good += loadable
                candidate = candidate._replace(loadable=loadable)
            checked.append(candidate)
        if verify and described and not good:
            raise IntegrityError(
                f"no version of the run at {self.store.url} verifies (steps "
                f"{', '.join(str(v.step) for v in described)}): prune deleted nothing. "
                "Check the versions with 'asyncstore verify'; delete damaged ones by step"
            )
        return [by_step[step] for step in victims(checked, keep_last, keep_every)]

    async def loadable(self, version: Version, verify: bool) -> bool:
        # Whether some copy of ``version`` can serve a load: every checksum (``verify``), or
        # what is cheap to check: its manifest (or .metadata) reads, and every pack it
        # points into is the one it recorded. A copy a load found damaged is not counted.
        for store in self.copies(version):
            if (store.url, version.key) in self.damaged:
                continue
            try:
                if version.kind == "dcp":
                    if verify:
                        await self.verify_distributed(store, version)
                    else:
                        await dist_layout.read_metadata(store, version.key)
                elif verify:
                    await _verify((store, version.key))
                else:
                    info = await store.stat(version.key)
                    manifest = await self.packs.manifest(
                        store, version.key, info.size, (info.mtime, info.etag)
                    )
                    for name, recorded in itertools.zip_longest(manifest.packs, manifest.pack_ids):
                        expected = None if recorded is None else PackId(*recorded)
                        if expected is None:  # an earlier release's: there, at least
                            await store.stat(name)
                        elif await self.pack_problem(store, name, expected) is not None:
                            raise IntegrityError(f"its pack {name} is not whole")
            except (IntegrityError, NotFound) as exc:
                logger.info("%s/%s does not count as loadable (%s)", store.url, version.key, exc)
                continue
            return True
        return False

    async def verify_distributed(self, store: Store, version: Version) -> None:
        metadata = await dist_layout.read_metadata(store, version.key)
        for name in sorted(dist_layout.objects_named(metadata)):
            if not dist_layout.RANK_OBJECT.match(name):
                raise IntegrityError(
                    f"{store.url}/{version.key}{dist_layout.METADATA} names {name!r}, "
                    "which is not a rank's object"
                )
            try:
                await _verify((store, version.key + name))
            except NotFound:
                raise IntegrityError(
                    f"{store.url}/{version.key}{name} is missing: the distributed version "
                    f"of step {version.step} lost a rank's shards"
                ) from None

    async def delete_step(self, store: Store, step: int) -> None:
        # Whichever way the step was saved (both, if it was saved again the other way).
        key = version_key(step)
        await store.delete(key)
        self.packs.forget(store, key)
        await dist_layout.remove_checkpoint(store, dcp_prefix(step))

    async def collect(self, store: Store) -> int:
        # The packs no version there points into any more (nor a save or upload in flight).
        async with self.packs.lock:

            async def versions() -> list[tuple[str, int, Hashable]]:
                listed = await self.list_store(store)
                return [(v.key, v.size, v.stamp) for v in listed if v.kind == "checkpoint"]

            return await self.packs.collect(store, versions)

    async def remove_leftovers(self, writing_keys: dict[str, set[str]], writing: set[int]) -> int:
        """What killed saves and uploads left, in both stores (see ``Checkpointer.gc``);
        ``writing_keys``: by store URL, the keys this process is writing there;
        ``writing``: the steps distributed saves of this process are writing. Returns how
        many items were removed."""
        removed = 0
        for store in (self.store, self.mirror):
            if store is None:
                continue
            versions, unfinished = await self.scan(store)
            for step in unfinished:  # distributed saves that did not complete
                if step not in writing:
                    removed += await dist_layout.remove_unnamed(store, dcp_prefix(step), set())
            for version in versions:
                if version.kind == "dcp" and version.step not in writing:
                    # The rank objects of saves it replaced, or that were killed.
                    try:
                        metadata = await dist_layout.read_metadata(store, version.key)
                    except (IntegrityError, NotFound):
                        continue  # damaged, or deleted meanwhile: left as it is
                    keep = dist_layout.objects_named(metadata) | {dist_layout.METADATA}
                    removed += await dist_layout.remove_unnamed(store, version.key, keep)
            if isinstance(store, CleansUpWrites):
                # The writes first, then the leases: a writer leases its keys before it
                # starts writing them, so a write in the listing of a live writer is leased.
                version_writes = await store.abandoned_writes(PREFIX)
                pack_writes = await store.abandoned_writes(PACKS)
                leased, dead = await live_keys(store)
                removed += dead
                busy = writing_keys.get(store.url, set())
                for key in version_writes:
                    if is_version_key(key) and key not in busy | leased:
                        removed += await store.clean_up_writes(key)
                for key in pack_writes:
                    if PACK_NAME.match(key) and key not in self.packs.pinned(store) | leased:
                        removed += await store.clean_up_writes(key)
                for key in await store.abandoned_writes(LEASES):  # a lease's own write
                    if key.endswith(".lease"):
                        removed += await store.clean_up_writes(key)
            removed += await self.collect(store)
        return removed
