"""Checkpointer: versions named by step, retention, resume from the newest version that
verifies, against a local directory and a real S3 server."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import IntegrityError, InvalidArgument, NotFound, StoreClosed
from asyncstore.checkpoint import Checkpointer, Version
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import assert_tidy, contents, run_until_killed, state_of

pytestmark = pytest.mark.anyio


async def leftovers(run: Path) -> int:
    """Files in a local run that are neither versions nor packs they point into."""
    versions, named, _ = await contents(run)
    keep = set(versions) | named
    return sum(1 for p in run.rglob("*") if p.is_file() and str(p.relative_to(run)) not in keep)


async def test_retention_over_twenty_saves(run_url: tuple[str, dict[str, Any] | None]) -> None:
    url, options = run_url
    async with Checkpointer(url, keep_last=3, keep_every=5, store_options=options) as ckpt:
        for step in range(1, 21):
            handle = await ckpt.save(state_of(step), step)
            result = await handle
            assert result.url.endswith(f"step-{step:09d}.ckpt")
    async with Checkpointer(url, store_options=options) as again:
        steps = [v.step for v in await again.versions()]
        # The newest three, and every fifth step for good.
        assert steps == [5, 10, 15, 18, 19, 20]
        loaded = await again.load()
        assert loaded["step"] == 20
        assert torch.equal(loaded["w"], torch.full((1000,), 20.0))
        assert (await again.load(step=5))["step"] == 5
        latest = await again.latest()
        assert isinstance(latest, Version)
        assert latest.step == 20
        assert latest.size > 0
        assert again.stats().saves == 0  # counted per checkpointer
    stats = ckpt.stats()
    assert stats.saves == 20
    assert stats.failed == 0
    assert stats.deleted == 14
    assert stats.bytes_written >= 20 * 4000
    assert 0 < stats.last_blocking_seconds <= stats.blocking_seconds
    assert stats.last_total_seconds >= stats.last_blocking_seconds
    assert stats.bytes_skipped == 0


async def test_keep_last_one_keeps_only_the_newest(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, keep_last=1) as ckpt:
        for step in (0, 100, 200):
            await (await ckpt.save(state_of(step), step))
    assert await assert_tidy(tmp_path) == ["step-000000200.ckpt"]


async def test_saves_that_commit_out_of_order_keep_exactly_keep_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Step 100's commit is held back until step 200 has committed (a process's first save
    # is often the slowest): retention must still keep only keep_last versions, and the
    # stats must be current as soon as an awaited handle returns.
    from asyncstore.checkpoint import _target

    later_committed = asyncio.Event()
    commit = _target.StoreSink.commit

    async def held_back(self: _target.StoreSink) -> None:
        if self.url.endswith("step-000000100.ckpt"):
            await later_committed.wait()
        await commit(self)

    monkeypatch.setattr(_target.StoreSink, "commit", held_back)
    async with Checkpointer(tmp_path, keep_last=1, differential=False) as ckpt:
        first = await ckpt.save(state_of(100), 100)
        second = await ckpt.save(state_of(200), 200)
        await second
        assert ckpt.stats().saves == 1  # counted before the awaited handle returned
        later_committed.set()
        await first
        assert ckpt.stats().saves == 2
    assert await assert_tidy(tmp_path) == ["step-000000200.ckpt"]


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40  # inside a chunk: only its checksum can tell
    path.write_bytes(bytes(data))


async def test_a_damaged_newest_version_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Checkpointer(tmp_path, keep_last=5) as ckpt:
        for step in (10, 20, 30):
            await (await ckpt.save(state_of(step), step, metadata={"loss": 0.5}))
        damage(tmp_path / "step-000000030.ckpt")
        with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
            loaded = await ckpt.load()
        assert loaded["step"] == 20
        assert any("step 30" in r.getMessage() for r in caplog.records)
        with pytest.raises(IntegrityError, match="newest version, step 30"):
            await ckpt.load(strict=True)
        with pytest.raises(IntegrityError):
            await ckpt.load(step=30)
        report = await ckpt.verify(30)
        assert not report.ok
        assert report.error
        assert (await ckpt.verify(20)).ok
        with pytest.raises(IntegrityError):
            await ckpt.verify(30, raise_on_error=True)
        # A truncated one too: the one before it loads.
        path = tmp_path / "step-000000020.ckpt"
        path.write_bytes(path.read_bytes()[:-100])
        assert (await ckpt.load())["step"] == 10
        damage(tmp_path / "step-000000010.ckpt")
        with pytest.raises(IntegrityError, match=r"no version at .* loads"):
            await ckpt.load()


async def test_load_into_fills_the_model_in_place(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    async with Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(model.state_dict(), 7))
        fresh = torch.nn.Linear(4, 3)
        target = fresh.state_dict()
        await ckpt.load(into=target)
        assert torch.equal(fresh.weight, model.weight)


async def test_versions_ignore_other_files_and_delete_names_the_version(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a version")
    (tmp_path / "step-12.ckpt").write_bytes(b"too few digits: not this checkpointer's")
    async with Checkpointer(tmp_path) as ckpt:
        assert await ckpt.versions() == []
        assert await ckpt.latest() is None
        with pytest.raises(NotFound, match="holds no checkpoint versions"):
            await ckpt.load()
        await (await ckpt.save(state_of(1), 1))
        assert [v.step for v in await ckpt.versions()] == [1]
        await ckpt.delete(1)
        assert await ckpt.versions() == []
        with pytest.raises(NotFound, match=r"step-000000001\.ckpt"):
            await ckpt.delete(1)
        with pytest.raises(NotFound):
            await ckpt.load(step=1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"keep_last": 0}, r"^keep_last=0: expected int >= 1"),
        ({"keep_every": -1}, r"^keep_every=-1"),
        ({"compression": "lz4"}, r"^compression='lz4'"),
        ({"store_options": "x"}, r"^store_options='x'"),
    ],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Checkpointer(str(tmp_path), **options)


async def test_bad_calls_and_use_after_close(tmp_path: Path) -> None:
    ckpt = Checkpointer(str(tmp_path))
    async with ckpt:
        for bad in (-1, True, 1.5, "3"):
            with pytest.raises(InvalidArgument, match="step="):
                await ckpt.save(state_of(0), bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="strict="):
            await ckpt.load(strict="yes")  # type: ignore[arg-type]
    with pytest.raises(StoreClosed, match=r"Checkpointer at .* is closed"):
        await ckpt.save(state_of(0), 0)


KILLED_SAVE = """
import asyncio, os, signal, sys, threading
import torch
from asyncstore.checkpoint import Checkpointer

async def main():
    async with Checkpointer(sys.argv[1], keep_last=2) as ckpt:
        await (await ckpt.save({"w": torch.full((1000,), 1.0), "step": 1}, 1))
        # Killed at a random moment of the next save: a timer fires while it runs.
        threading.Timer(float(sys.argv[2]), os.kill, (os.getpid(), signal.SIGKILL)).start()
        await (await ckpt.save({"w": torch.randn(3_000_000), "step": 2}, 2))
        await asyncio.sleep(10)

asyncio.run(main())
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
async def test_a_save_killed_at_any_moment_leaves_a_loadable_version(
    tmp_path: Path, delay: float
) -> None:
    run_until_killed(KILLED_SAVE, str(tmp_path), str(delay))
    async with Checkpointer(tmp_path) as ckpt:
        steps = [v.step for v in await ckpt.versions()]
        assert 1 in steps or 2 in steps
        loaded = await ckpt.load()
        assert loaded["step"] == steps[-1]
        # The killed save's temp files and its pack, if it had them.
        left = await leftovers(tmp_path)
        assert await ckpt.gc() == left
        assert await ckpt.gc() == 0
    await assert_tidy(tmp_path)


async def test_the_top_level_name() -> None:
    assert asyncstore.Checkpointer is Checkpointer


def test_the_sync_checkpointer_for_training_loops(tmp_path: Path) -> None:
    import concurrent.futures

    weights = torch.zeros(1000)
    futures = []
    with asyncstore.torch.Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in range(5):
            weights.fill_(float(step))
            future = ckpt.save({"w": weights, "step": step}, step)
            assert isinstance(future, concurrent.futures.Future)
            futures.append(future)
            weights.fill_(-1.0)  # the training step goes on: the snapshot is taken
        assert all(f.result().stored_bytes > 0 for f in futures)
    with asyncstore.torch.Checkpointer(str(tmp_path)) as ckpt:
        assert [v.step for v in ckpt.versions()] == [3, 4]
        latest = ckpt.latest()
        assert latest is not None
        assert latest.step == 4
        loaded = ckpt.load()
        assert torch.equal(loaded["w"], torch.full((1000,), 4.0))
        assert ckpt.load(3)["step"] == 3
        assert ckpt.verify(4).ok
        ckpt.delete(3)
        assert ckpt.gc() == 0
        assert [v.step for v in ckpt.versions()] == [4]


KILLED_RUN = """
import asyncio, os, signal, sys, threading
import torch
from asyncstore.checkpoint import Checkpointer

async def main():
    threading.Timer(float(sys.argv[2]), os.kill, (os.getpid(), signal.SIGKILL)).start()
    async with Checkpointer(sys.argv[1], keep_last=2) as ckpt:
        start = ((await ckpt.latest()) or type("V", (), {"step": -1})).step + 1
        for step in range(start, start + 40):
            await ckpt.save({"w": torch.full((200_000,), float(step)), "step": step}, step)
            if step % 3 == 0:
                await ckpt.gc()
    await asyncio.sleep(30)

asyncio.run(main())
"""


async def test_a_run_killed_during_saves_retention_and_gc_keeps_its_newest_versions(
    tmp_path: Path,
) -> None:
    # Ten kills at moments spread over saves, retention and gc, each run resuming where
    # the one before stopped. After each: the newest committed version loads, every
    # version there verifies, retention kept at least the newest, and gc leaves nothing
    # but versions.
    newest = -1
    for delay in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        run_until_killed(KILLED_RUN, str(tmp_path), str(delay))
        async with Checkpointer(tmp_path, keep_last=2) as ckpt:
            versions = await ckpt.versions()
            if not versions:
                assert newest == -1  # killed before the first commit of the run
                continue
            assert versions[-1].step >= newest  # no committed newest version was lost
            newest = versions[-1].step
            loaded = await ckpt.load(strict=True)
            assert loaded["step"] == newest
            assert torch.equal(loaded["w"], torch.full((200_000,), float(newest)))
            for version in versions:
                assert (await ckpt.verify(version.step)).ok
            await ckpt.gc()
        await assert_tidy(tmp_path)
    assert newest > 0


@pytest.mark.s3
async def test_local_first_then_the_mirror(
    tmp_path: Path, seaweedfs: SeaweedFS, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as ckpt:
        for step in range(5):
            await ckpt.save(state_of(step), step)
    stats = ckpt.stats()
    assert stats.uploads == 5
    assert stats.upload_failures == 0
    assert stats.last_upload_seconds > 0
    assert stats.last_upload_lag_seconds > 0
    # Every byte went to the mirror once: each new pack while (or after) it was written,
    # each version after its commit, no pack twice.
    assert stats.bytes_uploaded == stats.bytes_written
    assert await assert_tidy(local) == ["step-000000003.ckpt", "step-000000004.ckpt"]
    assert await assert_tidy(mirror, options) == ["step-000000003.ckpt", "step-000000004.ckpt"]
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        assert [v.step for v in await only_mirror.versions()] == [3, 4]
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
        assert [(v.step, v.where) for v in await again.versions()] == [(3, "both"), (4, "both")]
        assert (await again.verify(4)).ok
        # A damaged local copy: the mirror's is read, with a warning.
        damage(local / "step-000000004.ckpt")
        with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
            assert (await again.load())["step"] == 4
        assert any("does not load" in r.getMessage() for r in caplog.records)
    # The local directory lost: every version is read from the mirror.
    shutil.rmtree(local)
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
        assert [(v.step, v.where) for v in await again.versions()] == [(3, "mirror"), (4, "mirror")]
        loaded = await again.load()
        assert loaded["step"] == 4
        assert torch.equal(loaded["w"], torch.full((1000,), 4.0))
        assert (await again.load(step=3))["step"] == 3
        await again.delete(3)
        assert [v.step for v in await again.versions()] == [4]


@pytest.mark.s3
async def test_a_mirror_that_is_down_never_costs_a_local_version(
    tmp_path: Path, seaweedfs: SeaweedFS, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstore.checkpoint import _mirror

    monkeypatch.setattr(_mirror, "UPLOAD_ATTEMPTS", 2)
    monkeypatch.setattr(_mirror, "UPLOAD_RETRY_SECONDS", 0.01)
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(
        seaweedfs, endpoint_url=proxy.url, max_attempts=2, retry_base_delay=0.01, connect_timeout=2
    )
    proxy.refuse(True)
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as ckpt:
        for step in range(4):
            await (await ckpt.save(state_of(step), step))  # the saves never fail
        # Resuming does not need the mirror: the local versions list and load.
        versions = await ckpt.versions()
        assert [(v.step, v.where, v.state) for v in versions] == [
            (step, "local", "uploading") for step in range(4)
        ]
        assert (await ckpt.load())["step"] == 3
    assert ckpt.stats().upload_failures >= 4
    assert ckpt.stats().uploads == 0
    # Retention kept every local version: none is on the mirror yet.
    assert len(await assert_tidy(local)) == 4
    proxy.refuse(False)
    committed = (local / "step-000000000.ckpt").stat().st_mtime
    await anyio.sleep(1.0)  # the versions wait for the next process
    # The next checkpointer on the run uploads them, then retention trims both stores.
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as again:
        await again.versions()  # first use: the uploads resume
    assert again.stats().uploads == 4
    # The lag counts from the local commit, made by the process before (the oldest
    # version's is uploaded last).
    assert again.stats().last_upload_lag_seconds >= time.time() - committed - 0.5
    # Opening a run never deletes: every version is there, in both stores now.
    assert len(await assert_tidy(local)) == 4
    assert len(await assert_tidy(mirror, options)) == 4
    # The next save's retention trims both.
    async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as third:
        await (await third.save(state_of(4), 4))
    assert await assert_tidy(local) == ["step-000000003.ckpt", "step-000000004.ckpt"]
    assert await assert_tidy(mirror, options) == ["step-000000003.ckpt", "step-000000004.ckpt"]
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        assert [v.step for v in await only_mirror.versions()] == [3, 4]


def test_mirror_options_need_a_mirror(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="mirror_options were given without mirror"):
        Checkpointer(tmp_path, mirror_options={"region": "x"})


KILLED_MIRRORED_RUN = """
import asyncio, json, os, signal, sys, threading
import torch
from asyncstore.checkpoint import Checkpointer

async def main():
    mirror, options = json.loads(sys.argv[3])
    threading.Timer(float(sys.argv[2]), os.kill, (os.getpid(), signal.SIGKILL)).start()
    async with Checkpointer(
        sys.argv[1], keep_last=2, mirror=mirror, mirror_options=options
    ) as ckpt:
        latest = await ckpt.latest()
        start = 0 if latest is None else latest.step + 1
        for step in range(start, start + 40):
            await ckpt.save({"w": torch.full((1_600_000,), float(step)), "step": step}, step)
    await asyncio.sleep(30)

asyncio.run(main())
"""


@pytest.mark.s3
async def test_a_mirrored_run_killed_during_uploads_loses_nothing(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    # Seven kills while versions (6.4 MB: multipart uploads) are saved, uploaded to
    # SeaweedFS and retained. After each, the newest version loads from the local copy or
    # the mirror; once a checkpointer has resumed the uploads, both stores hold the newest
    # version, and gc leaves nothing but versions in either (no temp file, no unfinished
    # upload).
    import json

    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    newest = -1
    for delay in (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4):
        run_until_killed(KILLED_MIRRORED_RUN, str(local), str(delay), json.dumps([mirror, options]))
        async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as ckpt:
            versions = await ckpt.versions()  # first use: unfinished uploads resume
            if not versions:
                assert newest == -1
                continue
            assert versions[-1].step >= newest
            newest = versions[-1].step
            assert (await ckpt.load(strict=True))["step"] == newest
        async with Checkpointer(local, keep_last=2, mirror=mirror, mirror_options=options) as ckpt:
            await ckpt.gc()
            versions = await ckpt.versions()
            assert versions[-1].step == newest
            assert versions[-1].where == "both"  # uploaded by the checkpointer before
        if local.exists():
            await assert_tidy(local)
        await assert_tidy(mirror, options)
        prefix = mirror.removeprefix(f"s3://{BUCKET}/")
        assert seaweedfs.list_multipart_uploads(BUCKET, prefix) == []
    assert newest > 0
