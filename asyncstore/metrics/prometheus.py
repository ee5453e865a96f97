"""Export :func:`asyncstore.metrics.snapshot` to Prometheus (``pip install
'asyncstore[prometheus]'``).

The collector reads a snapshot at each scrape, so the figures are those of the components
alive at that moment. Every series carries the labels ``component`` (``store``, ``cache``,
``prefetcher``, ``checkpointer``, ``dataset``) and ``name`` (the URL it works on, credentials
masked). When several live components share a kind and a name, their counters and histograms
add up, ratios are computed from the sums, and other gauges show the largest value. A
component's series disappear when it closes: a counter that drops to zero is a reset, as
Prometheus's ``rate()`` expects.

A ``StreamingDataset``'s DataLoader workers count in their own processes; their figures
(see :func:`asyncstore.metrics.snapshot`) join the main process's series under the same
labels, added up like components of one name: a ``num_workers=8`` job has the series of a job
without workers. Their counters keep what exited workers counted (a loader without
``persistent_workers`` starts new ones each epoch) for as long as the dataset lives.

Serve them on their own port::

    import asyncstore.metrics.prometheus

    asyncstore.metrics.prometheus.start_http_server(9464)

or add them to a registry an application already serves with :func:`register`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import Metrics, snapshot

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["AsyncstoreCollector", "register", "start_http_server"]

_INSTALL = "pip install 'asyncstore[prometheus]'"

_registered: weakref.WeakKeyDictionary[Any, AsyncstoreCollector] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.utils
    except ImportError as exc:
        raise ImportError(
            f"asyncstore.metrics.prometheus needs the prometheus_client package: {_INSTALL}"
        ) from exc
    return prometheus_client


class _Family:
    """One metric family's samples, keyed by label values, merged as the docstring says."""

    def __init__(self, kind: str, doc: str, labels: tuple[str, ...]) -> None:
        self.kind, self.doc, self.labels = kind, doc, labels
        self.values: dict[tuple[str, ...], Any] = {}


class _Builder:
    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def _family(self, name: str, kind: str, doc: str, labels: dict[str, str]) -> _Family:
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = _Family(kind, doc, tuple(labels))
        return family

    def counter(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        family = self._family(name, "counter", doc, labels)
        key = tuple(labels.values())
        family.values[key] = family.values.get(key, 0) + value

    def gauge(
        self,
        name: str,
        doc: str,
        labels: dict[str, str],
        value: float,
        combine: Callable[[float, float], float] = max,
    ) -> None:
        family = self._family(name, "gauge", doc, labels)
        key = tuple(labels.values())
        family.values[key] = combine(family.values[key], value) if key in family.values else value

    def histogram(
        self, name: str, doc: str, labels: dict[str, str], buckets: list[int], total: float
    ) -> None:
        family = self._family(name, "histogram", doc, labels)
        key = tuple(labels.values())
        counts, seconds = family.values.get(key, ([0] * len(buckets), 0.0))
        family.values[key] = (
            [a + b for a, b in zip(counts, buckets, strict=True)],
            seconds + total,
        )

    def build(self, bounds: tuple[float, ...]) -> Iterator[Any]:
        client = _prometheus()
        core = client.core
        for name, family in self.families.items():
            labels = list(family.labels)
            metric: Any
            if family.kind == "counter":
                metric = core.CounterMetricFamily(name, family.doc, labels=labels)
            elif family.kind == "gauge":
                metric = core.GaugeMetricFamily(name, family.doc, labels=labels)
            else:
                metric = core.HistogramMetricFamily(name, family.doc, labels=labels)
            for key, value in family.values.items():
                if family.kind == "histogram":
                    counts, seconds = value
                    cumulative, running = [], 0
                    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
                        running += count
                        cumulative.append((client.utils.floatToGoString(bound), running))
                    metric.add_metric(list(key), cumulative, seconds)
                else:
                    metric.add_metric(list(key), value)
            yield metric


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _families(metrics: Metrics) -> _Builder:
    out = _Builder()
    for store in metrics.stores:
        base = {"component": "store", "name": store.name}
        for op in ("get", "put", "stat", "delete"):
            figures = getattr(store.stats, op)
            labels = {**base, "op": op}
            out.histogram(
                "asyncstore_store_request_seconds",
                "Duration of store requests (retries included), by operation.",
                labels,
                figures.buckets,
                figures.seconds,
            )
            out.counter(
                "asyncstore_store_request_errors",
                "Store requests that raised (NotFound included), by operation.",
                labels,
                figures.errors,
            )
            if op in ("get", "put"):
                out.counter(
                    "asyncstore_store_bytes",
                    "Bytes read by get and written by put.",
                    labels,
                    figures.bytes,
                )
    for cache in metrics.caches:
        base = {"component": "cache", "name": cache.name}
        stats = cache.stats
        out.counter("asyncstore_cache_gets", "Reads asked of the cache.", base, stats.gets)
        for tier, figures in (("memory", stats.memory), ("disk", stats.disk)):
            labels = {**base, "tier": tier}
            out.counter("asyncstore_cache_hits", "Reads a tier answered.", labels, figures.hits)
            out.counter(
                "asyncstore_cache_misses",
                "Reads a tier could not answer (the next one was asked).",
                labels,
                figures.misses,
            )
            out.counter(
                "asyncstore_cache_bytes_served",
                "Payload bytes a tier returned.",
                labels,
                figures.bytes_served,
            )
            out.counter(
                "asyncstore_cache_evictions",
                "Entries a tier removed to make room.",
                labels,
                figures.evictions,
            )
            out.counter(
                "asyncstore_cache_corrupt",
                "Entries found damaged and dropped.",
                labels,
                figures.corrupt,
            )
            out.counter(
                "asyncstore_cache_tier_errors",
                "I/O errors of a tier.",
                labels,
                figures.errors,
            )
            out.gauge(
                "asyncstore_cache_tier_enabled",
                "1 while the tier is on, 0 once it switched itself off (or has none).",
                labels,
                1.0 if figures.enabled else 0.0,
                combine=min,
            )
        out.counter(
            "asyncstore_cache_store_fetches",
            "Reads that reached the store below the cache.",
            base,
            stats.store.fetches,
        )
        out.counter(
            "asyncstore_cache_store_fetch_bytes",
            "Bytes the cache fetched from its store.",
            base,
            stats.store.bytes,
        )
        for quantile, value in (
            ("0.5", stats.store.latency_p50),
            ("0.95", stats.store.latency_p95),
            ("0.99", stats.store.latency_p99),
        ):
            out.gauge(
                "asyncstore_cache_store_fetch_latency_seconds",
                "Latency of the cache's recent store fetches, by quantile.",
                {**base, "quantile": quantile},
                value,
            )
    prefetch_sums: dict[tuple[str, ...], list[float]] = {}
    for prefetcher in metrics.prefetchers:
        base = {"component": "prefetcher", "name": prefetcher.name}
        pstats = prefetcher.stats
        out.counter("asyncstore_prefetch_items", "Items yielded.", base, pstats.items)
        out.counter(
            "asyncstore_prefetch_skipped", "Items skipped after an error.", base, pstats.skipped
        )
        out.counter("asyncstore_prefetch_fetches", "Fetches started.", base, pstats.fetched)
        out.counter(
            "asyncstore_prefetch_stalls",
            "Items the consumer had to wait for.",
            base,
            pstats.stalls,
        )
        out.counter(
            "asyncstore_prefetch_wait_seconds",
            "Time the consumer spent waiting for items.",
            base,
            pstats.wait_seconds,
        )
        for quantile, value in (
            ("0.5", pstats.wait_p50),
            ("0.95", pstats.wait_p95),
            ("0.99", pstats.wait_p99),
        ):
            out.gauge(
                "asyncstore_prefetch_item_wait_seconds",
                "Per-item consumer wait over recent items, by quantile.",
                {**base, "quantile": quantile},
                value,
            )
        out.gauge("asyncstore_prefetch_depth", "Current lookahead depth.", base, pstats.depth)
        sums = prefetch_sums.setdefault(tuple(base.values()), [0, 0, 0, 0])
        for i, value in enumerate(
            (pstats.stalls, pstats.items, pstats.items + pstats.skipped, pstats.fetched)
        ):
            sums[i] += value
    for (kind, name), (stalls, items, consumed, fetched) in prefetch_sums.items():
        base = {"component": kind, "name": name}
        out.gauge(
            "asyncstore_prefetch_stall_fraction",
            "Items waited for, over items yielded.",
            base,
            _ratio(stalls, items),
        )
        out.gauge(
            "asyncstore_prefetch_accuracy",
            "Fetched items that were consumed, over fetched items.",
            base,
            _ratio(consumed, fetched),
        )
    for ckpt in metrics.checkpointers:
        base = {"component": "checkpointer", "name": ckpt.name}
        s = ckpt.stats
        for name, doc, value in (
            ("saves", "Checkpoint versions committed.", s.saves),
            ("failed_saves", "Saves that raised or were cancelled.", s.failed),
            (
                "blocking_seconds",
                "Time training waited in save() (the snapshots), summed.",
                s.blocking_seconds,
            ),
            ("bytes_written", "Bytes stored by committed saves.", s.bytes_written),
            (
                "bytes_skipped",
                "Raw bytes not written again: an earlier version holds them.",
                s.bytes_skipped,
            ),
            ("deleted", "Versions removed by retention.", s.deleted),
            ("uploads", "Versions copied to the mirror and checked there.", s.uploads),
            ("upload_failures", "Upload attempts that failed.", s.upload_failures),
            ("bytes_uploaded", "Bytes copied to the mirror and checked.", s.bytes_uploaded),
            (
                "bytes_uploaded_early",
                "Bytes sent to the mirror while their save was still writing them.",
                s.bytes_uploaded_early,
            ),
        ):
            out.counter(f"asyncstore_checkpoint_{name}", doc, base, value)
        for name, doc, value in (
            (
                "last_blocking_seconds",
                "The newest committed save's wait in save().",
                s.last_blocking_seconds,
            ),
            (
                "last_total_seconds",
                "The newest committed save, from the call to the commit.",
                s.last_total_seconds,
            ),
            (
                "last_upload_seconds",
                "The newest upload, from its start (its pack: during the save) to its check.",
                s.last_upload_seconds,
            ),
            (
                "upload_lag_seconds",
                "From the newest mirrored version's local commit to the end of its upload.",
                s.last_upload_lag_seconds,
            ),
        ):
            out.gauge(f"asyncstore_checkpoint_{name}", doc, base, value)
    for dataset in metrics.datasets:
        base = {"component": "dataset", "name": dataset.name}
        samples = dataset.stats.samples if dataset.stats is not None else 0
        out.counter(
            "asyncstore_dataset_samples",
            "Samples a StreamingDataset yielded: in this process's last iteration, and in "
            "every iteration of its DataLoader workers.",
            base,
            samples,
        )
    out.gauge(
        "asyncstore_metrics_failures",
        "Components whose stats() raised during this scrape.",
        {},
        len(metrics.failures),
    )
    return out


class AsyncstoreCollector:
    """A Prometheus collector of every live asyncstore component's figures.

    Each ``collect()`` (each scrape) takes one :func:`asyncstore.metrics.snapshot`. Register
    it with :func:`register` rather than by hand, which keeps one per registry.
    """

    def collect(self) -> Iterator[Any]:
        """The metric families of a fresh snapshot (see the module docstring)."""
        from ..stores import LATENCY_BUCKETS

        yield from _families(snapshot()).build(LATENCY_BUCKETS)


def register(registry: CollectorRegistry | None = None) -> AsyncstoreCollector:
    """Add asyncstore's figures to ``registry`` (default: ``prometheus_client.REGISTRY``),
    once: a second call for the same registry returns the collector already there.

    Raises:
        ImportError: prometheus_client is not installed
            (``pip install 'asyncstore[prometheus]'``).
    """
    client = _prometheus()
    target = client.REGISTRY if registry is None else registry
    with _lock:
        collector = _registered.get(target)
        if collector is None:
            collector = AsyncstoreCollector()
            target.register(collector)
            _registered[target] = collector
    return collector


def start_http_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> tuple[Any, threading.Thread]:
    """Serve asyncstore's figures (and whatever else ``registry`` holds) over HTTP at
    ``http://addr:port/metrics``, from a daemon thread.

    Args:
        port: the TCP port; 0 picks a free one (read it from ``server.server_port``).
        addr: the address to listen on; loopback by default, so that nothing is exposed
            beyond this host unless asked for (``"0.0.0.0"``).
        registry: default ``prometheus_client.REGISTRY`` (which also holds the process
            and Python figures of prometheus_client).

    Returns:
        ``(server, thread)`` from ``prometheus_client.start_http_server``: call
        ``server.shutdown()`` to stop it.

    Raises:
        ImportError: prometheus_client is not installed
            (``pip install 'asyncstore[prometheus]'``).
    """
    client = _prometheus()
    target = client.REGISTRY if registry is None else registry
    register(target)
    server, thread = client.start_http_server(port, addr=addr, registry=target)
    return server, thread
