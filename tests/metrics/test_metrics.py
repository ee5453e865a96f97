"""asyncstore.metrics: one view over every live component, its Prometheus export, and logging."""

from __future__ import annotations

import ast
import gc
import logging
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import asyncstore
import asyncstore.metrics
import asyncstore.metrics.prometheus as prom
from asyncstore._resource import AsyncResource
from asyncstore.checkpoint import Checkpointer
from asyncstore.metrics import Component
from asyncstore.testing import SeaweedFS
from asyncstore.torch import StreamingDataset

from ..conftest import BUCKET, s3_options, unique

pytestmark = pytest.mark.anyio

KEYS = [f"k{i}" for i in range(5)]
PAYLOAD = 1000


def named(entries: list[Component[Any]], name: str) -> list[Component[Any]]:
    return [entry for entry in entries if entry.name == name]


async def filled_store(root: Path) -> asyncstore.Store:
    store = asyncstore.open_store(str(root))
    for key in KEYS:
        await store.put(key, bytes(PAYLOAD))
    return store


async def test_snapshot_shows_stores_caches_and_prefetchers_with_their_figures(
    tmp_path: Path,
) -> None:
    store = await filled_store(tmp_path / "data")
    url = store.url
    cache = asyncstore.TieredCache(store, memory_bytes=1 << 20)
    async with store, cache:
        for _ in range(2):
            for key in KEYS:
                assert await cache.get(key) == bytes(PAYLOAD)
        with pytest.raises(asyncstore.NotFound):
            await store.stat("missing")
        async with asyncstore.Prefetcher(cache, KEYS) as prefetcher:
            seen = []
            async for key, _ in prefetcher:
                seen.append(key)
                if len(seen) == len(KEYS):  # a finished prefetcher closes itself
                    snap = asyncstore.metrics.snapshot()
                    prefetched = prefetcher.stats()
            assert seen == KEYS
            (s,) = named(snap.stores, url)
            assert s.kind == "store"
            assert s.stats.put.requests == len(KEYS)
            assert s.stats.put.bytes == len(KEYS) * PAYLOAD
            assert s.stats.get.requests == len(KEYS)  # the second round and the prefetch hit
            assert s.stats.get.bytes == len(KEYS) * PAYLOAD
            assert s.stats.get.errors == 0
            assert sum(s.stats.get.buckets) == len(KEYS)
            assert s.stats.get.seconds > 0
            assert (s.stats.stat.requests, s.stats.stat.errors) == (1, 1)
            assert s.stats == store.stats()  # type: ignore[attr-defined]

            (c,) = named(snap.caches, url)
            assert c.kind == "cache"
            assert c.stats.gets == 3 * len(KEYS)
            assert (c.stats.memory.hits, c.stats.memory.misses) == (2 * len(KEYS), len(KEYS))
            assert c.stats.memory.bytes_served == 2 * len(KEYS) * PAYLOAD
            assert c.stats.store.fetches == len(KEYS)

            (p,) = named(snap.prefetchers, url)
            assert p.kind == "prefetcher"
            assert p.stats.items == len(KEYS)
            assert p.stats == prefetched

        # A closed component leaves the registry at once.
        assert named(asyncstore.metrics.snapshot().prefetchers, url) == []
    snap = asyncstore.metrics.snapshot()
    assert named(snap.stores, url) == []
    assert named(snap.caches, url) == []
    # The snapshot is a plain value: it encodes as JSON for a log line or a dashboard.
    decoded = msgspec.json.decode(msgspec.json.encode(snap))
    assert set(decoded) >= {"stores", "caches", "prefetchers", "checkpointers", "datasets"}


async def test_a_component_dropped_without_closing_leaves_too(tmp_path: Path) -> None:
    url = asyncstore.open_store(str(tmp_path)).url  # never opened: holds nothing
    assert named(asyncstore.metrics.snapshot().stores, url) == []
    store = asyncstore.MemoryStore(unique())
    name = store.url
    assert len(named(asyncstore.metrics.snapshot().stores, name)) == 1
    del store
    gc.collect()
    assert named(asyncstore.metrics.snapshot().stores, name) == []


async def committed(ckpt: Checkpointer, saves: int) -> None:
    # A save's handle resolves at its commit; the checkpointer counts it just after.
    with anyio.fail_after(10):
        while ckpt.stats().saves < saves:  # noqa: ASYNC110 - polls a counter
            await anyio.sleep(0.01)


async def test_checkpointer_figures(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path / "ckpt") as ckpt:
        for step in (1, 2):
            handle = await ckpt.save({"w": torch.full((1000,), float(step))}, step)
            await handle
        await committed(ckpt, 2)
        (entry,) = named(asyncstore.metrics.snapshot().checkpointers, ckpt.url)
        assert entry.kind == "checkpointer"
        assert entry.stats.saves == 2
        assert entry.stats.bytes_written > 0
        assert entry.stats == ckpt.stats()
    assert named(asyncstore.metrics.snapshot().checkpointers, ckpt.url) == []


def test_streaming_dataset_figures(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    for key in KEYS:
        (root / key).write_bytes(key.encode())
    ds: StreamingDataset[bytes] = StreamingDataset(root, keys=KEYS)
    name = str(root)
    (before,) = named(asyncstore.metrics.snapshot().datasets, name)
    assert before.stats is None  # not iterated yet
    assert sorted(ds) == sorted(key.encode() for key in KEYS)
    snap = asyncstore.metrics.snapshot()
    (entry,) = named(snap.datasets, name)
    assert entry.stats is not None
    assert entry.stats.samples == len(KEYS)
    assert entry.stats == ds.stats()
    # Its own cache and store are listed too, while the dataset keeps them open.
    (cache,) = [c for c in snap.caches if c.name.endswith(name)]
    assert cache.stats.store.fetches == len(KEYS)
    ds.close()
    del ds
    gc.collect()
    snap = asyncstore.metrics.snapshot()
    assert named(snap.datasets, name) == []
    assert [c for c in snap.caches if c.name.endswith(name)] == []


async def test_each_component_is_listed_under_its_url(tmp_path: Path) -> None:
    store = await filled_store(tmp_path / "data")
    cache = asyncstore.TieredCache(store, memory_bytes=1 << 20)
    async with store, cache, Checkpointer(tmp_path / "ckpt") as ckpt:
        prefetcher = asyncstore.Prefetcher(cache, KEYS)
        direct = asyncstore.Prefetcher(store, KEYS)
        ds: StreamingDataset[bytes] = StreamingDataset(tmp_path / "data", keys=KEYS)
        # A cache and a prefetcher work on the store they read, a dataset on its source.
        assert cache.url == prefetcher.url == direct.url == store.url
        assert ds.url == str(tmp_path / "data")
        snap = asyncstore.metrics.snapshot()
        listings: list[tuple[list[Component[Any]], Any]] = [
            (snap.stores, store),
            (snap.caches, cache),
            (snap.prefetchers, prefetcher),
            (snap.prefetchers, direct),
            (snap.checkpointers, ckpt),
            (snap.datasets, ds),
        ]
        for entries, component in listings:
            listed = named(entries, component.url)
            assert component.stats() in [entry.stats for entry in listed], component
        async with prefetcher, direct:
            pass
        ds.close()


class Broken(AsyncResource):
    def stats(self) -> object:
        raise RuntimeError("stats broke")


class Foreign(AsyncResource):
    def stats(self) -> object:
        return {"not": "a stats struct"}


async def test_a_misbehaving_component_does_not_break_the_snapshot() -> None:
    store = asyncstore.MemoryStore(unique())
    async with Broken() as broken, Foreign(), store:
        snap = asyncstore.metrics.snapshot()
        assert len(named(snap.stores, store.url)) == 1
        failures = [f for f in snap.failures if f.kind == "Broken"]
        assert len(failures) == 1
        assert failures[0].error == "RuntimeError: stats broke"
        assert failures[0].name == "Broken"
        del broken
    assert [f for f in asyncstore.metrics.snapshot().failures if f.kind == "Broken"] == []


def test_snapshots_from_another_thread_while_components_come_and_go() -> None:
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape() -> None:
        try:
            while not stop.is_set():
                asyncstore.metrics.snapshot()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:

        async def churn() -> None:
            for _ in range(300):
                async with asyncstore.MemoryStore(unique()) as store:
                    await store.put("k", b"x")

        anyio.run(churn)
    finally:
        stop.set()
        thread.join()
    assert errors == []


# -- Prometheus ------------------------------------------------------------------------------


@pytest.fixture
def scrape() -> Iterator[Any]:
    """``scrape()`` -> the text of one HTTP scrape of a fresh registry's server."""
    registry = CollectorRegistry()
    server, thread = prom.start_http_server(0, registry=registry)
    assert prom.register(registry) is prom.register(registry)  # once per registry
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            text: str = response.read().decode()
            return text

    yield get
    server.shutdown()
    server.server_close()
    thread.join()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], metric: str, /, **labels: str
) -> float:
    return found[(metric, frozenset(labels.items()))]


async def test_prometheus_scrape_matches_the_components(tmp_path: Path, scrape: Any) -> None:
    store = await filled_store(tmp_path / "data")
    url = store.url
    async with store, asyncstore.TieredCache(store, memory_bytes=1 << 20) as cache:
        for key in KEYS * 2:
            await cache.get(key)
        async with (
            asyncstore.Prefetcher(cache, KEYS) as prefetcher,
            Checkpointer(tmp_path / "ckpt") as ckpt,
        ):
            await (await ckpt.save({"w": torch.zeros(100)}, 1))
            await committed(ckpt, 1)
            async for key, _ in prefetcher:
                if key == KEYS[-1]:  # a finished prefetcher closes itself
                    found = samples(await anyio.to_thread.run_sync(scrape))
                    store_stats = store.stats()  # type: ignore[attr-defined]
                    cache_stats = cache.stats()
                    prefetch_stats = prefetcher.stats()
                    ckpt_stats = ckpt.stats()

    s = {"component": "store", "name": url}
    assert value(found, "asyncstore_store_request_seconds_count", **s, op="get") == len(KEYS)
    assert value(found, "asyncstore_store_request_seconds_sum", **s, op="get") == pytest.approx(
        store_stats.get.seconds
    )
    assert value(found, "asyncstore_store_request_seconds_bucket", **s, op="get", le="+Inf") == 5
    assert value(found, "asyncstore_store_bytes_total", **s, op="put") == len(KEYS) * PAYLOAD
    assert value(found, "asyncstore_store_request_errors_total", **s, op="stat") == 0
    c = {"component": "cache", "name": url}
    assert value(found, "asyncstore_cache_gets_total", **c) == cache_stats.gets == 3 * len(KEYS)
    for tier in ("memory", "disk"):
        figures = getattr(cache_stats, tier)
        assert value(found, "asyncstore_cache_hits_total", **c, tier=tier) == figures.hits
        assert value(found, "asyncstore_cache_misses_total", **c, tier=tier) == figures.misses
        assert (
            value(found, "asyncstore_cache_bytes_served_total", **c, tier=tier)
            == figures.bytes_served
        )
    assert value(found, "asyncstore_cache_hits_total", **c, tier="memory") == 2 * len(KEYS)
    p = {"component": "prefetcher", "name": url}
    assert value(found, "asyncstore_prefetch_items_total", **p) == len(KEYS)
    assert value(found, "asyncstore_prefetch_wait_seconds_total", **p) == pytest.approx(
        prefetch_stats.wait_seconds
    )
    assert value(found, "asyncstore_prefetch_stall_fraction", **p) == pytest.approx(
        prefetch_stats.stall_fraction
    )
    k = {"component": "checkpointer", "name": ckpt.url}
    assert value(found, "asyncstore_checkpoint_saves_total", **k) == 1
    assert (
        value(found, "asyncstore_checkpoint_bytes_written_total", **k) == ckpt_stats.bytes_written
    )
    assert value(found, "asyncstore_checkpoint_bytes_skipped_total", **k) == 0
    assert value(found, "asyncstore_checkpoint_blocking_seconds_total", **k) == pytest.approx(
        ckpt_stats.blocking_seconds
    )
    assert value(found, "asyncstore_checkpoint_last_total_seconds", **k) == pytest.approx(
        ckpt_stats.last_total_seconds
    )
    assert value(found, "asyncstore_checkpoint_upload_lag_seconds", **k) == 0
    assert value(found, "asyncstore_checkpoint_bytes_uploaded_total", **k) == 0  # no mirror
    # Closed: the next scrape no longer has them.
    after = samples(await anyio.to_thread.run_sync(scrape))
    assert not [key for key in after if ("name", url) in key[1]]


async def test_two_live_components_of_one_name_add_up(scrape: Any) -> None:
    name = unique()
    async with asyncstore.MemoryStore(name) as one, asyncstore.MemoryStore(name) as two:
        await one.put("a", b"1")
        await two.put("b", b"22")
        found = samples(await anyio.to_thread.run_sync(scrape))
    labels = {"component": "store", "name": one.url, "op": "put"}
    assert value(found, "asyncstore_store_bytes_total", **labels) == 3
    assert value(found, "asyncstore_store_request_seconds_count", **labels) == 2


async def test_no_credentials_in_the_scrape(seaweedfs: SeaweedFS, scrape: Any) -> None:
    options = s3_options(seaweedfs)
    async with asyncstore.open_store(f"s3://{BUCKET}/{unique()}", **options) as store:
        await store.put("k", b"data")
        assert await store.get("k") == b"data"
        async with asyncstore.TieredCache(store, memory_bytes=1 << 20) as cache:
            await cache.get("k")
            text = await anyio.to_thread.run_sync(scrape)
            dumped = msgspec.json.encode(asyncstore.metrics.snapshot()).decode()
    assert f'name="{store.url}"' in text
    for secret in (seaweedfs.secret_key, options["aws_secret_access_key"]):
        assert secret not in text
        assert secret not in dumped


def test_register_says_what_to_install_without_prometheus_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install 'asyncstore\[prometheus\]'"):
        prom.register()


# -- logging ---------------------------------------------------------------------------------


def test_the_library_never_prints() -> None:
    package = Path(asyncstore.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if {"cli", "testing"} & set(path.relative_to(package).parts[:1]):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                offenders.append(f"{path}:{node.lineno}")
    assert offenders == []


async def test_a_save_load_cache_round_logs_through_asyncstore_loggers_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("asyncstore").handlers)
    caplog.set_level(logging.DEBUG)
    async with Checkpointer(tmp_path / "ckpt") as ckpt:
        await (await ckpt.save({"w": torch.ones(1000)}, 1))
        # A damaged newest version: the load falls back, with a warning in the log.
        await (await ckpt.save({"w": torch.ones(1000)}, 2))
        newest = await ckpt.latest()
        assert newest is not None
        path = tmp_path / "ckpt" / newest.key
        path.write_bytes(path.read_bytes()[:-100])
        assert torch.equal((await ckpt.load())["w"], torch.ones(1000))
    store = await filled_store(tmp_path / "data")
    async with (
        store,
        asyncstore.TieredCache(
            store, memory_bytes=1 << 20, disk_dir=tmp_path / "cache", disk_bytes=1 << 20
        ) as cache,
    ):
        for key in KEYS * 2:
            await cache.get(key)
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == ""
    package = str(Path(asyncstore.__file__).parent)
    ours = [r for r in caplog.records if r.pathname.startswith(package)]
    assert any(r.levelno >= logging.WARNING for r in ours)  # the fallback was logged
    assert {r.name.split(".")[0] for r in ours} == {"asyncstore"}
