"""Differential saves: chunks an earlier version holds are stored as references into its
pack, packs go by reachability, and every kept version loads byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import asyncstore
from asyncstore import IntegrityError, InvalidArgument
from asyncstore.checkpoint import Checkpointer, read_manifest
from asyncstore.checkpoint import _format as fmt

from ..helpers import assert_same
from .helpers import (
    CHUNK,
    TENSORS,
    assert_tidy,
    base_state,
    changed,
    contents,
    rewrite_manifest_file,
)

pytestmark = pytest.mark.anyio


async def test_bytes_written_follow_what_changed(tmp_path: Path) -> None:
    full = TENSORS * CHUNK
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=10) as ckpt:
        state = base_state()
        first = await (await ckpt.save(state, 0))
        assert first.skipped_bytes == 0
        assert full <= first.stored_bytes < full * 1.02
        saved = {0: state}
        for step, fraction in ((1, 0.0), (2, 0.1), (3, 1.0)):
            state = changed(state, fraction, step)
            saved[step] = state
            result = await (await ckpt.save(state, step))
            new = round(TENSORS * fraction) * CHUNK
            assert result.skipped_bytes == full - new, fraction
            # The new chunks, plus the structure and manifest (a few KB).
            assert new <= result.stored_bytes < new + 0.02 * full, fraction
        stats = ckpt.stats()
        assert stats.bytes_skipped == 2 * full - 2 * CHUNK
        for step, state in saved.items():
            assert_same(await ckpt.load(step), state)
            assert (await ckpt.verify(step)).ok
        # A 0% change wrote no pack at all; 10% wrote one with two chunks.
        versions, named, _ = await contents(tmp_path)
        manifests = [await read_manifest(tmp_path / key) for key in versions]
        assert [len(m.packs) for m in manifests] == [1, 1, 2, 1]
        assert manifests[1].packs == manifests[0].packs
        assert all(m.format == 2 for m in manifests)
        assert len(named) == 3


async def test_versions_kept_after_retention_still_load_and_verify(
    run_url: tuple[str, dict[str, Any] | None],
) -> None:
    # 12 saves, each changing 10% (a different 10% each time), keep_last=3 and every 4th
    # kept for good: whatever retention removed, every kept version loads byte for byte,
    # and the run holds exactly the packs its versions point into.
    url, options = run_url
    saved: dict[int, dict[str, Any]] = {}
    async with Checkpointer(
        url, chunk_bytes=CHUNK, keep_last=3, keep_every=4, store_options=options
    ) as ckpt:
        state = base_state()
        for step in range(12):
            state = {k: v.clone() for k, v in state.items()}
            for i in (step * 2 % TENSORS, (step * 2 + 1) % TENSORS):
                state[f"t{i:02d}"].mul_(-1.5)
            saved[step] = state
            await (await ckpt.save(state, step))
    # Step 10 starts a new chain (full_every=10): written whole.
    assert ckpt.stats().bytes_skipped == 10 * (TENSORS - 2) * CHUNK
    async with Checkpointer(url, store_options=options) as again:
        steps = [v.step for v in await again.versions()]  # the last retention has run
        assert steps == [0, 4, 8, 9, 10, 11]
        for step in steps:
            assert_same(await again.load(step), saved[step])
            assert (await again.verify(step)).ok
        await again.delete(0)  # the oldest: its pack holds chunks later ones point to
        await again.delete(4)
        for step in (8, 9, 10, 11):
            assert_same(await again.load(step), saved[step])
        assert await again.gc() == 0
    await assert_tidy(Path(url) if options is None else url, options)


async def test_a_missing_pack_falls_back_to_the_version_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        newer = changed(state, 0.1, 2)
        await (await ckpt.save(newer, 2))
        # Version 2 points into version 1's pack and its own: lose its own.
        own = (await read_manifest(tmp_path / "step-000000002.ckpt")).packs
        first = (await read_manifest(tmp_path / "step-000000001.ckpt")).packs
        (tmp_path / next(p for p in own if p not in first)).unlink()
        with pytest.raises(IntegrityError, match=r"step 2 .*which is missing"):
            await ckpt.load(strict=True)
        with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
            assert_same(await ckpt.load(), state)
        assert any("step 2" in r.getMessage() for r in caplog.records)
        report = await ckpt.verify(2)
        assert not report.ok
        assert report.error is not None
        assert "missing" in report.error


async def test_a_flipped_byte_in_a_shared_pack_names_the_pack(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        await (await ckpt.save(state, 2))  # nothing changed: all of it in 1's pack
        (pack,) = (await read_manifest(tmp_path / "step-000000002.ckpt")).packs
        path = tmp_path / pack
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
        for step in (1, 2):
            with pytest.raises(IntegrityError, match=rf"of {pack}\) does not match"):
                await ckpt.load(step)


async def test_packs_a_save_in_flight_points_into_outlive_retention(tmp_path: Path) -> None:
    # Save 2 starts while save 1 is writing, and points into version 0's pack. Save 1
    # changed everything and commits first: retention (keep_last=1) then deletes version
    # 0, and no committed version names its pack any more. It must survive until version
    # 2, which names it, has committed.
    state = base_state()
    slow = {**state, "extra": torch.randn(8_000_000)}  # 32 MB more: save 2 ends last
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=1) as ckpt:
        await (await ckpt.save(state, 0))
        (pack0,) = (await read_manifest(tmp_path / "step-000000000.ckpt")).packs
        one = await ckpt.save(changed(state, 1.0, 1), 1)
        two = await ckpt.save(slow, 2)
        await one
        await two
    # Save 2 did start before version 0 went: it points into pack 0.
    assert pack0 in (await read_manifest(tmp_path / "step-000000002.ckpt")).packs
    assert await assert_tidy(tmp_path) == ["step-000000002.ckpt"]
    async with Checkpointer(tmp_path) as again:
        assert_same(await again.load(), slow)


async def test_a_self_contained_run_writes_format_1(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, differential=False, chunk_bytes=CHUNK) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        result = await (await ckpt.save(state, 2))
        assert result.skipped_bytes == 0
    manifest = await read_manifest(tmp_path / "step-000000002.ckpt")
    assert manifest.format == 1
    assert manifest.packs == []
    assert not (tmp_path / "packs").exists()
    raw = (tmp_path / "step-000000002.ckpt").read_bytes()
    assert b"packs" not in raw[-fmt.FOOTER_SIZE - 4096 :]  # nothing a version 1 reader lacks
    assert_same(await asyncstore.load(tmp_path / "step-000000002.ckpt"), state)


async def test_a_differential_version_loads_by_path_but_not_from_a_file_object(
    tmp_path: Path,
) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
    path = tmp_path / "step-000000001.ckpt"
    assert_same(await asyncstore.load(path), state)
    assert_same(await asyncstore.load(f"file://{path}"), state)
    with pytest.raises(InvalidArgument, match="packs beside it"):
        await asyncstore.load(io.BytesIO(path.read_bytes()))


@pytest.mark.parametrize(
    "bad",
    ["../../etc/passwd", "packs/../../x.pack", "/abs.pack", "packs/x", "packs/.hidden.pack"],
)
async def test_a_crafted_pack_name_is_refused(tmp_path: Path, bad: str) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        await (await ckpt.save(base_state(), 1))
    path = tmp_path / "step-000000001.ckpt"
    rewrite_manifest_file(path, lambda m: msgspec.structs.replace(m, packs=[bad]))
    with pytest.raises(IntegrityError, match="names a pack"):
        await asyncstore.load(path)


async def test_a_crafted_pack_index_is_refused(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        await (await ckpt.save(base_state(), 1))
    path = tmp_path / "step-000000001.ckpt"

    def point_past(m: fmt.Manifest) -> fmt.Manifest:
        first = msgspec.structs.replace(m.storages[0], packs=[5] * len(m.storages[0].chunks))
        return msgspec.structs.replace(m, storages=[first, *m.storages[1:]])

    rewrite_manifest_file(path, point_past)
    with pytest.raises(IntegrityError, match="impossibly"):
        await asyncstore.load(path)


async def test_a_version_1_manifest_naming_packs_is_refused(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        await (await ckpt.save(base_state(), 1))
    path = tmp_path / "step-000000001.ckpt"
    rewrite_manifest_file(path, lambda m: msgspec.structs.replace(m, format=1))
    data = path.read_bytes()  # and the footer says version 1 as well
    footer = fmt.decode_footer(data[-fmt.FOOTER_SIZE :], str(path))
    assert footer is not None
    footer = msgspec.structs.replace(footer, version=1)
    path.write_bytes(data[: -fmt.FOOTER_SIZE] + fmt.encode_footer(footer))
    with pytest.raises(IntegrityError, match="version 1 manifest names packs"):
        await asyncstore.load(path)


async def test_cancelled_differential_saves_leave_no_pack(tmp_path: Path) -> None:
    # A differential save cancelled at random moments: no pack, temp file or version from
    # it stays visible once gc has run, and the versions before it load.
    import random

    rng = random.Random(1)
    state = base_state()
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=20) as ckpt:
        await (await ckpt.save(state, 0))
        for trial in range(8):
            newer = changed(state, 0.5, trial + 1)
            task = asyncio.ensure_future(ckpt.save(newer, 100 + trial))
            await asyncio.sleep(rng.random() * 0.03)
            task.cancel()
            try:
                handle = await task
                handle.cancel()  # it may have committed already: then it stays, whole
                with contextlib.suppress(asyncio.CancelledError):
                    await handle
            except asyncio.CancelledError:
                pass
        await ckpt.gc()
        assert_same(await ckpt.load(0), state)
    async with Checkpointer(tmp_path) as again:
        versions = [v.step for v in await again.versions()]
    assert versions[0] == 0
    assert await assert_tidy(tmp_path) == [f"step-{s:09d}.ckpt" for s in versions]


async def test_versions_say_what_each_save_wrote_and_which_is_damaged(tmp_path: Path) -> None:
    full = TENSORS * CHUNK
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        await (await ckpt.save(changed(state, 0.1, 2), 2))
        one, two = await ckpt.versions()
        assert one.raw_bytes == two.raw_bytes > full
        assert full <= one.stored_bytes < 1.02 * full
        assert 2 * CHUNK <= two.stored_bytes < 2 * CHUNK + 0.02 * full
        assert one.size < 0.02 * full  # the object holds no chunks: they are in packs
        assert (one.state, two.state) == ("committed", "committed")
        # A chunk of version 2's own pack damaged: verify finds it, and says so after.
        (own,) = set((await read_manifest(tmp_path / two.key)).packs) - set(
            (await read_manifest(tmp_path / one.key)).packs
        )
        data = bytearray((tmp_path / own).read_bytes())
        data[-100] ^= 1
        (tmp_path / own).write_bytes(bytes(data))
        assert not (await ckpt.verify(2)).ok
        assert [v.state for v in await ckpt.versions()] == ["committed", "damaged"]
        # Saved again: committed again.
        await (await ckpt.save(state, 2))
        assert [v.state for v in await ckpt.versions()] == ["committed", "committed"]
        # A damaged manifest is seen by the listing itself.
        data = bytearray((tmp_path / one.key).read_bytes())
        data[-fmt.FOOTER_SIZE - 10] ^= 1
        (tmp_path / one.key).write_bytes(bytes(data))
    async with Checkpointer(tmp_path) as again:
        # Its save time is in the damaged manifest: it keeps its place by step.
        assert [v.state for v in await again.versions()] == ["damaged", "committed"]
        assert (await again.versions())[0].raw_bytes == 0


async def test_verify_reads_a_large_checkpoint_a_batch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstore.checkpoint import _load, _reader

    monkeypatch.setattr(_load, "_VERIFY_BATCH", 3 * CHUNK)
    batches: list[int] = []
    real = _reader.ChunkReader.storages

    async def counted(self: Any, entries: list[fmt.Storage]) -> Any:
        batches.append(sum(e.nbytes for e in entries))
        return await real(self, entries)

    monkeypatch.setattr(_reader.ChunkReader, "storages", counted)
    state = {**base_state(), "big": torch.randn(CHUNK)}  # 4 chunks: read alone
    path = tmp_path / "c.ckpt"
    await (await asyncstore.save(state, path, chunk_bytes=CHUNK))
    manifest = await asyncstore.checkpoint.verify(path)
    assert len(manifest.storages) == TENSORS + 1
    assert sum(batches) == TENSORS * CHUNK + 4 * CHUNK
    assert max(batches) == 4 * CHUNK
    assert sorted(batches)[:-1] == [(TENSORS % 3) * CHUNK] + [3 * CHUNK] * (TENSORS // 3)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        await asyncstore.checkpoint.verify(path)


async def test_a_full_save_every_few_starts_a_chain_and_old_packs_go(tmp_path: Path) -> None:
    # full_every=3, keep_last=2: once a chain's versions are gone, so are its packs,
    # however many of their chunks were still the same; what stays is the newest chain.
    saved = {}
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=2, full_every=3) as ckpt:
        state = base_state()
        chains, skipped = [], []
        for step in range(8):
            state = changed(state, 0.1, step + 1) if step else state
            saved[step] = state
            result = await (await ckpt.save(state, step))
            skipped.append(result.skipped_bytes)
            chains.append(
                (await read_manifest(tmp_path / f"step-{step:09d}.ckpt")).metadata["chain"]
            )
        assert chains == [0, 1, 2, 0, 1, 2, 0, 1]
        assert [s == 0 for s in skipped] == [c == 0 for c in chains]
    # Closed: the last retention has run.
    versions, named, _ = await contents(tmp_path)
    assert versions == ["step-000000006.ckpt", "step-000000007.ckpt"]
    # Version 6 was written whole, 7 points into it: two packs, both of this chain.
    assert sorted(p.split("-")[1] for p in named) == ["000000006", "000000007"]
    async with Checkpointer(tmp_path) as again:
        for step in (6, 7):
            assert_same(await again.load(step), saved[step])
    await assert_tidy(tmp_path)


async def test_a_damaged_newest_version_is_not_built_on(tmp_path: Path) -> None:
    # The next save builds on the newest version whose manifest reads, not on a damaged one.
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        await (await ckpt.save(state, 2))
        path = tmp_path / "step-000000002.ckpt"
        data = bytearray(path.read_bytes())
        data[-fmt.FOOTER_SIZE - 10] ^= 1
        path.write_bytes(bytes(data))
        result = await (await ckpt.save(state, 3))
        assert result.skipped_bytes == TENSORS * CHUNK
        manifest = await read_manifest(tmp_path / "step-000000003.ckpt")
        assert manifest.metadata["chain"] == 1  # built on version 1 (0), not on 2
        assert_same(await ckpt.load(3), state)


async def test_a_load_under_way_survives_retention_deleting_its_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process's retention may delete a version and its packs while this one loads
    # it: once the load has begun, it reads the files it opened, as for a version 1 file.
    from asyncstore.checkpoint import _reader

    async with Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        await (await ckpt.save(changed(state, 0.5, 2), 2))
    real = _reader.ChunkReader.structure

    async def deleted_meanwhile(self: Any) -> bytes:
        shutil.rmtree(tmp_path)
        return await real(self)

    monkeypatch.setattr(_reader.ChunkReader, "structure", deleted_meanwhile)
    assert_same(await asyncstore.load(tmp_path / "step-000000002.ckpt"), changed(state, 0.5, 2))


async def test_a_differential_save_to_local_disk_goes_around_the_page_cache(
    tmp_path: Path,
) -> None:
    # Chunks skipped between written ones would leave the rest misaligned with the file:
    # the pack is padded instead, so its bytes still go straight from staging memory.
    gen = torch.Generator().manual_seed(5)
    state = {f"w{i:02d}": torch.randn(1000 + 37 * i, generator=gen) for i in range(40)}
    state["big"] = torch.randn(3 << 18, generator=gen)
    async with Checkpointer(tmp_path, compression=None, chunk_bytes=1 << 20) as ckpt:
        await (await ckpt.save(state, 1))
        for key in [*list(state)[::3], "big"]:  # every third tensor: skips all along
            state[key].add_(1.0)
        result = await (await ckpt.save(state, 2))
        assert result.skipped_bytes > 0
        # All but the version object (a few KB, written in one piece) and the small
        # tensors' writes (too small to go direct).
        own = result.stored_bytes - (tmp_path / "step-000000002.ckpt").stat().st_size
        assert result.direct_bytes >= 0.9 * own
        assert_same(await ckpt.load(2), state)
