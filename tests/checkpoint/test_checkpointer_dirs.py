"""A Checkpointer's local directory: one that can never be made is refused at construction,
by name; one that exists is not written to by opening, listing or loading it."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncstore import InvalidArgument
from asyncstore.checkpoint import Checkpointer

from .helpers import state_of

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("file", "is a file, not a directory"),
        ("file/run", "a part of that path is a file"),
        ("/proc/asyncstore-run", "cannot be created as a directory"),
    ],
)
def test_a_run_directory_that_cannot_be_made_is_refused_at_construction(
    tmp_path: Path, where: str, message: str
) -> None:
    (tmp_path / "file").write_bytes(b"")
    path = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(InvalidArgument, match=message) as caught:
        Checkpointer(path)
    assert repr(path) in str(caught.value)
    with pytest.raises(InvalidArgument, match="mirror="):
        Checkpointer(tmp_path / "run", mirror=path)


async def test_a_missing_run_directory_is_made_and_an_existing_one_left_as_it_is(
    tmp_path: Path,
) -> None:
    run = tmp_path / "a" / "b" / "run"
    Checkpointer(run)  # made at construction, parents too
    assert run.is_dir()
    async with Checkpointer(run) as ckpt:
        await (await ckpt.save(state_of(1), 1))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    async with Checkpointer(run, keep_last=1) as look:
        assert [v.step for v in await look.versions()] == [1]
        assert (await look.load())["step"] == 1
        assert (await look.verify(1)).ok
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
