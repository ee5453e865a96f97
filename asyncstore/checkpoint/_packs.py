"""The packs of a run's differential versions: which chunks they hold, which packs each
version points into, and which packs nothing points to any more.

A pack is written once, by one save, and never changed; versions point into the packs of
earlier ones. Whether a pack is still needed is decided by reachability: it is kept while a
committed version's manifest names it, or while a save or upload of this process that will
name it is in flight (a *pin*). Counting references would need an update beside every
commit and delete, which a crash between the two would leave wrong.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Awaitable, Callable, Hashable

from ..errors import AsyncStoreError, NotFound
from ..stores import Store
from . import _format as fmt
from ._codec import Known, Ref
from ._leases import live_keys
from ._load import read_manifest

__all__ = ["PACKS", "PackBook", "pack_name"]

logger = logging.getLogger("asyncstore.checkpoint")

PACKS = "packs/"


def pack_name(version_key: str) -> str:
    """A new pack's key for the version ``version_key``: unique, so that saving a step
    again never writes over a pack that the committed version of that step points into."""
    stem = version_key.rsplit(".", 1)[0]
    return f"{PACKS}{stem}-{secrets.token_hex(4)}.pack"


class PackBook:
    """Manifests of a run's versions (read once per version and cached), the chunks their
    packs hold, and pins on packs that saves and uploads in flight will point into."""

    def __init__(self) -> None:
        # By store, key, size and stamp (mtime, ETag): a version saved again is read again.
        self._manifests: dict[tuple[str, str, int, Hashable], fmt.Manifest] = {}
        self._pins: dict[str, collections.Counter[str]] = {}
        # Held while a collection decides and deletes, and to drop a pin: a version that
        # commits meanwhile keeps its packs pinned until the collection has finished.
        self.lock = asyncio.Lock()

    async def manifest(self, store: Store, key: str, size: int, stamp: Hashable) -> fmt.Manifest:
        """The verified manifest of the version ``key``, cached by its size and ``stamp``
        (what tells one object under ``key`` from another: mtime and ETag).

        Raises:
            IntegrityError: it is damaged.
            NotFound: it was deleted meanwhile.
        """
        cache_key = (store.url, key, size, stamp)
        manifest = self._manifests.get(cache_key)
        if manifest is None:
            manifest = await read_manifest((store, key))
            if len(self._manifests) > 4096:
                self._manifests.clear()  # a run's versions are far fewer: stale entries
            self._manifests[cache_key] = manifest
        return manifest

    def forget(self, store: Store, key: str) -> None:
        """Drop the cached manifests of ``key`` in ``store`` (deleted)."""
        for cached in [k for k in self._manifests if k[0] == store.url and k[1] == key]:
            del self._manifests[cached]

    @staticmethod
    def chunks_of(manifest: fmt.Manifest, known: Known) -> None:
        """Add the chunks ``manifest``'s packs hold to ``known``."""
        for storage in manifest.storages:
            for index, chunk in enumerate(storage.chunks):
                pack = storage.pack_of(index)
                if pack != fmt.INLINE:
                    known[(chunk.raw, chunk.raw_xxh3)] = Ref(manifest.packs[pack], chunk)

    # -- pins --------------------------------------------------------------------------------

    def pin(self, store: Store, packs: set[str]) -> None:
        """Keep ``packs`` in ``store`` from collection until :meth:`unpin`."""
        self._pins.setdefault(store.url, collections.Counter()).update(packs)

    async def unpin(self, store: Store, packs: set[str]) -> None:
        """Undo :meth:`pin` (once no collection is deciding)."""
        async with self.lock:
            pins = self._pins.get(store.url)
            if pins is not None:
                pins.subtract(packs)
                for name in packs:
                    if pins[name] <= 0:
                        del pins[name]

    def pinned(self, store: Store) -> set[str]:
        """The packs in ``store`` pinned now."""
        return set(self._pins.get(store.url, ()))

    # -- collection --------------------------------------------------------------------------

    async def collect(
        self,
        store: Store,
        list_versions: Callable[[], Awaitable[list[tuple[str, int, Hashable]]]],
    ) -> int:
        """Delete the packs in ``store`` that no committed version points into, no pin of
        this process and no live lease of any process (see :mod:`._leases`) names; return
        how many. Called with :attr:`lock` held.

        The packs are listed first, then the leases, then the versions (``list_versions``:
        key, size and stamp of every committed version there): a pack a save in flight
        created is in the listing only if its lease is too, or if the version naming it
        committed before the lease went, and is then in the versions' listing.

        A version whose manifest cannot be read (damaged) might point anywhere: nothing is
        collected then, with a warning.
        """
        assert self.lock.locked()
        packs = [info.key async for info in store.list(PACKS) if fmt.PACK_NAME.match(info.key)]
        if not packs:
            return 0
        leased, _ = await live_keys(store)
        reachable: set[str] = set()
        for key, size, stamp in await list_versions():
            try:
                manifest = await self.manifest(store, key, size, stamp)
            except NotFound:
                continue  # deleted meanwhile: it points nowhere now
            except AsyncStoreError as exc:
                logger.warning(
                    "not removing unused packs in %s: the manifest of %s does not read (%s)",
                    store.url,
                    key,
                    exc,
                )
                return 0
            reachable.update(manifest.packs)
        removed = 0
        keep = reachable | leased | self.pinned(store)
        for pack in packs:
            if pack not in keep:
                await store.delete(pack)
                removed += 1
        return removed
