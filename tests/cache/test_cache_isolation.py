"""Stores sharing one disk tier: each gets its own bytes, in one process and across several
(memory, local and S3 stores, same keys, whole and ranged reads)."""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash

import asyncstore
from asyncstore.cache import TieredCache
from asyncstore.cache._disk import DiskTier
from asyncstore.stores import drop_memory_store
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique

KiB = 1 << 10


@pytest.mark.anyio
async def test_two_memory_stores_sharing_a_directory(tmp_path: Path) -> None:
    # The reproduction: "memory://x" and "memory://y", one key, one directory.
    names = [unique("x"), unique("y")]
    try:
        for name, value in zip(names, [b"TRAIN", b"VAL"], strict=True):
            async with asyncstore.open_store(f"memory://{name}") as store:
                await store.put("k", value)
                async with TieredCache(
                    store, memory_bytes=99, disk_dir=tmp_path, disk_bytes=1 << 24
                ) as cache:
                    assert await cache.get("k") == value
                    assert await cache.get("k", 1, 3) == value[1:3]
    finally:
        for name in names:
            drop_memory_store(name)


@pytest.mark.anyio
async def test_prefixes_of_one_local_store_share_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "data"
    cache_dir = tmp_path / "cache"
    for split in ("train", "val"):
        async with asyncstore.open_store(root / split) as store:
            await store.put("0001.bin", split.encode() * 3000)  # several blocks
    for _ in range(2):  # the second round reads what the first left on disk
        for split in ("train", "val"):
            expected = split.encode() * 3000
            async with (
                asyncstore.open_store(root / split) as store,
                TieredCache(
                    store,
                    memory_bytes=1,
                    disk_dir=cache_dir,
                    disk_bytes=1 << 24,
                    block_bytes=4 * KiB,
                ) as cache,
            ):
                assert await cache.get("0001.bin") == expected
                assert await cache.get("0001.bin", 3000, 9000) == expected[3000:9000]
                assert await cache.get("0001.bin", 5000) == expected[5000:]


@pytest.mark.anyio
async def test_s3_prefixes_sharing_a_directory(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    urls = [f"s3://{BUCKET}/{unique('a')}", f"s3://{BUCKET}/{unique('b')}"]
    for round_ in range(2):
        for url in urls:
            async with (
                asyncstore.open_store(url, **s3_options(seaweedfs)) as store,
                TieredCache(
                    store,
                    memory_bytes=1,
                    disk_dir=tmp_path,
                    disk_bytes=1 << 24,
                    block_bytes=4 * KiB,
                ) as cache,
            ):
                expected = url.encode() * 400
                if round_ == 0:
                    await store.put("shard/0", expected)
                assert await cache.get("shard/0") == expected
                assert await cache.get("shard/0", 4000, 9000) == expected[4000:9000]
                if round_ == 1:
                    assert cache.stats().disk.hits >= 2  # served from the shared directory


def test_an_entry_of_another_store_at_the_same_name_is_refused(tmp_path: Path) -> None:
    # Even a record that names the wrong store while indexed under this store's name (a hash
    # collision, a copied directory) is not served: the header names its source.
    mine = DiskTier(tmp_path, 1 << 20, "memory://mine")
    other = DiskTier(tmp_path, 1 << 20, "memory://other")
    try:
        assert other.write("k", b"OTHER", None)
        with sqlite3.connect(tmp_path / "index.sqlite") as db:
            db.execute(
                "UPDATE entries SET name = ? WHERE name = ?",
                (mine.name_for("k"), other.name_for("k")),
            )
        with pytest.raises(asyncstore.IntegrityError, match="another store"):
            mine.read("k")
        assert mine.read("k") is None  # dropped
    finally:
        mine.close()
        other.close()


def _version_1_entry(key: str, payload: bytes, etag: str) -> bytes:
    # Format 1 exactly as it was written: magic, version, length, payload xxh3-64, key and
    # ETag lengths, key, ETag, payload.
    head = struct.pack(
        "<4sHQQHH",
        b"ASCE",
        1,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        len(key.encode()),
        len(etag.encode()),
    )
    return head + key.encode() + etag.encode() + payload


@pytest.mark.anyio
async def test_entries_of_the_old_format_are_refetched(tmp_path: Path) -> None:
    name = unique("old")
    try:
        async with asyncstore.open_store(f"memory://{name}") as store:
            await store.put("k", b"fresh")
            tier = DiskTier(tmp_path, 1 << 20, store.identity)
            assert tier.write("k", b"stale", None)
            found = tier.locate("k")
            tier.close()
            assert found is not None
            path, offset, size = found
            old = _version_1_entry("k", b"stale", "")
            assert len(old) <= size
            with open(path, "r+b") as f:  # a record of format 1 where the index points
                f.seek(offset)
                f.write(old)
            async with TieredCache(
                store, memory_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20
            ) as cache:
                assert await cache.get("k") == b"fresh"
                assert cache.stats().disk.corrupt == 1
                assert cache.stats().disk.hits == 0
    finally:
        drop_memory_store(name)


def test_identity_tells_stores_apart(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    memory = asyncstore.open_store("memory://same/prefix")
    local = asyncstore.open_store(tmp_path)
    s3 = asyncstore.open_store(f"s3://{BUCKET}/p", **s3_options(seaweedfs))
    other_endpoint = asyncstore.open_store(
        f"s3://{BUCKET}/p", **s3_options(seaweedfs, endpoint_url="http://127.0.0.1:1")
    )
    assert memory.identity.startswith("memory://same/prefix")
    assert local.identity == local.url
    assert s3.identity != other_endpoint.identity  # same URL, another server
    assert seaweedfs.secret_key not in s3.identity


WORKER = """
import asyncio, json, sys
import asyncstore
from asyncstore.cache import TieredCache

def value(tag, key):
    return f"{tag}|{key}|".encode() * (200 + 37 * int(key[-2:]))

async def main(spec):
    async with asyncstore.open_store(spec["url"], **spec["options"]) as store:
        keys = [f"k/{i:02d}" for i in range(12)]
        if spec["put"]:
            for key in keys:
                await store.put(key, value(spec["tag"], key))
        # Twice: closing the first cache lands its disk writes, the second reads them.
        for _ in range(2):
            async with TieredCache(
                store, memory_bytes=1, disk_dir=spec["cache"], disk_bytes=8 << 20,
                block_bytes=2048,
            ) as cache:
                for _ in range(2):
                    for key in keys:
                        expected = value(spec["tag"], key)
                        got = await cache.get(key)
                        part = await cache.get(key, 1000, 5000)
                        tail = await cache.get(key, 3000)
                        if (got, part, tail) != (
                            expected, expected[1000:5000], expected[3000:]
                        ):
                            print("WRONG", key, got[:40], flush=True)
                            sys.exit(3)
        s = cache.stats()
        print("OK", s.disk.hits, s.disk.corrupt, flush=True)

asyncio.run(main(json.loads(sys.argv[1])))
"""


def _spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_stores_with_the_same_keys_share_a_directory_across_processes(
    seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    cache = str(tmp_path / "cache")
    s3 = s3_options(seaweedfs)
    same_memory = unique("same")
    stores: list[dict[str, Any]] = [
        # Two processes with a memory store of the same name: different objects.
        {"url": f"memory://{same_memory}", "options": {}, "tag": "mem-1"},
        {"url": f"memory://{same_memory}", "options": {}, "tag": "mem-2"},
        {"url": f"memory://{unique('y')}", "options": {}, "tag": "mem-y"},
        {"url": str(tmp_path / "a"), "options": {}, "tag": "local-a"},
        {"url": str(tmp_path / "b"), "options": {}, "tag": "local-b"},
        {"url": f"s3://{BUCKET}/{unique('p')}", "options": s3, "tag": "s3-p"},
        {"url": f"s3://{BUCKET}/{unique('q')}", "options": s3, "tag": "s3-q"},
    ]
    # Two waves: the second reads what the first left in the shared directory.
    for wave in range(2):
        procs = [
            _spawn({**spec, "cache": cache, "put": wave == 0 or spec["url"].startswith("memory")})
            for spec in stores
        ]
        for spec, proc in zip(stores, procs, strict=True):
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, (spec["tag"], out, err)
            status, hits, corrupt = out.split()
            assert status == "OK"
            assert corrupt == "0"
            assert int(hits) > 0  # each process did read from the shared directory


def test_a_directory_of_the_per_file_layout_is_emptied_and_refills(tmp_path: Path) -> None:
    # Format 2 kept one file per entry ("ab/<name>.entry"), temp files in "tmp/" and an index
    # with one row per file: none of it may be read as, or counted beside, the new layout.
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.executescript(
            """
            CREATE TABLE entries (name TEXT PRIMARY KEY, size INTEGER NOT NULL,
                atime REAL NOT NULL);
            CREATE TABLE total (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER NOT NULL);
            INSERT INTO entries VALUES ('ab12', 100000, 0);
            INSERT INTO total VALUES (0, 100000);
            """
        )
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "ab12.entry").write_bytes(b"x" * 100_000)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "123-deadbeef0").write_bytes(b"partial")
    tier = DiskTier(tmp_path, 1 << 20, "memory://source")
    try:
        assert not (tmp_path / "ab").exists()
        assert not (tmp_path / "tmp").exists()
        assert tier.entry_count() == 0
        assert tier.used_bytes() == tier._db_bytes()
        assert tier.write("k", b"new", None)
        assert tier.read("k") == (b"new", None)
    finally:
        tier.close()
    again = DiskTier(tmp_path, 1 << 20, "memory://source")  # the new layout is kept
    try:
        assert again.read("k") == (b"new", None)
    finally:
        again.close()
