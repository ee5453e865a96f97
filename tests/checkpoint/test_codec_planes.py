"""The byte-plane codec: what it stores, when "auto" picks it, and the format version that
keeps older readers from misreading it."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import asyncstore
from asyncstore import IntegrityError
from asyncstore.checkpoint import _format as fmt
from asyncstore.checkpoint import read_manifest
from asyncstore.checkpoint._codec import Codecs
from asyncstore.checkpoint._pickle import SavedStorage
from asyncstore.checkpoint._planes import compress_planes, decode_planes, plane_ratios
from asyncstore.testing import SeaweedFS

from ..conftest import BUCKET, s3_options, unique
from ..helpers import assert_same
from .helpers import contents, load_forged

pytestmark = pytest.mark.anyio

MiB = 1 << 20


def weights(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal weights scaled as a trained layer's are (std 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def raw_bytes(tensor: torch.Tensor) -> bytearray:
    """A copy of ``tensor``'s bytes."""
    return bytearray(tensor.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tail", [0, 1, 3])
@pytest.mark.parametrize("elements", [0, 1, 5, 40_000, 70_000])
def test_every_mask_round_trips(dtype: torch.dtype, tail: int, elements: int) -> None:
    # Any length (a tail shorter than an element included), any planes compressed; the
    # piece-wise copies cross torch's grain size (32768 elements) at 40,000 and 70,000.
    width = dtype.itemsize
    data = raw_bytes(weights((elements,), dtype)) + bytes(range(1, tail + 1))
    for mask in range(1 << width):
        stored = compress_planes(memoryview(data), width, mask, 1)
        out = bytearray(len(data))
        decode_planes(bytes(stored), width, memoryview(out))
        assert out == data, mask


def test_the_planes_are_laid_out_as_documented() -> None:
    # bf16: plane 0 (the low bytes) stored as it is, plane 1 a zstd frame after a header of
    # the mask and the frame's length.
    import zstandard

    data = raw_bytes(weights((50_000,), torch.bfloat16))
    stored = bytes(compress_planes(memoryview(data), 2, 0b10, 1))
    assert stored[0] == 0b10
    length = int.from_bytes(stored[1:9], "little")
    assert stored[9 : 9 + 50_000] == bytes(data[0::2])
    frame = stored[9 + 50_000 :]
    assert len(frame) == length
    assert zstandard.ZstdDecompressor().decompress(frame) == bytes(data[1::2])


def test_only_sign_and_exponent_planes_shrink() -> None:
    # What the codec rests on: a bf16 weight's high byte takes a few values, its low byte
    # (mantissa) is close to random; fp32's top byte shrinks, its three others do not.
    bf16 = plane_ratios(memoryview(raw_bytes(weights((65_536,), torch.bfloat16))), 2, 1)
    assert bf16[0] > 0.95
    assert bf16[1] < 0.45
    fp32 = plane_ratios(memoryview(raw_bytes(weights((32_768,), torch.float32))), 4, 1)
    assert min(fp32[:3]) > 0.95
    assert fp32[3] < 0.45


def test_a_plane_zstd_cannot_shrink_is_stored_as_it_is() -> None:
    # Random bytes in the compressed planes' place: each comes out raw, and the chunk as a
    # whole is the data plus one byte of header.
    data = bytearray(torch.randint(0, 256, (100_000,), dtype=torch.uint8).numpy().tobytes())
    stored = compress_planes(memoryview(data), 2, 0b11, 1)
    assert stored[0] == 0
    assert len(stored) == len(data) + 1


def plane_coded(tensor: torch.Tensor) -> Any:
    """A storage to forge: ``tensor``'s bytes, plane-coded."""
    from ..forge import ForgedStorage

    codec = f"zstd+planes{tensor.element_size()}"
    return ForgedStorage(
        bytes(raw_bytes(tensor)), str(tensor.dtype).removeprefix("torch."), codec=codec
    )


def storage_of(tensor: torch.Tensor, id: int = 0) -> SavedStorage:
    return SavedStorage(id, tensor.untyped_storage(), tensor.dtype, f"t{id}")


def test_auto_picks_planes_for_floats_where_the_target_is_slow() -> None:
    # A target measured at 20 MB/s (slow, so that a loaded machine's slower probe still
    # keeps up): every floating dtype of two or four bytes gets the plane codec; integers
    # keep the byte shuffle; compression="zstd" keeps it too.
    for id, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32)):
        where = f"/nowhere/{unique()}"
        Codecs("auto", 1, (), where, object_store=True).record_speed(128 * MiB, 128 * MiB / 20e6)
        codecs = Codecs("auto", 1, (), where, object_store=True)
        tensor = weights((MiB // dtype.itemsize,), dtype)
        assert codecs.codec_for(storage_of(tensor, id), memoryview(raw_bytes(tensor))) == (
            f"zstd+planes{dtype.itemsize}"
        )
        explicit = Codecs("zstd", 1, (), f"/nowhere/{unique()}", object_store=True)
        assert explicit.codec_for(storage_of(tensor, id), memoryview(raw_bytes(tensor))) == (
            f"zstd+shuffle{dtype.itemsize}"
        )
    counts = torch.randint(0, 8, (MiB // 2,), dtype=torch.int16)
    where = f"/nowhere/{unique()}"
    Codecs("auto", 1, (), where, object_store=True).record_speed(128 * MiB, 128 * MiB / 20e6)
    codecs = Codecs("auto", 1, (), where, object_store=True)
    assert codecs.codec_for(storage_of(counts), memoryview(raw_bytes(counts))) == "zstd+shuffle2"


def test_auto_keeps_floats_raw_where_the_target_outruns_the_encoders() -> None:
    # A target measured at 1 TB/s: no encoder keeps up, so compressing would slow the save.
    where = f"/nowhere/{unique()}"
    Codecs("auto", 1, (), where, object_store=False).record_speed(1 << 40, 1.0)
    codecs = Codecs("auto", 1, (), where, object_store=False)
    tensor = weights((MiB // 2,), torch.bfloat16)
    assert codecs.codec_for(storage_of(tensor), memoryview(raw_bytes(tensor))) == "raw"


def test_a_codec_too_slow_for_the_target_is_probed_once_a_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first storage's careful probe finds the plane codec slower than the target: the
    # others of the save stay raw without a probe each (a state has hundreds of them).
    from asyncstore.checkpoint import _codec

    probes: list[int] = []
    real = _codec.plane_ratios  # type: ignore[attr-defined]

    def counted(data: memoryview, width: int, level: int) -> list[float]:
        probes.append(width)
        return real(data, width, level)

    monkeypatch.setattr(_codec, "plane_ratios", counted)
    where = f"/nowhere/{unique()}"
    Codecs("auto", 1, (), where, object_store=False).record_speed(1 << 40, 1.0)
    codecs = Codecs("auto", 1, (), where, object_store=False)
    for id in range(5):
        tensor = weights((MiB // 2,), torch.bfloat16, id)
        assert codecs.codec_for(storage_of(tensor, id), memoryview(raw_bytes(tensor))) == "raw"
    assert probes == [2]
    # A target slow enough: every storage is probed (its planes may differ).
    Codecs("auto", 1, (), where, object_store=False).record_speed(128 * MiB, 128 * MiB / 20e6)
    codecs = Codecs("auto", 1, (), where, object_store=False)
    for id in range(3):
        tensor = weights((MiB // 2,), torch.bfloat16, id)
        assert codecs.codec_for(storage_of(tensor, id), memoryview(raw_bytes(tensor))) == (
            "zstd+planes2"
        )
    assert probes == [2, 2, 2, 2]


def transformer_like(layers: int = 2, width: int = 256) -> dict[str, Any]:
    state: dict[str, Any] = {"embed.weight": weights((1000, width), torch.bfloat16, 1)}
    for layer in range(layers):
        prefix = f"layers.{layer}."
        state[prefix + "attn.qkv.weight"] = weights((3 * width, width), torch.bfloat16, layer)
        state[prefix + "mlp.up.weight"] = weights((4 * width, width), torch.bfloat16, layer + 9)
        state[prefix + "norm.weight"] = (1 + weights((width,), torch.float32, layer)).to(
            torch.bfloat16
        )
    state["step"] = 7
    return state


async def test_a_bf16_state_saved_to_s3_is_plane_coded_and_loads_the_same(
    seaweedfs: SeaweedFS,
) -> None:
    state = transformer_like()
    options = s3_options(seaweedfs)
    url = f"s3://{BUCKET}/{unique()}/state.ckpt"
    result = await (
        await asyncstore.save(state, url, chunk_bytes=256 * 1024, store_options=options)
    )
    assert result.stored_bytes < 0.75 * result.raw_bytes
    async with asyncstore.open_store(url.rsplit("/", 1)[0], **options) as store:
        manifest = await read_manifest((store, "state.ckpt"))
    assert manifest is not None
    assert manifest.format == 3
    codecs = {s.name: {c.codec for c in s.chunks} for s in manifest.storages}
    assert codecs["embed.weight"] == {"zstd+planes2"}
    assert codecs["layers.0.norm.weight"] == {"raw"}  # 512 bytes: too small to compress
    assert_same(await asyncstore.load(url, store_options=options), state)
    # A damaged byte inside a plane-coded chunk is found and named.
    async with asyncstore.open_store(url.rsplit("/", 1)[0], **options) as store:
        blob = bytearray(await store.get("state.ckpt"))
        chunk = next(s for s in manifest.storages if s.name == "embed.weight").chunks[0]
        blob[chunk.offset + chunk.stored // 2] ^= 0x10
        await store.put("damaged.ckpt", bytes(blob))
        with pytest.raises(IntegrityError, match=r"embed\.weight"):
            await asyncstore.load((store, "damaged.ckpt"))


async def test_differential_saves_point_at_plane_coded_chunks(seaweedfs: SeaweedFS) -> None:
    # A later version that reuses an earlier one's plane-coded chunks names that codec too:
    # it is version 3 as well, and loads.
    options = s3_options(seaweedfs)
    url = f"s3://{BUCKET}/{unique('run')}"
    state = transformer_like()
    async with asyncstore.Checkpointer(url, chunk_bytes=256 * 1024, store_options=options) as ck:
        await (await ck.save(state, 0))
        changed = dict(state, **{"layers.1.mlp.up.weight": weights((1024, 256), torch.bfloat16, 5)})
        second = await (await ck.save(changed, 1))
        assert second.skipped_bytes > 0
        assert_same(await ck.load(1), changed)
        assert_same(await ck.load(0), state)
    versions, packs, _ = await contents(url, options)
    assert len(versions) == 2
    assert len(packs) == 2  # the second version's new chunks, and the first's it points at
    async with asyncstore.open_store(url, **options) as store:
        first = await read_manifest((store, versions[0]))
        later = await read_manifest((store, versions[1]))
    assert later.format == 3
    old = {later.packs.index(name) for name in first.packs}
    reused = [c for s in later.storages for i, c in enumerate(s.chunks) if s.packs[i] in old]
    assert reused
    assert all(c.codec in ("zstd+planes2", "raw") for c in reused)
    assert any(c.codec == "zstd+planes2" for c in reused)


async def test_plane_coded_checkpoints_are_version_3_and_others_stay_readable(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ..forge import Forged, StorageRef, forge, rebuild, write_pickle

    tensor = weights((4096,), torch.bfloat16)
    structure = write_pickle({"w": rebuild(StorageRef(0, "bfloat16"), 0, [4096], [1])})
    planes = forge(Forged(structure, [plane_coded(tensor)]))
    assert_same(await load_forged(planes), {"w": tensor})
    # Without plane-coded chunks a save stays version 1, which every release reads.
    await (await asyncstore.save({"w": tensor}, tmp_path / "plain.ckpt", compression="zstd"))
    async with asyncstore.open_store(tmp_path) as store:
        manifest = await read_manifest((store, "plain.ckpt"))
    assert manifest is not None
    assert manifest.format == 1
    assert fmt.version_for(False, {"raw", "zstd+shuffle2"}) == 1
    assert fmt.version_for(True, {"raw"}) == 2
    assert fmt.version_for(False, {"zstd+planes4"}) == 3
    # A reader of version 2 refuses a plane-coded file by its footer, asking for an upgrade.
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 2)
    with pytest.raises(IntegrityError, match=r"version 3 checkpoint.*upgrade asyncstore"):
        await load_forged(planes)
    assert_same(await asyncstore.load(tmp_path / "plain.ckpt"), {"w": tensor})


async def test_a_version_2_manifest_naming_a_plane_codec_is_refused() -> None:
    # Manifest and footer both say version 2, every checksum redone: the codec is still
    # one that version 2 does not have.
    import msgspec
    import xxhash

    from ..forge import Forged, StorageRef, forge, rebuild, write_pickle

    tensor = weights((4096,), torch.bfloat16)
    structure = write_pickle({"w": rebuild(StorageRef(0, "bfloat16"), 0, [4096], [1])})
    blob = forge(Forged(structure, [plane_coded(tensor)]))
    footer = fmt.decode_footer(blob[-fmt.FOOTER_SIZE :], "test")
    assert footer is not None
    start = footer.manifest_offset
    manifest = fmt.decode_manifest(blob[start : -fmt.FOOTER_SIZE], footer, "test")
    encoded = fmt.encode_manifest(msgspec.structs.replace(manifest, format=2))
    older = fmt.Footer(2, 0, start, len(encoded), xxhash.xxh3_64_intdigest(encoded))
    with pytest.raises(IntegrityError, match="version 2 manifest names plane codecs"):
        await load_forged(blob[:start] + encoded + fmt.encode_footer(older))


def test_the_stored_size_follows_the_planes_that_shrink() -> None:
    # bf16 weights: about two thirds of the raw size (the low plane whole, the high one at
    # about a third).
    data = raw_bytes(weights((1 << 20,), torch.bfloat16))
    stored = compress_planes(memoryview(data), 2, 0b10, 1)
    assert math.isclose(len(stored) / len(data), 0.67, abs_tol=0.05)
