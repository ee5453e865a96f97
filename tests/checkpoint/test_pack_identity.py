"""A differential save points only into packs that are what their version recorded: a pack
that is missing, truncated, replaced or of an earlier release has its chunks written again,
and the version committed on top of it loads."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xxhash

import asyncstore
from asyncstore import IntegrityError
from asyncstore.checkpoint import Checkpointer, read_manifest
from asyncstore.checkpoint import _format as fmt
from asyncstore.checkpoint._packfile import TRAILER_SIZE, PackId, encode_end, read_id, whole

from ..helpers import assert_same
from .helpers import CHUNK, TENSORS, base_state, changed, rewrite_manifest_file

pytestmark = pytest.mark.anyio


def _truncate(data: bytes) -> bytes | None:
    return data[: len(data) // 2]


def _missing(data: bytes) -> bytes | None:
    return None


def _index_flipped(data: bytes) -> bytes | None:
    # Same size, trailer intact: only the index's checksum tells.
    out = bytearray(data)
    out[-TRAILER_SIZE - 3] ^= 0x40
    return bytes(out)


def _other_pack_same_size(data: bytes) -> bytes:
    # A valid pack of the same size, with a trailer and index that agree, but not the one
    # recorded: its first chunk's bytes changed, and the index made to match them.
    trailer = data[-TRAILER_SIZE:]
    offset = int.from_bytes(trailer[16:24], "little")
    rows = msgspec.msgpack.decode(data[offset:-TRAILER_SIZE])
    first_offset, stored, _ = rows[0]
    body = bytearray(data[:offset])
    body[first_offset] ^= 1
    rows[0][2] = xxhash.xxh3_64_intdigest(bytes(body[first_offset : first_offset + stored]))
    chunks = [fmt.Chunk(o, n, n, "raw", digest, 0) for o, n, digest in rows]
    end, _ = encode_end(chunks, offset)
    return bytes(body) + end


@pytest.mark.parametrize(
    "damage",
    [_truncate, _missing, _index_flipped],
    ids=["truncated", "missing", "index-flipped"],
)
async def test_a_damaged_base_pack_is_not_built_on(
    run_url: tuple[str, dict[str, Any] | None],
    damage: Callable[[bytes], bytes | None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, options = run_url
    async with Checkpointer(url, chunk_bytes=CHUNK, keep_last=5, store_options=options) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        async with asyncstore.open_store(url, **(options or {})) as store:
            (pack,) = (await read_manifest((store, "step-000000001.ckpt"))).packs
            damaged = damage(await store.get(pack))
            if damaged is None:
                await store.delete(pack)
            else:
                await store.put(pack, damaged)
        newer = changed(state, 0.1, 2)
        with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
            result = await (await ckpt.save(newer, 2))
        # Nothing of the damaged pack is pointed at: every chunk is written again.
        assert result.skipped_bytes == 0
        assert any(pack in r.getMessage() for r in caplog.records)
        assert_same(await ckpt.load(2), newer)
        assert (await ckpt.verify(2)).ok
        async with asyncstore.open_store(url, **(options or {})) as store:
            manifest = await read_manifest((store, "step-000000002.ckpt"))
            assert pack not in manifest.packs
            (own,) = manifest.packs
            assert manifest.pack_ids == [tuple(await read_id(store, own))]


async def test_a_whole_base_pack_is_built_on_and_its_identity_recorded(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        newer = changed(state, 0.1, 2)
        result = await (await ckpt.save(newer, 2))
        assert result.skipped_bytes == (TENSORS - 2) * CHUNK
        first = await read_manifest(tmp_path / "step-000000001.ckpt")
        second = await read_manifest(tmp_path / "step-000000002.ckpt")
        by_name = dict(zip(second.packs, second.pack_ids, strict=True))
        assert by_name[first.packs[0]] == first.pack_ids[0]
        async with asyncstore.open_store(tmp_path) as store:
            for name, recorded in zip(second.packs, second.pack_ids, strict=True):
                assert await whole(store, name, PackId(*recorded)) is None


async def test_a_same_size_replacement_pack_is_not_built_on(tmp_path: Path) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        (pack,) = (await read_manifest(tmp_path / "step-000000001.ckpt")).packs
        path = tmp_path / pack
        original = path.read_bytes()
        replacement = _other_pack_same_size(original)
        assert len(replacement) == len(original)
        path.write_bytes(replacement)
        async with asyncstore.open_store(tmp_path) as store:
            found = await read_id(store, pack)  # a whole pack in itself...
            recorded = PackId(*(await read_manifest(tmp_path / "step-000000001.ckpt")).pack_ids[0])
            assert found.size == recorded.size
            assert found != recorded  # ...but another one
        result = await (await ckpt.save(state, 2))
        assert result.skipped_bytes == 0
        assert_same(await ckpt.load(2), state)


async def test_a_pack_without_a_recorded_identity_is_read_but_not_built_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What an earlier release wrote: no pack_ids in the manifest. It still loads; the next
    # save writes its chunks again, quietly (nothing is wrong with it).
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=5) as ckpt:
        state = base_state()
        await (await ckpt.save(state, 1))
        path = tmp_path / "step-000000001.ckpt"
        rewrite_manifest_file(path, lambda m: msgspec.structs.replace(m, pack_ids=[]))
        assert_same(await asyncstore.load(path), state)
        with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
            result = await (await ckpt.save(state, 2))
        assert result.skipped_bytes == 0
        assert not [r for r in caplog.records if "not building" in r.getMessage()]
        assert_same(await ckpt.load(2), state)


@pytest.mark.parametrize(
    "pack_ids",
    [[(1, 2), (3, 4)], [(-1, 5)]],
    ids=["more-than-packs", "negative"],
)
async def test_crafted_pack_identities_are_refused(
    tmp_path: Path, pack_ids: list[tuple[int, int]]
) -> None:
    async with Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        await (await ckpt.save(base_state(), 1))
    path = tmp_path / "step-000000001.ckpt"
    rewrite_manifest_file(path, lambda m: msgspec.structs.replace(m, pack_ids=pack_ids))
    with pytest.raises(IntegrityError, match="identities impossibly"):
        await asyncstore.load(path)


async def test_a_pack_trailer_is_checked_before_it_is_believed(tmp_path: Path) -> None:
    chunk = fmt.Chunk(8, 16, 16, "raw", 7, 7)
    end, pack_id = encode_end([chunk], 24)
    data = fmt.PACK_MAGIC + bytes(16) + end
    assert pack_id == PackId(len(data), pack_id.index_xxh3)
    async with asyncstore.open_store(tmp_path) as store:
        await store.put("p.pack", data)
        assert await read_id(store, "p.pack") == pack_id
        for bad in (
            data[:-1],  # truncated
            data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],  # the trailer's own checksum
            data[:-TRAILER_SIZE] + b"NOTAPACK" + data[-TRAILER_SIZE + 8 :],
            fmt.PACK_MAGIC + b"x",  # too short to hold a trailer
        ):
            await store.put("p.pack", bad)
            with pytest.raises(IntegrityError):
                await read_id(store, "p.pack")
            assert await whole(store, "p.pack", pack_id) is not None
        await store.delete("p.pack")
        assert await whole(store, "p.pack", pack_id) == "missing"
