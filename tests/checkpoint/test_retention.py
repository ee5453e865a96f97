"""Retention and prune delete only what the policy says, counted over versions that load:
opening a run never deletes, a rollback save is the newest version, and a damaged version
never takes a good one's place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncstore
from asyncstore import IntegrityError
from asyncstore.checkpoint import Checkpointer, read_manifest
from asyncstore.checkpoint._retention import Candidate, newest_first, victims
from asyncstore.cli import main
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from .helpers import assert_tidy, state_of

pytestmark = pytest.mark.anyio


async def steps_in(url: str | Path, options: dict[str, Any] | None = None) -> list[int]:
    return [int(key[5:14]) for key in await assert_tidy(url, options)]


async def damage_pack(url: str | Path, step: int, options: dict[str, Any] | None = None) -> None:
    # Truncate the pack that only the version of ``step`` points into.
    async with asyncstore.open_store(str(url), **(options or {})) as store:
        key = f"step-{step:09d}.ckpt"
        (own,) = [p for p in (await read_manifest((store, key))).packs if f"-{step:09d}-" in p]
        data = await store.get(own)
        await store.put(own, data[: len(data) // 2])


# -- the rule itself -------------------------------------------------------------------------


def test_the_window_reaches_back_to_the_kth_loadable_version() -> None:
    good = [Candidate(step, float(step), loadable=True) for step in range(1, 6)]
    assert victims(good, 2, None) == [1, 2, 3]
    # A damaged newest version: kept (evidence), and not counted.
    damaged = [*good[:4], good[4]._replace(loadable=False)]
    assert victims(damaged, 1, None) == [1, 2, 3]
    # Nothing loads: nothing goes.
    assert victims([c._replace(loadable=False) for c in good], 1, None) == []
    # Milestones and protected versions stay outside the window.
    assert victims(good, 1, 2) == [1, 3]
    assert victims([good[0]._replace(protected=True), *good[1:]], 1, None) == [2, 3, 4]
    # A rollback: step 3 saved last is the newest; the window is 3 then 5.
    rolled = [*good[:2], Candidate(3, 10.0, loadable=True), good[3], good[4]]
    assert victims(rolled, 2, None) == [1, 2, 4]


def test_an_unchecked_version_in_the_window_is_a_bug_not_a_victim() -> None:
    with pytest.raises(ValueError, match="not checked"):
        victims([Candidate(1, 1.0), Candidate(2, 2.0, loadable=True)], 2, None)


candidates = st.lists(
    st.builds(
        Candidate,
        step=st.integers(0, 50),
        saved=st.floats(0, 100),
        protected=st.booleans(),
        loadable=st.booleans(),
    ),
    max_size=25,
    unique_by=lambda c: c.step,
)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(1, 6), st.none() | st.integers(1, 10))
def test_retention_never_leaves_fewer_loadable_versions_than_it_may(
    run: list[Candidate], keep_last: int, keep_every: int | None
) -> None:
    doomed = set(victims(run, keep_last, keep_every))
    kept = [c for c in newest_first(run) if c.step not in doomed]
    loadable = [c for c in newest_first(run) if c.loadable]
    # The newest keep_last loadable versions are all kept...
    assert all(c.step not in doomed for c in loadable[:keep_last])
    # ...and so is every protected version, every milestone, everything newer than them.
    assert all(not c.protected for c in run if c.step in doomed)
    assert all(keep_every is None or c.step % keep_every for c in run if c.step in doomed)
    if len(loadable) >= keep_last:
        edge = newest_first(run).index(loadable[keep_last - 1])
        assert not {c.step for c in newest_first(run)[: edge + 1]} & doomed
    else:
        assert doomed == set()
    assert len(kept) + len(doomed) == len(run)


# -- a Checkpointer ------------------------------------------------------------------------


@pytest.mark.s3
async def test_opening_a_mirrored_run_with_another_policy_deletes_nothing(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    local = tmp_path / "run"
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    async with Checkpointer(
        local, keep_last=3, keep_every=2, mirror=mirror, mirror_options=options
    ) as ckpt:
        for step in range(1, 8):
            await (await ckpt.save(state_of(step), step))
    before = await steps_in(local)
    assert before == [2, 4, 5, 6, 7]
    assert await steps_in(mirror, options) == before
    # A script that only looks: another keep_last, no keep_every.
    async with Checkpointer(local, keep_last=1, mirror=mirror, mirror_options=options) as look:
        assert [v.step for v in await look.versions()] == before
        assert (await look.load())["step"] == 7
        assert (await look.load(step=2))["step"] == 2
        assert (await look.verify(4)).ok
    assert await steps_in(local) == before
    assert await steps_in(mirror, options) == before


async def test_a_rollback_save_is_the_newest_version(
    run_url: tuple[str, dict[str, Any] | None],
) -> None:
    url, options = run_url
    async with Checkpointer(url, keep_last=2, store_options=options) as ckpt:
        for step in range(1, 6):
            await (await ckpt.save(state_of(step), step))
        # Loss spiked after step 3: training goes back there and saves it again.
        rolled = {**state_of(3), "again": True}
        await (await ckpt.save(rolled, 3))
        assert (await ckpt.load(step=3))["again"] is True
    # The newest version is the one saved last: its retention kept the window 3, then 5.
    assert await steps_in(url, options) == [3, 5]
    async with Checkpointer(url, keep_last=2, store_options=options) as ckpt:
        assert (await ckpt.load())["again"] is True
        latest = await ckpt.latest()
        assert latest is not None
        assert latest.step == 3
        assert [v.step for v in await ckpt.versions()] == [5, 3]
        # Training goes on from 3: step 4 is saved again, and 5 (the abandoned branch) goes.
        await (await ckpt.save(state_of(4), 4))
    assert await steps_in(url, options) == [3, 4]
    async with Checkpointer(url, store_options=options) as again:
        assert [v.step for v in await again.versions()] == [3, 4]
        assert (await again.load())["step"] == 4


async def test_a_differential_save_after_a_rollback_builds_on_the_rolled_back_state(
    tmp_path: Path,
) -> None:
    async with Checkpointer(tmp_path, keep_last=5, chunk_bytes=4096) as ckpt:
        for step in range(1, 4):
            await (await ckpt.save(state_of(step), step))
        await (await ckpt.save(state_of(1), 1))  # back to step 1's state
        # Step 1's state again: every chunk is in the pack of the version saved last.
        result = await (await ckpt.save(state_of(1), 2))
        assert result.skipped_bytes == 4000
        assert (await ckpt.load(step=2))["step"] == 1


async def test_retention_does_not_count_a_version_whose_pack_is_damaged(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in range(1, 4):
            await (await ckpt.save(state_of(step), step))
        await damage_pack(tmp_path, 3)
        await (await ckpt.save(state_of(4), 4))
    # The window: 4, 3 (damaged: not counted), 2. Step 1 goes.
    assert await steps_in(tmp_path) == [2, 3, 4]
    async with Checkpointer(tmp_path) as ckpt:
        assert (await ckpt.load(step=2))["step"] == 2


async def test_prune_counts_only_versions_that_verify(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, keep_last=10) as ckpt:
        for step in range(1, 5):
            await (await ckpt.save(state_of(step), step))
    # The newest version's own bytes damaged (its manifest still reads).
    manifest = await read_manifest(tmp_path / "step-000000004.ckpt")
    (own,) = manifest.packs
    path = tmp_path / own
    data = bytearray(path.read_bytes())
    data[manifest.storages[0].chunks[0].offset] ^= 0xFF
    path.write_bytes(bytes(data))
    async with Checkpointer(tmp_path) as ckpt:
        assert await ckpt.prune(1, dry_run=True) == [1, 2]
        assert await ckpt.prune(1) == [1, 2]
        assert (await ckpt.load())["step"] == 3
    assert await steps_in(tmp_path) == [3, 4]


async def test_prune_refuses_when_no_version_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Checkpointer(tmp_path, keep_last=10, differential=False) as ckpt:
        for step in range(1, 4):
            await (await ckpt.save(state_of(step), step))
    for path in tmp_path.glob("step-*.ckpt"):
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    async with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(IntegrityError, match=r"no version .* verifies .* deleted nothing"):
            await ckpt.prune(1)
    assert await anyio.to_thread.run_sync(main, ["prune", str(tmp_path), "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "deleted nothing" in err
    assert "Traceback" not in err
    assert len(list(tmp_path.glob("step-*.ckpt"))) == 3


async def test_cli_prune_keeps_a_damaged_newest_and_the_good_one_below_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Checkpointer(tmp_path, keep_last=10, differential=False) as ckpt:
        for step in range(1, 5):
            await (await ckpt.save(state_of(step), step))
    path = tmp_path / "step-000000004.ckpt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert await anyio.to_thread.run_sync(main, ["prune", str(tmp_path), "--keep-last", "1"]) == 0
    assert "deleted step 1\ndeleted step 2" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.glob("step-*.ckpt")) == [
        "step-000000003.ckpt",
        "step-000000004.ckpt",
    ]


def test_save_order_keeps_a_version_of_unknown_time_in_its_place_by_step() -> None:
    from asyncstore.checkpoint._versions import Version, in_save_order

    def v(step: int, saved: float | None) -> Version:
        return Version(step, f"step-{step:09d}.ckpt", 1, None, saved=saved)

    # Step 3 rolled back to (saved last); step 2's manifest does not read.
    listed = in_save_order([v(1, 10.0), v(2, None), v(3, 50.0), v(4, 30.0), v(5, 40.0)])
    assert [x.step for x in listed] == [1, 2, 4, 5, 3]


async def test_a_step_saved_again_within_a_second_is_read_again(
    run_url: tuple[str, dict[str, Any] | None],
) -> None:
    # Found by the stateful test on S3, whose mtimes have one-second resolution: the
    # third save of a step has the second's size and mtime, and a manifest cached by those
    # alone let collection delete the third's new pack. The ETag tells them apart.
    url, options = run_url
    async with Checkpointer(url, keep_last=2, chunk_bytes=4096, store_options=options) as ckpt:
        for value in (0.0, 1.0, 0.0, 1.0):
            await (await ckpt.save({"w": torch.full((1024,), value), "step": 0}, 0))
            loaded = await ckpt.load(step=0)
            assert float(loaded["w"][0]) == value
            assert (await ckpt.verify(0)).ok
    await assert_tidy(url, options)
