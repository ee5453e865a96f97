"""Direct (O_DIRECT) appends: every byte lands where it belongs, whatever the alignment."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncstore
from asyncstore.stores._direct import ALIGN, DirectAppender, address_of

pytestmark = pytest.mark.anyio

# One page-aligned arena: the pieces below are views of it at chosen offsets, so that some
# line up with their place in the file and some do not.
ARENA = 1 << 20

# (offset in the arena, length, read-only copy instead of a view)
pieces = st.lists(
    st.tuples(
        st.integers(0, 3).map(lambda k: k * ALIGN) | st.integers(0, ARENA // 2),
        st.integers(0, 300_000),
        st.booleans(),
    ),
    max_size=12,
)


def _arena() -> tuple[mmap.mmap, memoryview]:
    arena = mmap.mmap(-1, ARENA)
    arena.write(os.urandom(ARENA))
    return arena, memoryview(arena)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=pieces, fall_back_after=st.none() | st.integers(0, 12))
def test_appended_bytes_are_exact(
    tmp_path: Path, parts: list[tuple[int, int, bool]], fall_back_after: int | None
) -> None:
    _, view = _arena()
    path = tmp_path / "out.bin"
    expected = bytearray()
    with open(path, "wb", buffering=0) as f:
        appender = DirectAppender(str(path), f.fileno())
        assert appender.direct  # this file system takes O_DIRECT
        for i, (offset, length, readonly) in enumerate(parts):
            if i == fall_back_after:
                appender.close()  # as after an EINVAL: the rest goes through the page cache
            length = min(length, ARENA - offset)
            piece = view[offset : offset + length]
            data = memoryview(bytes(piece)) if readonly else piece
            appender.write(data)
            expected += piece
            assert appender.position == len(expected)
        # Direct writes were only tried where they line up, so none was refused.
        assert appender.direct == (fall_back_after is None or fall_back_after >= len(parts))
        appender.finish()
        appender.close()
    assert path.read_bytes() == bytes(expected)


def test_lined_up_buffers_skip_the_copy(tmp_path: Path) -> None:
    _, view = _arena()
    path = tmp_path / "out.bin"
    with open(path, "wb", buffering=0) as f:
        appender = DirectAppender(str(path), f.fileno())
        # 100 bytes, then a buffer whose address is 100 bytes past a page boundary: it lines
        # up with its offset in the file, so all of it but the head block goes direct.
        appender.write(memoryview(b"h" * 100))
        appender.write(view[100 : 100 + 512 * 1024])
        lined_up = appender.direct_bytes
        # A buffer that does not line up is copied through the bounce buffer.
        appender.write(view[1 : 1 + 256 * 1024])
        assert appender.direct_bytes == lined_up
        assert appender.direct  # nothing was refused
        appender.finish()
        appender.close()
    assert lined_up >= 512 * 1024 - ALIGN
    assert path.read_bytes() == b"h" * 100 + bytes(view[100 : 100 + 512 * 1024]) + bytes(
        view[1 : 1 + 256 * 1024]
    )


def test_address_of() -> None:
    buffer = ctypes.create_string_buffer(64)
    assert address_of(memoryview(buffer).cast("B")[8:]) == ctypes.addressof(buffer) + 8
    assert address_of(memoryview(b"read-only")) is None


async def test_local_direct_writer_commits_atomically(tmp_path: Path) -> None:
    store = asyncstore.open_store(tmp_path)
    assert isinstance(store, asyncstore.LocalStore)
    _, view = _arena()
    async with store.open_writer("big.bin", direct=True) as writer:
        await writer.write(view[: 3 * ALIGN + 17])
        await writer.write(b"tail")
        assert not (tmp_path / "big.bin").exists()  # nothing visible before the commit
    assert (tmp_path / "big.bin").read_bytes() == bytes(view[: 3 * ALIGN + 17]) + b"tail"
    # A failed write leaves nothing behind: no object, no temp file.
    with pytest.raises(RuntimeError):
        async with store.open_writer("gone.bin", direct=True) as writer:
            await writer.write(view[: 2 * ALIGN])
            raise RuntimeError("the caller failed")
    assert sorted(os.listdir(tmp_path)) == ["big.bin"]
    await store.aclose()


async def test_a_device_refusing_direct_writes_gets_every_byte_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file system that opens files with O_DIRECT but refuses the writes (EINVAL: a block
    # size above 4096, say): the appender and a checkpoint save carry on through the page
    # cache, and every byte lands.
    import errno
    import fcntl

    import torch

    real = os.pwrite

    def refusing(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    _, view = _arena()
    path = tmp_path / "out.bin"
    with open(path, "wb", buffering=0) as f:
        appender = DirectAppender(str(path), f.fileno())
        appender.write(memoryview(b"h" * 100))
        appender.write(view[100 : 100 + 512 * 1024])  # lines up: tried direct, refused
        appender.write(view[7 : 7 + 100_000])
        assert not appender.direct
        appender.finish()
        appender.close()
    expected = b"h" * 100 + bytes(view[100 : 100 + 512 * 1024]) + bytes(view[7 : 7 + 100_000])
    assert path.read_bytes() == expected
    state = {"w": torch.randn(1 << 18)}
    result = await (await asyncstore.save(state, tmp_path / "a.ckpt", compression=None))
    assert result.direct_bytes == 0
    assert torch.equal((await asyncstore.load(tmp_path / "a.ckpt"))["w"], state["w"])
