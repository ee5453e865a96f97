"""Checkpointer with a mirror through a real outage: the SeaweedFS server stops in the middle
of an upload and comes back later; the run's next process finishes the uploads, and the
mirror alone can bring the run back."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from asyncstore.checkpoint import Checkpointer
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import s3_options

pytestmark = pytest.mark.anyio

BUCKET = "outage"
PREFIX = "run"
SIZE = 1_600_000  # float32: 6.4 MB, two parts of 5 MiB, so an upload is several requests
STEPS = 7
OUTAGE_STEP = 3  # the version whose upload the outage interrupts
STEM = f"step-{OUTAGE_STEP:09d}"
SLOW_SECONDS = 0.5  # the proxy's delay per request while the outage is set up
ATTEMPTS = 2  # UPLOAD_ATTEMPTS in the first process: an outage outlasts them


def weights(step: int) -> torch.Tensor:
    # Random, hence incompressible: every upload (of a whole version, or of a differential
    # version's pack) is a multipart upload.
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(step))


def key(step: int) -> str:
    return f"step-{step:09d}.ckpt"


# The first process of the run. Each save is awaited to its local commit, reported on stdout,
# and the test's "go" on stdin is awaited before the next save: the test decides when the
# server stops relative to the saves. The uploads give up quickly, as a long outage makes
# them do.
FIRST_PROCESS = f"""
import asyncio, json, logging, sys
import msgspec, torch
from asyncstore.checkpoint import Checkpointer, _mirror

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
_mirror.UPLOAD_ATTEMPTS = {ATTEMPTS}
_mirror.UPLOAD_RETRY_SECONDS = 0.05

async def main():
    local, (mirror, options) = sys.argv[1], json.loads(sys.argv[2])
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as ckpt:
        for step in range({STEPS}):
            w = torch.randn({SIZE}, generator=torch.Generator().manual_seed(step))
            await (await ckpt.save({{"w": w, "step": step}}, step))
            print(step, flush=True)
            await asyncio.to_thread(sys.stdin.readline)
    print(json.dumps(msgspec.to_builtins(ckpt.stats())), flush=True)

asyncio.run(main())
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SeaweedFS]:
    """A SeaweedFS of this test's own, with its data directory kept across stop and start."""
    own = SeaweedFS(data_dir=tmp_path / "seaweedfs")
    own.start()
    try:
        own.create_bucket(BUCKET)
        yield own
    finally:
        own.stop(timeout=2.0)


@pytest.fixture
def proxy(server: SeaweedFS) -> Iterator[FaultProxy]:
    # SeaweedFS.start() picks fresh ports each time: the checkpointers reach the server
    # through this proxy, whose address stays the same when the server comes back.
    with FaultProxy("127.0.0.1", server.s3_port) as running:
        yield running


VERSION = re.compile(r"^step-(\d{9})\.ckpt$")


def mirror_keys(server: SeaweedFS) -> list[str]:
    """Every object of the run on the server, read directly (not through the proxy), by
    its key under the run: versions, and the packs of differential versions."""
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    found = [item["Key"] for page in pages for item in page.get("Contents", [])]
    return sorted(k.removeprefix(f"{PREFIX}/") for k in found if k.startswith(f"{PREFIX}/"))


def steps_in(keys: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for k in keys if (m := VERSION.match(k))}


def mirror_steps(server: SeaweedFS) -> set[int]:
    return steps_in(mirror_keys(server))


def local_keys(local: Path) -> list[str]:
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())


def local_steps(local: Path) -> set[int]:
    return steps_in(local_keys(local))


def unfinished_uploads(server: SeaweedFS) -> list[str]:
    return [u["Key"] for u in server.list_multipart_uploads(BUCKET, f"{PREFIX}/")]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def next_line(stream: IO[str]) -> str:
    line = stream.readline()
    assert line, "the first process ended early"
    return line.strip()


def run_first_process(
    local: Path, mirror: str, options: dict[str, Any], server: SeaweedFS, proxy: FaultProxy
) -> tuple[dict[str, Any], str]:
    """Run the first process of the run; stop ``server`` while the upload of
    ``OUTAGE_STEP`` is under way. Returns its stats and its stderr."""
    stderr_path = local.parent / "first.stderr"
    argv = [sys.executable, "-c", textwrap.dedent(FIRST_PROCESS), str(local)]
    argv.append(json.dumps([mirror, options]))
    with (
        open(stderr_path, "w") as stderr,
        subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        ) as proc,
    ):
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            for step in range(STEPS):
                assert next_line(proc.stdout) == str(step)
                if step == OUTAGE_STEP - 1:
                    # Up to here the mirror worked: every upload and retention settles
                    # (step 0 gone from both stores) before the outage begins.
                    wait_for(
                        lambda: mirror_steps(server) == {1, 2} and local_steps(local) == {1, 2},
                        "the uploads before the outage",
                    )
                    proxy.latency = SLOW_SECONDS
                if step == OUTAGE_STEP:
                    # Stopped once the server has begun this version's multipart upload
                    # (of the version, or of its pack when it is differential): each of its
                    # remaining requests (a part, the completion) waits SLOW_SECONDS in the
                    # proxy, so the copy cannot be complete yet.
                    wait_for(
                        lambda: any(STEM in k for k in unfinished_uploads(server)),
                        "the upload to begin on the server",
                    )
                    server.stop(timeout=2.0)
                    proxy.latency = 0.0
                proc.stdin.write("go\n")
                proc.stdin.flush()
            stats = json.loads(next_line(proc.stdout))
            assert proc.wait(timeout=60) == 0, stderr_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    return stats, stderr_path.read_text()


async def test_a_mirror_outage_during_an_upload_is_resumed_by_the_next_process(
    tmp_path: Path, server: SeaweedFS, proxy: FaultProxy
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{PREFIX}"
    options = s3_options(
        server, endpoint_url=proxy.url, max_attempts=2, retry_base_delay=0.01, connect_timeout=2
    )

    # 1. The first process: the server stops during the upload of OUTAGE_STEP and stays
    # down for the saves after it. No save fails; the uploads give up with warnings.
    stats, stderr = run_first_process(local, mirror, options, server, proxy)
    assert stats["saves"] == STEPS
    assert stats["failed"] == 0
    assert stats["uploads"] == OUTAGE_STEP  # the ones before the outage
    assert stats["upload_failures"] == ATTEMPTS * (STEPS - OUTAGE_STEP)
    assert f"WARNING asyncstore.checkpoint: uploading {key(OUTAGE_STEP)} to the mirror" in stderr

    # 2. Retention kept every version the mirror did not get, and each of them loads.
    only_local = set(range(OUTAGE_STEP, STEPS))
    assert only_local <= local_steps(local) <= set(range(1, STEPS))
    async with Checkpointer(local) as here:
        for step in sorted(local_steps(local)):
            loaded = await here.load(step=step, strict=True)
            assert loaded["step"] == step
            assert torch.equal(loaded["w"], weights(step))

    # The server comes back on the same data: what it held before the outage is there,
    # but for what retention deleted, and the interrupted upload never became a version.
    # The local commit of OUTAGE_STEP makes step 1 a victim (keep_last=2 counts the local
    # copy of OUTAGE_STEP), and that retention races with the server's stop: before it,
    # step 1 goes from both stores (1 run of .ci/run in 4 on 2026-12-04); after it, the
    # mirror cannot be listed and retention deletes nothing. Retention deletes a version
    # here before the mirror, so a step 1 gone from the mirror is gone here too.
    server.start()
    proxy.upstream_port = server.s3_port
    on_mirror = mirror_steps(server)
    assert on_mirror in ({1, 2}, {2}), on_mirror
    if 1 not in on_mirror:
        assert 1 not in local_steps(local)
    [interrupted] = unfinished_uploads(server)
    assert STEM in interrupted

    # 3. The next process on the run (this one) uploads what is missing; opening deletes
    # nothing. Its first save's retention then trims both stores to the newest two.
    before = local_steps(local)
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as again:
        await again.versions()  # first use: the uploads resume
    assert again.stats().uploads == STEPS - OUTAGE_STEP
    assert again.stats().upload_failures == 0
    assert local_steps(local) == before
    assert mirror_steps(server) >= before
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as again:
        await (await again.save({"w": weights(STEPS), "step": STEPS}, STEPS))
    newest = [STEPS - 1, STEPS]
    assert sorted(local_steps(local)) == newest
    assert sorted(mirror_steps(server)) == newest
    # Every local file (the versions, and their packs when differential) is on the mirror,
    # byte for byte.
    client = server.client()
    for name in local_keys(local):
        copy = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}")["Body"].read()
        assert copy == (local / name).read_bytes(), name
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
        assert [(v.step, v.where) for v in await again.versions()] == [
            (step, "both") for step in newest
        ]
        # The interrupted multipart upload is left over on the server until gc.
        assert await again.gc() == 1
    assert unfinished_uploads(server) == []
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        for step in newest:
            loaded = await only_mirror.load(step=step, strict=True)
            assert torch.equal(loaded["w"], weights(step))

    # 4. The local directory lost: the run resumes from the mirror's newest version.
    shutil.rmtree(local)
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
        assert [(v.step, v.where) for v in await again.versions()] == [
            (step, "mirror") for step in newest
        ]
        loaded = await again.load()
        assert loaded["step"] == STEPS
        assert torch.equal(loaded["w"], weights(STEPS))

    # The outage cost the first process warnings, as the mirror's documentation promises,
    # and nothing logged as an error (an alert, in most training setups).
    errors = [line for line in stderr.splitlines() if line.startswith(("ERROR", "CRITICAL"))]
    assert errors == []
