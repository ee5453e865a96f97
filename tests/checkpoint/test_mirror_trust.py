"""The mirror never resurrects, keeps or serves what it should not: a version deleted during
its upload stays deleted, copies are told apart by checksum (not size), and a damaged
local copy falls through to the mirror's good one."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
from asyncstore.checkpoint import Checkpointer, _mirror
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, s3_options, unique

pytestmark = [pytest.mark.anyio, pytest.mark.s3]

KEY = "step-000000001.ckpt"
BIG = 3 * 1024 * 1024  # floats: 12 MiB, more than two 5 MiB parts


def big_state(value: float) -> dict[str, Any]:
    return {"w": torch.full((BIG,), value), "step": 1}


async def keys_in(url: str, options: dict[str, Any]) -> list[str]:
    async with asyncstore.open_store(url, **options) as store:
        return sorted([info.key async for info in store.list("")])


def hold_upload_of(
    monkeypatch: pytest.MonkeyPatch, key: str, *, after: bool = False
) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the upload of ``key`` until released: after its first part is sent, or (with
    ``after``) once the copy is complete, before the upload ends. Whichever way it goes:
    copied after the commit, or sent as the save writes it (the mirror following a full
    version's file)."""
    started, release = asyncio.Event(), asyncio.Event()
    real = _mirror.send_checked

    async def held(target: Any, name: str, chunks: Any, origin: str) -> int:
        if name != key or release.is_set():
            return await real(target, name, chunks, origin)
        if after:
            sent = await real(target, name, chunks, origin)
            started.set()
            await release.wait()
            return sent

        async def first_then_held() -> Any:
            # The first chunk goes (a part to the server), then the upload waits. On a
            # local disk the source is still read from the file deleted meanwhile.
            async for chunk in chunks:
                yield chunk
                if not started.is_set():
                    started.set()
                    await release.wait()

        return await real(target, name, first_then_held(), origin)

    monkeypatch.setattr(_mirror, "send_checked", held)
    return started, release


async def test_a_version_deleted_during_its_upload_stays_deleted(
    tmp_path: Path, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "run"
    prefix = unique("mirror")
    mirror = f"s3://{BUCKET}/{prefix}"
    options = s3_options(seaweedfs)
    started, release = hold_upload_of(monkeypatch, KEY)
    async with Checkpointer(
        local, differential=False, compression=None, mirror=mirror, mirror_options=options
    ) as ckpt:
        await (await ckpt.save(big_state(1.0), 1))
        await asyncio.wait_for(started.wait(), 30)
        await ckpt.delete(1)
        release.set()  # too late: the upload was abandoned
        assert await ckpt.versions() == []
    assert KEY not in await keys_in(mirror, options)
    # Its unfinished parts went with it.
    assert seaweedfs.list_multipart_uploads(BUCKET, f"{prefix}/") == []
    # The next checkpointer on the run does not bring it back.
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
        assert await again.versions() == []
    assert KEY not in await keys_in(mirror, options)


async def test_a_version_another_process_deletes_during_its_upload_stays_deleted(
    tmp_path: Path, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    started, release = hold_upload_of(monkeypatch, KEY, after=True)
    async with Checkpointer(
        local, differential=False, compression=None, mirror=mirror, mirror_options=options
    ) as ckpt:
        await (await ckpt.save(big_state(1.0), 1))
        await asyncio.wait_for(started.wait(), 30)
        assert KEY in await keys_in(mirror, options)  # copied, the upload not yet ended
        async with Checkpointer(local) as other:  # knows nothing of the upload
            await other.delete(1)
        release.set()  # the upload finishes, finds its version gone, removes the copy
    assert KEY not in await keys_in(mirror, options)
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
        assert await again.versions() == []


async def test_a_step_saved_again_with_bytes_of_the_same_size_is_uploaded_again(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    settings: dict[str, Any] = {"differential": False, "compression": None}
    async with Checkpointer(local, mirror=mirror, mirror_options=options, **settings) as ckpt:
        await (await ckpt.save({"w": torch.full((1000,), 1.0), "step": 1}, 1))
    first = (local / KEY).stat().st_size
    # Saved again without the mirror (a job run by hand, say): other bytes, same size.
    async with Checkpointer(local, **settings) as by_hand:
        await (await by_hand.save({"w": torch.full((1000,), 2.0), "step": 1}, 1))
    assert (local / KEY).stat().st_size == first
    async with Checkpointer(local, mirror=mirror, mirror_options=options, **settings) as again:
        # Not "both": the copies are different versions, and the local one is newer.
        (version,) = await again.versions()
        assert (version.where, version.state) == ("local", "uploading")
    assert again.stats().uploads == 1
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        assert torch.equal((await only_mirror.load(step=1))["w"], torch.full((1000,), 2.0))
    async with Checkpointer(local, mirror=mirror, mirror_options=options, **settings) as synced:
        assert [v.where for v in await synced.versions()] == ["both"]


async def test_a_truncated_local_copy_falls_through_to_the_mirror(
    tmp_path: Path, seaweedfs: SeaweedFS, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    async with Checkpointer(local, keep_last=5, mirror=mirror, mirror_options=options) as ckpt:
        for step in (1, 2):
            await (await ckpt.save({"w": torch.full((1000,), float(step)), "step": step}, step))
    path = local / "step-000000002.ckpt"
    path.write_bytes(path.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
        async with Checkpointer(local, mirror=mirror, mirror_options=options) as again:
            assert [(v.step, v.where) for v in await again.versions()] == [
                (1, "both"),
                (2, "mirror"),
            ]
            loaded = await again.load()
            assert loaded["step"] == 2
    # Said once, naming both copies; nothing was uploaded or retried.
    notes = [r.getMessage() for r in caplog.records if "step 2" in r.getMessage()]
    assert notes
    assert str(local) in notes[0]
    assert mirror in notes[0]
    assert again.stats().upload_failures == 0
    assert again.stats().uploads == 0
    # The mirror's good copy was not replaced by the damaged one.
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        assert (await only_mirror.verify(2)).ok


async def test_a_stalled_mirror_costs_a_load_and_a_close_seconds_not_hours(
    tmp_path: Path,
    seaweedfs: SeaweedFS,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs, endpoint_url=proxy.url, read_timeout=60, max_attempts=2)
    limits: dict[str, Any] = {"mirror_timeout": 1.0, "close_timeout": 2.0}
    async with Checkpointer(local, mirror=mirror, mirror_options=options, **limits) as ckpt:
        await (await ckpt.save(big_state(1.0), 1))
    proxy.stall(True)  # the mirror accepts connections and never answers
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
        async with Checkpointer(local, mirror=mirror, mirror_options=options, **limits) as again:
            loaded = await again.load()
            assert loaded["step"] == 1
            await (await again.save(big_state(2.0), 2))  # its upload stalls
    # Bounded by the timeouts, far below the S3 client's own (60 s a request, retried).
    assert time.monotonic() - started < 30
    messages = [r.getMessage() for r in caplog.records]
    assert any("did not answer within 1.0 s" in m for m in messages)
    assert any("are abandoned" in m for m in messages)
    proxy.stall(False)
    # The abandoned upload stayed local; the next checkpointer uploads it.
    async with Checkpointer(local, mirror=mirror, mirror_options=options) as later:
        await later.versions()
    assert "step-000000002.ckpt" in await keys_in(mirror, s3_options(seaweedfs))
