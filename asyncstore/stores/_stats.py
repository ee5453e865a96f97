"""Request figures of a store: counts, errors, bytes and a fixed-bucket latency histogram."""

from __future__ import annotations

from bisect import bisect_left

import msgspec

__all__ = ["LATENCY_BUCKETS", "RequestStats", "StoreStats"]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds (seconds, inclusive) of the latency buckets: from a memory or local-disk read
(well under a millisecond) to an S3 request that retried (seconds). Fixed, so recording a
request costs one bisection and a few additions, and histograms add up across processes."""


class RequestStats(msgspec.Struct):
    """Figures of one kind of store request (``get``, ``put``, ``stat`` or ``delete``).

    Attributes:
        requests: calls that finished, with a result or an error (cancelled ones are not
            counted).
        errors: calls that raised (``NotFound`` included: a ``stat`` of a missing key is one).
        bytes: bytes returned by ``get`` or given to ``put`` (0 for the others).
        seconds: the calls' total duration, retries and waits for a connection included.
        buckets: per bucket of :data:`LATENCY_BUCKETS`, the calls that took at most its bound
            and more than the previous one; the last entry counts the calls over the largest
            bound. Not cumulative.
    """

    requests: int = 0
    errors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    buckets: list[int] = msgspec.field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))


class StoreStats(msgspec.Struct):
    """A snapshot of a store's request figures (``store.stats()``).

    Counted at the store's public methods; streaming readers and writers
    (``open_reader``/``open_writer``), listings and the checkpoint loader's pinned range
    reads are not counted.

    Attributes:
        get, put, stat, delete: figures of each kind of request.
        latency_buckets: the upper bounds of the histograms' buckets, seconds.
    """

    get: RequestStats
    put: RequestStats
    stat: RequestStats
    delete: RequestStats
    latency_buckets: tuple[float, ...] = LATENCY_BUCKETS


class Requests:
    """The live counters behind one :class:`RequestStats` (cheap to update, on the hot path)."""

    __slots__ = ("buckets", "bytes", "errors", "seconds")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.errors = 0
        self.bytes = 0
        self.seconds = 0.0

    def add(self, seconds: float, size: int) -> None:
        """Record one finished call."""
        self.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.seconds += seconds
        self.bytes += size

    def snapshot(self) -> RequestStats:
        """The figures now, as a value that later calls do not change."""
        buckets = list(self.buckets)
        return RequestStats(
            requests=sum(buckets),
            errors=self.errors,
            bytes=self.bytes,
            seconds=self.seconds,
            buckets=buckets,
        )
