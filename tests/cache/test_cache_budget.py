"""The disk tier's budget holds at every instant: bursts of concurrent misses, in one process
and in several, sampled while they run."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncstore
from asyncstore.cache import TieredCache
from asyncstore.cache._disk import DiskTier

pytestmark = pytest.mark.anyio

MB = 1_000_000
ENTRY_SLACK = 4096  # an entry's header: source, key, ETag and lengths


def directory_bytes(directory: Path, seen: list[str] | None = None) -> int:
    """Every byte under ``directory``: segments, the index and its log; with ``seen``, the
    files counted are appended to it as ``"path size"``."""
    total = 0
    for top in os.scandir(directory):
        with contextlib.suppress(FileNotFoundError):
            if not top.is_dir(follow_symlinks=False):
                size = top.stat(follow_symlinks=False).st_size
                total += size
                if seen is not None:
                    seen.append(f"{top.name} {size}")
                continue
            for root, _, files in os.walk(top.path):
                for name in files:
                    # Renamed or unlinked between the listing and the stat: gone from here.
                    with contextlib.suppress(FileNotFoundError):
                        path = os.path.join(root, name)
                        size = os.stat(path).st_size
                        total += size
                        if seen is not None:
                            seen.append(f"{os.path.relpath(path, directory)} {size}")
    return total


class Sampler:
    """The largest :func:`directory_bytes` seen, sampled about every millisecond in a
    thread while the block runs; :attr:`at_peak` lists the files that sample counted (in
    failure messages: which files were there, and where)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.peak = 0
        self.at_peak: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.directory.exists():
                seen: list[str] = []
                size = directory_bytes(self.directory, seen)
                if size > self.peak:
                    self.peak, self.at_peak = size, seen
                self.samples += 1
            self._stop.wait(0.001)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def test_a_burst_of_misses_never_overfills_the_directory(tmp_path: Path) -> None:
    # The reproduction: 40 concurrent misses of 1 MB objects under disk_bytes=4_000_000 put
    # up to 30 MB on disk before settling, when entries were written before being admitted.
    budget = 4 * MB
    cache_dir = tmp_path / "cache"
    async with asyncstore.open_store(tmp_path / "store") as store:
        for i in range(40):
            await store.put(f"shard/{i:02d}", bytes([i]) * MB)
        with Sampler(cache_dir) as sampler:
            for _ in range(2):  # a second burst, over a full directory
                async with TieredCache(
                    store, memory_bytes=1, disk_dir=cache_dir, disk_bytes=budget
                ) as cache:
                    got = await asyncio.gather(*(cache.get(f"shard/{i:02d}") for i in range(40)))
                    assert got == [bytes([i]) * MB for i in range(40)]
                    stats = cache.stats()
        assert sampler.samples > 10
        # One process, one writer: the budget, plus the one entry it may be writing.
        assert sampler.peak <= budget + MB + ENTRY_SLACK, (sampler.peak, sampler.at_peak)
        assert directory_bytes(cache_dir) <= budget
        assert stats.disk.enabled


WORKER = """
import asyncio, sys
import asyncstore
from asyncstore.cache import TieredCache

async def main(store_dir, cache_dir, budget, first):
    async with asyncstore.open_store(store_dir) as store, TieredCache(
        store, memory_bytes=1, disk_dir=cache_dir, disk_bytes=budget
    ) as cache:
        keys = [f"shard/{(first + i) % 40:02d}" for i in range(40)]
        for _ in range(3):
            got = await asyncio.gather(*(cache.get(k) for k in keys))
            assert all(len(g) == 500_000 for g in got)
    print("OK", flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


def test_bursts_from_several_processes_share_one_budget(tmp_path: Path) -> None:
    budget = 3 * MB
    cache_dir = tmp_path / "cache"
    for i in range(40):
        path = tmp_path / "store" / "shard" / f"{i:02d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (MB // 2))
    writers = 3
    with Sampler(cache_dir) as sampler:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    str(tmp_path / "store"),
                    str(cache_dir),
                    str(budget),
                    str(13 * n),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in range(writers)
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=100)
            assert proc.returncode == 0, err[-2000:]
            assert out.strip() == "OK"
    assert sampler.samples > 10
    # One entry in flight per writer at most, beyond the budget.
    bound = budget + writers * (MB // 2 + ENTRY_SLACK)
    assert sampler.peak <= bound, (sampler.peak, sampler.at_peak)
    assert directory_bytes(cache_dir) <= budget


async def test_an_entry_that_cannot_fit_is_served_not_kept_and_counted(tmp_path: Path) -> None:
    async with asyncstore.open_store(tmp_path / "store") as store:
        await store.put("big", bytes(2 * MB))
        await store.put("small", bytes(1000))
        async with TieredCache(
            store, memory_bytes=1, disk_dir=tmp_path / "cache", disk_bytes=MB
        ) as cache:
            assert await cache.get("big") == bytes(2 * MB)
            assert await cache.get("small") == bytes(1000)
        stats = cache.stats()
    assert stats.disk.bypassed == 1
    assert directory_bytes(tmp_path / "cache") <= MB


_batches = st.lists(
    st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 30_000), st.integers(0, 255)),
        min_size=1,
        max_size=12,
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(batches=_batches)
def test_batches_of_writes_keep_the_index_the_files_and_the_budget_in_step(
    tmp_path_factory: pytest.TempPathFactory, batches: list[list[tuple[int, int, int]]]
) -> None:
    # Batches with repeated keys, replacements, entries larger than the room left and
    # batches larger than the whole budget: after each, every kept entry reads back as the
    # last bytes written for its key, the index counts exactly the files there are, and
    # the directory stays within the budget.
    directory = tmp_path_factory.mktemp("tier")
    budget = 120_000
    tier = DiskTier(directory, budget, "file:///source")
    latest: dict[str, bytes] = {}
    written: set[str] = set()
    try:
        for batch in batches:
            items: list[tuple[str, bytes, str | None]] = [
                (f"k{key}", bytes([fill]) * size, None) for key, size, fill in batch
            ]
            results = tier.write_many(items)
            assert len(results) == len(items)
            for (key, payload, _), kept in zip(items, results, strict=True):
                if kept:
                    latest[key] = payload
                else:
                    latest.pop(key, None)  # stale bytes must not stay behind either
            for key in {item[0] for item in items}:
                last = max(i for i, item in enumerate(items) if item[0] == key)
                assert results[last] or tier.read(key) is None
            for key, payload in latest.items():
                entry = tier.read(key)
                if entry is not None:  # evicted later in the run: fine, never wrong
                    assert entry[0] == payload
            files = list((directory / "segments").iterdir())
            assert tier.used_bytes() - tier._db_bytes() == sum(f.stat().st_size for f in files)
            written.update(item[0] for item in items)
            # Every indexed record lies inside its segment, and no two overlap.
            spans = sorted(span for k in written if (span := tier.locate(k)) is not None)
            assert len(spans) == tier.entry_count()
            for (path, offset, size), (other, start, _) in itertools.pairwise(spans):
                assert path != other or offset + size <= start
            assert all(offset + size <= os.path.getsize(p) for p, offset, size in spans)
            assert directory_bytes(directory) <= budget
    finally:
        tier.close()
