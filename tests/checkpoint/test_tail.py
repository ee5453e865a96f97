"""The mirror follows a pack while its save writes it: parts leave before the local commit,
the mirror's copy appears only after the version commits, a failed save leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import mmap
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstore import NotFound
from asyncstore.checkpoint import Checkpointer, _tail
from asyncstore.checkpoint._mirror import send_checked
from asyncstore.checkpoint._tail import Tail, Untailed
from asyncstore.checkpoint._target import Sink, StoreSink, open_sink, resolve
from asyncstore.stores import Store, _localwrite, open_store
from asyncstore.testing import FaultProxy, SeaweedFS

from ..conftest import BUCKET, s3_options, unique

pytestmark = pytest.mark.anyio

MiB = 1 << 20
KEY = "packs/step-000000001-0123abcd.pack"


@pytest.fixture(params=["s3", "local"])
async def mirror(
    request: pytest.FixtureRequest, tmp_path: Path, seaweedfs: SeaweedFS
) -> AsyncIterator[Store]:
    # 5 MiB parts: the first part of a 6 MiB pack leaves before the pack is whole.
    if request.param == "s3":
        store = open_store(f"s3://{BUCKET}/{unique('tail')}", **s3_options(seaweedfs))
    else:
        store = open_store(str(tmp_path / "mirror"))
    async with store:
        yield store


async def followed(tmp_path: Path) -> tuple[Tail, Sink]:
    local = open_store(str(tmp_path / "local"))
    sink = await open_sink(resolve((local, KEY), None, writing=True))
    tail = Tail(KEY)
    return tail, tail.attach(sink)


def pack_bytes(size: int) -> memoryview:
    # Page-aligned, as a save's staging slabs are: the local writer takes it around the
    # page cache, so what is "written for good" is exactly what the appender let go.
    buffer = mmap.mmap(-1, size)
    buffer[:] = os.urandom(size)
    return memoryview(buffer)


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def open_files() -> list[str]:
    """The files this process holds open (not its sockets: clients keep connections)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(path for path in found if path.startswith("/"))


@pytest.fixture
def slow_local_writes(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Slows each write of a local store by the seconds given (a busy disk)."""

    def slow_down(seconds: float) -> None:
        write = _localwrite.TempFile.write

        def slow_write(self: _localwrite.TempFile, data: memoryview) -> None:
            write(self, data)
            time.sleep(seconds)

        monkeypatch.setattr(_localwrite.TempFile, "write", slow_write)

    return slow_down


def mirrored_run(tmp_path: Path, seaweedfs: SeaweedFS) -> tuple[Checkpointer, str, dict[str, Any]]:
    """A checkpointer on a local directory with an empty S3 mirror (1 MiB chunks), the
    mirror's URL and options."""
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    ckpt = Checkpointer(tmp_path / "run", mirror=mirror, mirror_options=options, chunk_bytes=MiB)
    return ckpt, mirror, options


def tensors(count: int) -> dict[str, torch.Tensor]:
    """``count`` MiB of fp32, one tensor a MiB."""
    return {f"t{i}": torch.randn(MiB // 4) for i in range(count)}


def unfinished_uploads(url: str, seaweedfs: SeaweedFS) -> list[object]:
    if not url.startswith("s3://"):
        return []
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    return list(seaweedfs.list_multipart_uploads(BUCKET, prefix))


@pytest.fixture(params=["direct", "direct refused", "no direct"])
def direct_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Direct I/O as the file system allows it: wholly, opened but refused (EINVAL on each
    read or write: a block size above 4096), or not at all (tmpfs refuses the open)."""
    real_open, real_preadv, real_pwrite = os.open, os.preadv, os.pwrite

    def direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def refusing_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    def refusing_pwrite(fd: int, data: memoryview, offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    if request.param == "direct refused":
        monkeypatch.setattr(os, "preadv", refusing_preadv)
        monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    elif request.param == "no direct":
        monkeypatch.setattr(os, "open", refusing_open)
    return str(request.param)


async def test_parts_leave_as_the_pack_is_written_and_appear_after_the_release(
    tmp_path: Path, mirror: Store, seaweedfs: SeaweedFS, direct_io: str
) -> None:
    # Whichever way the file is written and read back, every byte arrives once.
    tail, sink = await followed(tmp_path)
    data = pack_bytes(6 * MiB + 1000)
    sent = asyncio.ensure_future(send_checked(mirror, KEY, tail.chunks(MiB), "the local pack"))
    for start in range(0, 6 * MiB, MiB):
        await sink.write(data[start : start + MiB])
    await until(lambda: tail.early_bytes == 6 * MiB, "the written megabytes were read back")
    if mirror.url.startswith("s3://"):
        # A part of the multipart upload is stored, the object is not.
        await until(lambda: bool(seaweedfs.list_multipart_uploads(BUCKET)), "a part was sent")
    await sink.write(data[6 * MiB :])  # held back in the appender's bounce buffer
    await sink.commit()
    await asyncio.sleep(0.05)
    assert not sent.done()  # the pack committed, but the version naming it has not
    with pytest.raises(NotFound):
        await mirror.stat(KEY)
    tail.release()
    assert await sent == len(data)
    tail.close()
    assert await mirror.get(KEY) == bytes(data)
    assert tail.early_bytes == 6 * MiB  # the rest went after the release
    assert unfinished_uploads(mirror.url, seaweedfs) == []


async def test_a_failed_save_leaves_nothing_in_the_mirror(
    tmp_path: Path, mirror: Store, seaweedfs: SeaweedFS
) -> None:
    tail, sink = await followed(tmp_path)
    data = pack_bytes(6 * MiB)
    sent = asyncio.ensure_future(send_checked(mirror, KEY, tail.chunks(MiB), "the local pack"))
    for start in range(0, 6 * MiB, MiB):
        await sink.write(data[start : start + MiB])
    await until(lambda: tail.early_bytes == 6 * MiB, "the written megabytes were read back")
    await sink.abort(OSError(28, "No space left on device"))
    with pytest.raises(Untailed, match="No space left"):
        await sent
    tail.close()
    with pytest.raises(NotFound):
        await mirror.stat(KEY)
    assert unfinished_uploads(mirror.url, seaweedfs) == []  # the upload was aborted
    assert not (tmp_path / "local" / KEY).exists()


async def test_a_pack_that_never_commits_or_cannot_be_followed_ends_the_tail(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    async def drain(tail: Tail) -> None:
        async for _ in tail.chunks(MiB):
            raise AssertionError("no byte should come")

    # The version committed without a pack (every chunk was known already).
    tail = Tail(KEY)
    tail.release()
    with pytest.raises(Untailed, match="no pack"):
        await drain(tail)
    # A store that is not a local directory: its sink is left as it is.
    async with open_store(f"s3://{BUCKET}/{unique('tail')}", **s3_options(seaweedfs)) as s3:
        s3_sink = StoreSink(s3, KEY, deferred=True)
        tail = Tail(KEY)
        assert tail.attach(s3_sink) is s3_sink
        with pytest.raises(Untailed, match="not a local file"):
            await drain(tail)
    # A save that fails after its pack committed (the version did not): nothing to send.
    tail, sink = await followed(tmp_path)
    await sink.write(pack_bytes(MiB))
    await sink.commit()
    tail.fail(RuntimeError("the manifest could not be written"))
    with pytest.raises(Untailed, match="manifest could not"):
        await drain(tail)
    tail.close()


@pytest.mark.s3
async def test_a_mirrored_checkpointer_sends_the_pack_while_it_is_written(
    tmp_path: Path, seaweedfs: SeaweedFS, slow_local_writes: Callable[[float], None]
) -> None:
    # Local writes slowed down (a busy disk): the mirror takes most of the pack before the
    # local commit, every byte goes once, and the mirror alone loads the version.
    slow_local_writes(0.02)
    ckpt, mirror, options = mirrored_run(tmp_path, seaweedfs)
    state = tensors(24)
    async with ckpt:
        await (await ckpt.save(state, 1))
        await (await ckpt.save(state, 2))  # nothing new: no pack at all
        state["t3"] += 1
        await (await ckpt.save(state, 3))
    stats = ckpt.stats()
    assert stats.uploads == 3
    assert stats.upload_failures == 0
    assert stats.bytes_uploaded == stats.bytes_written  # no pack sent twice
    assert stats.bytes_uploaded_early >= 16 * MiB  # of the first pack's 24 MiB
    assert unfinished_uploads(mirror, seaweedfs) == []
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        assert [v.step for v in await only_mirror.versions()] == [1, 2, 3]
        loaded = await only_mirror.load(3)
        assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


@pytest.mark.s3
async def test_a_cancelled_save_aborts_the_pack_upload_and_closes_the_file(
    tmp_path: Path, seaweedfs: SeaweedFS, slow_local_writes: Callable[[float], None]
) -> None:
    slow_local_writes(0.02)
    ckpt, mirror, options = mirrored_run(tmp_path, seaweedfs)
    fds = open_files()
    async with ckpt:
        handle = await ckpt.save(tensors(24), 1)
        prefix = mirror.removeprefix(f"s3://{BUCKET}/")
        await until(lambda: bool(seaweedfs.list_multipart_uploads(BUCKET, prefix)), "a part left")
        assert not handle.done()
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
    assert ckpt.stats().uploads == 0
    assert ckpt.stats().bytes_uploaded == 0  # the pack's upload never completed
    async with open_store(mirror, **options) as store:
        assert [info.key async for info in store.list("")] == []
        assert unfinished_uploads(mirror, seaweedfs) == []
    assert open_files() == fds  # the read-back descriptor is closed


@pytest.mark.s3
async def test_a_version_upload_does_not_wait_for_the_next_save(
    tmp_path: Path, seaweedfs: SeaweedFS, slow_local_writes: Callable[[float], None]
) -> None:
    # Saves back to back: the next save's pack upload waits on its local write, and the
    # version before it reaches the mirror meanwhile, not after that save commits.
    slow_local_writes(0.05)
    ckpt, _, _ = mirrored_run(tmp_path, seaweedfs)
    async with ckpt:
        await (await ckpt.save(tensors(8), 1))
        second = await ckpt.save(tensors(24), 2)
        await until(lambda: ckpt.stats().uploads == 1 or second.done(), "an upload or a commit")
        assert ckpt.stats().uploads == 1
        assert not second.done()  # 24 writes of 50 ms: the second save is still writing
        await second
    assert ckpt.stats().uploads == 2


@pytest.mark.s3
async def test_a_full_version_goes_to_the_mirror_as_it_is_written_and_once(
    tmp_path: Path, seaweedfs: SeaweedFS, slow_local_writes: Callable[[float], None]
) -> None:
    # differential=False: the version's file is the data, followed like a pack; its upload
    # after the commit finds it sent and copies nothing more.
    slow_local_writes(0.02)
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs)
    state = tensors(24)
    async with Checkpointer(
        tmp_path / "run", mirror=mirror, mirror_options=options, differential=False
    ) as ckpt:
        await (await ckpt.save(state, 1))
        state["t0"] += 1
        await (await ckpt.save(state, 2))
    stats = ckpt.stats()
    assert stats.uploads == 2
    assert stats.bytes_uploaded == stats.bytes_written  # each version sent once
    assert stats.bytes_uploaded_early >= 16 * MiB
    assert unfinished_uploads(mirror, seaweedfs) == []
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        assert [v.step for v in await only_mirror.versions()] == [1, 2]
        loaded = await only_mirror.load(2)
        assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


@pytest.mark.s3
async def test_a_version_naming_a_pack_still_being_sent_waits_for_it(
    tmp_path: Path, seaweedfs: SeaweedFS, proxy: FaultProxy
) -> None:
    # A slow mirror (0.2 s a request): save 1's pack is still on its way when save 2, the
    # same state (no pack of its own, pointing into save 1's), commits and is uploaded. Its
    # upload waits for that pack rather than sending it a second time.
    proxy.latency = 0.2
    mirror = f"s3://{BUCKET}/{unique('mirror')}"
    options = s3_options(seaweedfs, endpoint_url=proxy.url)
    state = tensors(8)
    async with Checkpointer(
        tmp_path / "run", mirror=mirror, mirror_options=options, chunk_bytes=MiB
    ) as ckpt:
        await (await ckpt.save(state, 1))
        await (await ckpt.save(state, 2))
    stats = ckpt.stats()
    assert stats.uploads == 2
    assert stats.bytes_uploaded == stats.bytes_written  # the pack went once
    proxy.latency = 0.0
    async with Checkpointer(mirror, store_options=options) as only_mirror:
        loaded = await only_mirror.load(2)
        assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


async def test_the_tail_lends_its_buffers_and_reads_into_them_again(
    tmp_path: Path, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mirror's parts are views of the tail's read buffers (no copy), each read into
    # again once its part is sent: the buffers made stay bounded by what the writer keeps
    # out (parts in flight and the one being gathered), whatever the pack's size, and the
    # next tail reads into the same ones.
    made: list[int] = []
    real_mmap = mmap.mmap

    def counted(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        if fileno == -1 and length == MiB:
            made.append(length)
        return real_mmap(fileno, length, *args, **kwargs)

    monkeypatch.setattr("asyncstore.checkpoint._tail.mmap.mmap", counted)
    monkeypatch.setattr("asyncstore.checkpoint._tail._FREE", {})  # none kept from before
    options = s3_options(seaweedfs, upload_max_inflight=2)  # 5 MiB parts, 2 in flight
    async with open_store(f"s3://{BUCKET}/{unique('tail')}", **options) as mirror:
        tail, sink = await followed(tmp_path)
        data = pack_bytes(40 * MiB)
        sent = asyncio.ensure_future(send_checked(mirror, KEY, tail.chunks(MiB), "the local pack"))
        for start in range(0, len(data), MiB):
            await sink.write(data[start : start + MiB])
        await sink.commit()
        tail.release()
        assert await sent == len(data)
        tail.close()
        assert await mirror.get(KEY) == bytes(data)
    # Out at once at most: 2 parts in flight, one waiting to go, one being gathered (5
    # chunks each), and the chunks read ahead; 40 were read. (Copied, 5 would do.)
    assert 5 + _tail._AHEAD < len(made) <= 4 * 5 + _tail._AHEAD, made  # lent, not copied
    made.clear()
    async with open_store(f"s3://{BUCKET}/{unique('tail')}", **options) as mirror:
        tail, sink = await followed(tmp_path / "again")
        sent = asyncio.ensure_future(send_checked(mirror, KEY, tail.chunks(MiB), "the local pack"))
        for start in range(0, 8 * MiB, MiB):
            await sink.write(data[start : start + MiB])
        await sink.commit()
        tail.release()
        assert await sent == 8 * MiB
        tail.close()
    assert made == []  # the buffers kept from the first pack


async def written_through(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    read: Callable[[Tail, memoryview, int, int], memoryview],
) -> tuple[Tail, Sink, memoryview]:
    """A followed pack of 12 MiB written (not committed), its tail reading with ``read``
    and no read buffer kept from before: the tail, the sink and the bytes."""
    monkeypatch.setattr(Tail, "_read", read)
    monkeypatch.setattr(_tail, "_FREE", {})
    tail, sink = await followed(tmp_path)
    data = pack_bytes(12 * MiB)
    for start in range(0, len(data), MiB):
        await sink.write(data[start : start + MiB])
    return tail, sink, data


async def test_the_tail_reads_a_few_chunks_ahead_and_stops_them_when_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the upload waits to send a chunk, the next ones are read: a read that came only
    # when asked could land in the save's last fsync and wait for the device's cache flush.
    # Four ahead and no more (bounded memory); closed early, the reads stop and their
    # buffers are kept for the next pack; a failed read is raised in its turn.
    offsets: list[int] = []
    real_read = Tail._read

    def recorded(self: Tail, buffer: memoryview, offset: int, n: int) -> memoryview:
        offsets.append(offset)
        if offset == 9 * MiB:
            raise OSError(errno.EIO, "Input/output error")
        return real_read(self, buffer, offset, n)

    tail, sink, data = await written_through(tmp_path, monkeypatch, recorded)
    chunks = tail.chunks(MiB)
    first, loan = await anext(chunks)
    assert bytes(first) == bytes(data[:MiB])
    await asyncio.sleep(0.1)
    assert sorted(offsets) == [i * MiB for i in range(1 + _tail._AHEAD)]
    loan.release()
    await chunks.aclose()
    assert len(_tail._FREE[MiB]) == 1 + _tail._AHEAD  # every buffer back, none lost
    # Again to the failed read: the chunks before it come first, in order.
    offsets.clear()
    got = []
    with pytest.raises(OSError, match="Input/output"):
        async for chunk, loan in tail.chunks(MiB):
            got.append(bytes(chunk))
            loan.release()
    assert got == [bytes(data[i * MiB : (i + 1) * MiB]) for i in range(9)]
    assert len(_tail._FREE[MiB]) == 1 + _tail._AHEAD  # reused, and kept again
    await sink.abort(RuntimeError("the test is over"))
    tail.close()


async def test_a_tail_cancelled_twice_still_waits_for_its_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The upload's descriptors close once it ends: the reads ahead, in their threads, must
    # end first, even when the upload is cancelled again while it stops them.
    running = [0]
    lock = threading.Lock()
    real_read = Tail._read

    def slow(self: Tail, buffer: memoryview, offset: int, n: int) -> memoryview:
        with lock:
            running[0] += 1
        try:
            time.sleep(0.2)
            return real_read(self, buffer, offset, n)
        finally:
            with lock:
                running[0] -= 1

    tail, sink, _ = await written_through(tmp_path, monkeypatch, slow)
    got = asyncio.Event()

    async def upload() -> None:
        async with contextlib.aclosing(tail.chunks(MiB)) as chunks:
            async for _, loan in chunks:
                loan.release()
                got.set()
                await asyncio.sleep(10)  # a part that takes long to leave

    task = asyncio.ensure_future(upload())
    await got.wait()
    task.cancel()
    await asyncio.sleep(0.02)  # stopping its reads now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert running[0] == 0
    assert len(_tail._FREE[MiB]) == 1 + _tail._AHEAD
    await sink.abort(RuntimeError("the test is over"))
    tail.close()


@settings(max_examples=20, deadline=None)
@given(
    size=st.integers(0, 2 * MiB),
    pieces=st.lists(st.integers(10_000, 1536 * 1024), min_size=1, max_size=6),
    chunk=st.sampled_from([64 << 10, MiB]),
)
async def test_the_tail_hands_on_exactly_the_pack_whatever_the_writes(
    size: int, pieces: list[int], chunk: int
) -> None:
    # Writes of any size (the appender holds back what is not a whole block), read ahead
    # while the upload consumes: every byte once, in order, in whole chunks but the last,
    # and the last only once the version committed.
    data = pack_bytes(size) if size else memoryview(b"")
    with tempfile.TemporaryDirectory() as tmp:
        tail, sink = await followed(Path(tmp))
        got: list[bytes] = []

        async def upload() -> None:
            async for view, loan in tail.chunks(chunk):
                got.append(bytes(view))
                loan.release()
                await asyncio.sleep(0)

        task = asyncio.ensure_future(upload())
        offset, turn = 0, 0
        while offset < size:
            step = pieces[turn % len(pieces)]
            await sink.write(data[offset : offset + step])
            offset, turn = offset + step, turn + 1
            await asyncio.sleep(0)
        await sink.commit()
        await asyncio.sleep(0.01)
        assert sum(map(len, got)) <= size - size % chunk  # the last part waits for release
        tail.release()
        await task
        tail.close()
    assert b"".join(got) == bytes(data)
    assert all(len(piece) == chunk for piece in got[:-1])
