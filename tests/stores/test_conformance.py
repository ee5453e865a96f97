"""One contract, every store: the same tests run against memory, local disk and SeaweedFS."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncstore
from asyncstore import InvalidArgument, InvalidKey, NotFound, StoreClosed

from ..conftest import MiB

pytestmark = pytest.mark.anyio

# Around S3's 5 MiB minimum part, which the S3 store is opened with in these tests.
SIZES = [0, 1, 1000, 5 * MiB - 1, 5 * MiB, 5 * MiB + 1, 12 * MiB + 7]


@pytest.mark.parametrize("size", SIZES)
async def test_round_trip(store: asyncstore.Store, size: int) -> None:
    data = os.urandom(size)
    info = await store.put("dir/obj.bin", data)
    assert info.key == "dir/obj.bin"
    assert info.size == size
    assert await store.get("dir/obj.bin") == data
    stat = await store.stat("dir/obj.bin")
    assert stat.size == size
    assert stat.key == "dir/obj.bin"
    assert stat.etag
    assert stat.mtime is not None


@pytest.mark.parametrize(
    "key",
    [
        "with space/and+plus",
        "percent%20literal",
        "ünïcödé/数据.bin",
        "q?uery#frag&amp=1",
        "tilde~star*(paren)",
        "semi;colon,comma'quote\"",
        "a/b/c/d/e/f/g/h",
    ],
)
async def test_special_characters_in_keys(store: asyncstore.Store, key: str) -> None:
    data = key.encode() * 3
    await store.put(key, data)
    assert await store.get(key) == data
    assert await store.get(key, 1, 5) == data[1:5]
    assert (await store.stat(key)).size == len(data)
    assert [i.key async for i in store.list()] == [key]
    async with store.open_reader(key) as reader:
        assert b"".join([c async for c in reader]) == data
    await store.delete(key)
    assert [i.key async for i in store.list()] == []


async def test_put_accepts_any_buffer(store: asyncstore.Store) -> None:
    data = os.urandom(3000)
    await store.put("a", bytearray(data))
    await store.put("b", memoryview(data)[100:200])
    assert await store.get("a") == data
    assert await store.get("b") == data[100:200]


async def test_put_rejects_non_bytes(store: asyncstore.Store) -> None:
    with pytest.raises(InvalidArgument, match="encode it first"):
        await store.put("a", "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="int"):
        await store.put("a", 42)  # type: ignore[arg-type]


async def test_overwrite_replaces_and_changes_etag(store: asyncstore.Store) -> None:
    first = await store.put("k", b"first version")
    second = await store.put("k", b"second, longer version")
    assert await store.get("k") == b"second, longer version"
    assert (await store.stat("k")).size == len(b"second, longer version")
    assert first.etag != second.etag


async def test_missing_key(store: asyncstore.Store) -> None:
    with pytest.raises(NotFound, match="missing/key") as caught:
        await store.get("missing/key")
    assert isinstance(caught.value, FileNotFoundError)
    with pytest.raises(NotFound):
        await store.stat("missing/key")
    with pytest.raises(NotFound):
        await store.get("missing/key", 0, 0)
    with pytest.raises(NotFound):
        async with store.open_reader("missing/key"):
            pass


async def test_delete(store: asyncstore.Store) -> None:
    await store.put("x/y/z", b"1")
    await store.put("x/keep", b"2")
    await store.delete("x/y/z")
    with pytest.raises(NotFound):
        await store.get("x/y/z")
    await store.delete("x/y/z")  # deleting a missing key is not an error
    assert [i.key async for i in store.list()] == ["x/keep"]


async def test_list_order_and_prefixes(store: asyncstore.Store) -> None:
    keys = ["a/b", "a0", "a/c/d", "a/c0", "b", "ab/c", "a/b0", "a/bb/x"]
    for key in keys:
        await store.put(key, key.encode())
    listed = [info async for info in store.list()]
    assert [i.key for i in listed] == sorted(keys)
    assert {i.key: i.size for i in listed} == {k: len(k) for k in keys}
    assert [i.key async for i in store.list("a/")] == ["a/b", "a/b0", "a/bb/x", "a/c/d", "a/c0"]
    assert [i.key async for i in store.list("a/c")] == ["a/c/d", "a/c0"]
    assert [i.key async for i in store.list("a")] == sorted(k for k in keys if k.startswith("a"))
    assert [i.key async for i in store.list("zzz")] == []


async def test_list_order_below_slash(store: asyncstore.Store, store_kind: str) -> None:
    # '-' and '.' sort before '/': "a-b" < "a/b". A directory walk that sorts plain names puts
    # the "a/" subtree first. Local and memory stores guarantee byte order; S3 stores return
    # the server's order, and SeaweedFS (unlike AWS S3) walks its directories that way.
    keys = ["a/b", "a-b", "a.c", "a0"]
    for key in keys:
        await store.put(key, b"")
    listed = [i.key async for i in store.list()]
    if store_kind == "s3":
        assert sorted(listed) == sorted(keys)
    else:
        assert listed == sorted(keys)


async def test_list_resumes_after_a_key(store: asyncstore.Store, store_kind: str) -> None:
    keys = ["a/b", "a/bb/x", "a/c/d", "a/c0", "a-b", "a.c", "a0", "b", "c/d/e"]
    for key in keys:
        await store.put(key, b"")

    async def listed(prefix: str = "", start_after: str = "") -> list[str]:
        return [i.key async for i in store.list(prefix, start_after=start_after)]

    full = await listed()
    # Resuming after any key the listing yielded gives the rest of it, in every store (S3
    # servers that walk directories, such as SeaweedFS, list "a/" before "a-b": see above).
    for index, key in enumerate(full):
        assert await listed(start_after=key) == full[index + 1 :], key
    assert await listed("a/", start_after="a/bb/x") == ["a/c/d", "a/c0"]
    assert await listed("c/", start_after="a0") == ["c/d/e"]  # before the prefix: all of it
    if store_kind != "s3":
        # Local and memory stores take any string, in byte order (as AWS S3 does; SeaweedFS
        # reads one naming a directory, such as "a", as that directory).
        for after in ["a", "a/", "a/ba", "a/bb", "a/c", "a/c/", "b0", "z"]:
            assert await listed(start_after=after) == [k for k in full if k > after], after
    with pytest.raises(InvalidArgument, match="start_after"):
        store.list(start_after=7)  # type: ignore[arg-type]


async def test_list_paginates(store: asyncstore.Store) -> None:
    count = 1234  # more than one S3 page of 1000
    limit = anyio.Semaphore(32)

    async def put(i: int) -> None:
        async with limit:
            await store.put(f"many/{i:05d}", b"")

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(put, i)
    keys = [info.key async for info in store.list("many/")]
    assert keys == [f"many/{i:05d}" for i in range(count)]
    # Resumed inside the first page: the rest, across the page boundary, once each.
    rest = [info.key async for info in store.list("many/", start_after="many/00500")]
    assert rest == [f"many/{i:05d}" for i in range(501, count)]


async def test_keys_are_relative_to_the_root(open_kind: Any) -> None:
    async with open_kind() as outer, open_kind(outer.url + "/inner") as inner:
        await inner.put("k", b"inner")
        await outer.put("k", b"outer")
        assert await inner.get("k") == b"inner"
        assert [i.key async for i in outer.list()] == ["inner/k", "k"]
        assert [i.key async for i in inner.list()] == ["k"]
        assert await outer.get("inner/k") == b"inner"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(start=st.none() | st.integers(0, 3000), end=st.none() | st.integers(0, 3000))
async def test_ranges_match_slicing(
    store: asyncstore.Store, start: int | None, end: int | None
) -> None:
    data = bytes(range(256)) * 10  # 2560 bytes; ranges run past the end too
    await store.put("ranged", data)
    if start is not None and end is not None and end < start:
        with pytest.raises(InvalidArgument, match="before start"):
            await store.get("ranged", start, end)
        return
    assert await store.get("ranged", start, end) == data[start:end]


async def test_large_ranges_cross_parts(store: asyncstore.Store) -> None:
    data = os.urandom(17 * MiB + 3)
    await store.put("large", data)
    for start, end in [
        (0, None),
        (MiB, 16 * MiB + 5),
        (5 * MiB - 1, 5 * MiB + 1),
        (11 * MiB, None),
        (0, 17 * MiB + 3),
        (17 * MiB, 18 * MiB),
    ]:
        assert await store.get("large", start, end) == data[start:end], (start, end)


@pytest.mark.parametrize(("start", "end"), [(-1, None), (None, -5), (1.5, None), (True, None)])
async def test_bad_ranges(store: asyncstore.Store, start: Any, end: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"start|end"):
        await store.get("k", start, end)


BAD_KEYS = [
    "",
    "/abs",
    "a//b",
    "a/",
    "../x",
    "a/../b",
    "a/./b",
    ".",
    "nul\x00",
    "k" * 1025,
    "k" * 256,
    "d/" + "é" * 128,  # 256 bytes in UTF-8
    ".asyncstore-tmp-x",
    "d/.asyncstore",
    "\udc80",
]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_invalid_keys(store: asyncstore.Store, key: str) -> None:
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: store.get(key),
        lambda: store.put(key, b"x"),
        lambda: store.stat(key),
        lambda: store.delete(key),
    ]
    for call in calls:
        with pytest.raises(InvalidKey) as caught:
            await call()
        assert isinstance(caught.value, ValueError)
        assert store.url in str(caught.value)
    with pytest.raises(InvalidKey):
        store.open_writer(key)
    with pytest.raises(InvalidKey):
        store.open_reader(key)


async def test_non_str_key(store: asyncstore.Store) -> None:
    with pytest.raises(InvalidKey, match="bytes, not a str"):
        await store.get(b"k")  # type: ignore[arg-type]


# The longest file name local disks take (NAME_MAX), in ASCII and in 2-byte UTF-8.
LONGEST_SEGMENTS = ["s" * 255, "é" * 127 + "s"]


@pytest.mark.parametrize("segment", LONGEST_SEGMENTS)
async def test_longest_segment_works_on_every_store(store: asyncstore.Store, segment: str) -> None:
    # A key one store takes, every store takes: the local store's temporary file beside a
    # 255-byte name must fit in a file name too.
    key = f"d/{segment}/{segment}"
    await store.put(key, b"v")
    async with store.open_writer(segment) as writer:
        await writer.write(b"w")
    assert await store.get(key) == b"v"
    assert await store.get(segment, 0, 1) == b"w"
    assert (await store.stat(key)).size == 1
    assert [i.key async for i in store.list()] == sorted([key, segment])
    assert [i.key async for i in store.list(f"d/{segment}/")] == [key]


async def test_a_segment_over_255_bytes_is_refused_on_every_store(store: asyncstore.Store) -> None:
    segment = "s" * 256
    with pytest.raises(
        InvalidKey, match=r"segment 's{50}.* is 256 bytes in UTF-8, over the limit of 255"
    ):
        await store.put(f"d/{segment}", b"v")
    with pytest.raises(InvalidKey, match="256 bytes"):
        store.list(f"d/{segment}")
    assert [i.key async for i in store.list()] == []


@pytest.mark.parametrize("prefix", ["/a", "a//b", "../", "a/../"])
async def test_invalid_prefixes(store: asyncstore.Store, prefix: str) -> None:
    with pytest.raises(InvalidKey):
        store.list(prefix)


async def test_streaming_writer(store: asyncstore.Store) -> None:
    pieces = [os.urandom(n) for n in (0, 1, 3 * MiB, 4 * MiB + 5, 100, 2 * MiB)]
    async with store.open_writer("stream/obj") as writer:
        for index, piece in enumerate(pieces):
            buffer = bytearray(piece) if index % 2 else memoryview(piece)
            await writer.write(buffer)
            if isinstance(buffer, bytearray):
                buffer[:] = b"\xff" * len(buffer)  # the writer must not keep the caller's buffer
        assert writer.bytes_written == sum(map(len, pieces))
        with pytest.raises(NotFound):
            await store.get("stream/obj")  # nothing visible before the commit
    assert writer.info is not None
    assert writer.info.size == sum(map(len, pieces))
    assert await store.get("stream/obj") == b"".join(pieces)


async def test_empty_writer_creates_empty_object(store: asyncstore.Store) -> None:
    async with store.open_writer("empty"):
        pass
    assert await store.get("empty") == b""


@pytest.mark.parametrize("size", [100, 7 * MiB])
async def test_writer_aborts_on_error(store: asyncstore.Store, size: int) -> None:
    await store.put("keep", b"old value")
    with pytest.raises(RuntimeError, match="mid-stream"):
        async with store.open_writer("keep") as writer:
            await writer.write(os.urandom(size))
            raise RuntimeError("failure mid-stream")
    assert await store.get("keep") == b"old value"
    with pytest.raises(StoreClosed):
        await writer.write(b"more")
    assert [i.key async for i in store.list()] == ["keep"]


async def test_writer_aborts_on_cancel(store: asyncstore.Store) -> None:
    started = anyio.Event()

    async def slow_writer() -> None:
        async with store.open_writer("cancelled") as writer:
            await writer.write(os.urandom(6 * MiB))
            started.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_writer)
        await started.wait()
        tg.cancel_scope.cancel()
    with pytest.raises(NotFound):
        await store.stat("cancelled")
    assert [i.key async for i in store.list()] == []


async def test_writer_used_outside_block(store: asyncstore.Store) -> None:
    writer = store.open_writer("k")
    with pytest.raises(StoreClosed, match="inside its 'async with'"):
        await writer.write(b"x")


@pytest.mark.parametrize("size", [0, 10, 3 * MiB + 1])
async def test_streaming_reader(store: asyncstore.Store, size: int) -> None:
    data = os.urandom(size)
    await store.put("r", data)
    async with store.open_reader("r", chunk_bytes=MiB) as reader:
        assert reader.info is not None
        assert reader.info.size == size
        chunks = [chunk async for chunk in reader]
    assert b"".join(chunks) == data
    assert all(len(c) == MiB for c in chunks[:-1])
    assert len(chunks) == (size + MiB - 1) // MiB


async def test_reader_without_context_manager(store: asyncstore.Store) -> None:
    await store.put("r", b"abc" * 1000)
    data = b"abc" * 1000
    chunks = [chunk async for chunk in store.open_reader("r", chunk_bytes=1000)]
    assert chunks == [data[:1000], data[1000:2000], data[2000:]]


async def test_reader_early_exit_closes(store: asyncstore.Store) -> None:
    await store.put("r", os.urandom(4 * MiB))
    async with store.open_reader("r", chunk_bytes=MiB) as reader:
        async for _chunk in reader:
            break
    with pytest.raises(StoreClosed):
        await reader.__anext__()


async def test_reader_bad_chunk_size(store: asyncstore.Store) -> None:
    with pytest.raises(InvalidArgument, match="chunk_bytes=0"):
        store.open_reader("r", chunk_bytes=0)


async def test_closed_store(open_kind: Any) -> None:
    store = open_kind()
    async with store:
        await store.put("k", b"v")
    with pytest.raises(StoreClosed, match="closed"):
        await store.get("k")
    with pytest.raises(StoreClosed):
        store.list()
    await store.aclose()  # closing twice is harmless


async def test_concurrent_overwrites_are_atomic(store: asyncstore.Store) -> None:
    # Readers racing writers see one whole version or another, never a mix.
    versions = [bytes([i]) * (256 * 1024) for i in range(4)]
    await store.put("hot", versions[0])
    seen: set[bytes] = set()

    async def write() -> None:
        for round_ in range(8):
            await store.put("hot", versions[round_ % 4])

    async def read() -> None:
        for _ in range(16):
            data = await store.get("hot")
            assert data in versions
            seen.add(data[:1])

    async with anyio.create_task_group() as tg:
        tg.start_soon(write)
        tg.start_soon(read)
        tg.start_soon(read)
    assert seen
