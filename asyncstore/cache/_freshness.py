"""Whether a cached entry still matches its object in the store (``validate="etag"``).

With ``validate="none"`` a cached entry is trusted forever (immutable datasets) and nothing
here asks the store. With ``validate="etag"`` the cache remembers the ETag each entry was
fetched at, and the ETag last seen for each object with when it was seen; an object's ETag is
asked of the store again (``stat``) once ``ttl`` seconds have passed, and an entry whose
ETag no longer matches is stale.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Literal

from ..stores import Store
from ._memory import MemoryTier
from ._plan import PlanTier
from ._stats import StoreFetchStats


class Freshness:
    """The ETags a cache keeps for ``validate="etag"``, and the checks against the store."""

    def __init__(
        self,
        store: Store,
        validate: Literal["none", "etag"],
        ttl: float,
        stats: StoreFetchStats,
    ) -> None:
        self._store = store
        self.validate = validate
        self._ttl = ttl
        self._stats = stats
        self._entry_etags: dict[str, str | None] = {}  # cache key -> ETag it was fetched at
        self._checked: dict[str, tuple[str | None, float]] = {}  # key -> last ETag, when

    async def current_etag(self, key: str) -> str | None:
        """The object's ETag, asked of the store when the last answer is ``ttl`` old
        (``None`` without validation)."""
        if self.validate == "none":
            return None
        checked = self._checked.get(key)
        now = time.monotonic()
        if checked is not None and now - checked[1] < self._ttl:
            return checked[0]
        info = await self._store.stat(key)
        self._stats.revalidations += 1
        self._checked[key] = (info.etag, now)
        return info.etag

    async def fresh(self, cache_key: str, key: str, memory: MemoryTier | PlanTier) -> bool:
        """Whether the entry ``cache_key`` (of object ``key``) may be served; a stale one is
        dropped from ``memory``."""
        if self.validate == "none":
            return True
        current = await self.current_etag(key)
        if self._entry_etags.get(cache_key) == current:
            return True
        memory.discard(cache_key)
        self._entry_etags.pop(cache_key, None)
        return False

    def fetched(self, cache_key: str, etag: str | None) -> None:
        """Remember the ETag the entry ``cache_key`` was fetched at."""
        if self.validate == "etag":
            self._entry_etags[cache_key] = etag

    def seen(self, key: str, etag: str | None) -> None:
        """Remember ``etag`` as the object's current ETag, seen now."""
        self._checked[key] = (etag, time.monotonic())

    def forget(self, key: str, cache_keys: Iterable[str]) -> None:
        """Forget the object ``key`` and what is known of its entries ``cache_keys``."""
        for cache_key in cache_keys:
            self._entry_etags.pop(cache_key, None)
        self._checked.pop(key, None)

    def clear(self) -> None:
        """Forget every ETag."""
        self._entry_etags.clear()
        self._checked.clear()
