"""The S3 server the benchmarks start: SeaweedFS on loopback, with volumes large enough that
no measured write waits for SeaweedFS to add one."""

from __future__ import annotations

from pathlib import Path

from asyncstore.testing import SeaweedFS

VOLUME_MB = 4096
"""The benchmarks' volume size. SeaweedFS adds a volume when one fills, and a write that
reaches the full one waits for the new one: with the tests' 64 MiB volumes, each 256 MiB
multipart upload here met 3 to 5 waits of 1.1 to 2.8 s (16 MiB parts that otherwise took
0.1-0.5 s), and the upload took 1.5-3.9 s against 1.5-1.8 s with 4 GiB volumes, measured
on 2026-12-04. Volumes are created sparse: a large size costs no disk."""


def bench_seaweedfs(data_dir: str | Path | None = None) -> SeaweedFS:
    """A :class:`SeaweedFS` (not started yet) for a benchmark, with :data:`VOLUME_MB`
    volumes, in ``data_dir`` (a temporary directory if ``None``)."""
    return SeaweedFS(data_dir=data_dir, volume_size_mb=VOLUME_MB)
