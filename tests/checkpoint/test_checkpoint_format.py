"""The checkpoint format and its verification: every damaged byte is found, forged manifests
and pickles are refused, and the structure and the byte shuffle are what the format says."""

from __future__ import annotations

import io
import os
import pickle
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import IntegrityError, UnsafeCheckpoint
from asyncstore.checkpoint import read_manifest

from ..conftest import unique
from .helpers import assert_same_storage_layout, rewrite_manifest

pytestmark = pytest.mark.anyio


async def test_every_byte_flip_and_truncation_is_detected() -> None:
    state = {
        "w": torch.arange(64, dtype=torch.float32),
        "b": torch.ones(8, dtype=torch.bfloat16),
        "step": 3,
    }
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await (await asyncstore.save(state, (store, "good"), compression=None))
        data = await store.get("good")
        assert len(data) < 4096
        for position in range(len(data)):
            damaged = bytearray(data)
            damaged[position] ^= 0x01
            await store.put("bad", bytes(damaged))
            with pytest.raises(IntegrityError):
                await asyncstore.load((store, "bad"))
        for length in range(0, len(data), 7):
            await store.put("short", data[:length])
            with pytest.raises(IntegrityError):
                await asyncstore.load((store, "short"))


async def test_damaged_chunk_names_tensor_chunk_and_url(tmp_path: Path) -> None:
    state = {"model": {"layer.weight": torch.randn(4096)}}
    path = tmp_path / "d.ckpt"
    await (await asyncstore.save(state, path, compression=None, chunk_bytes=4096))
    data = bytearray(path.read_bytes())
    async with asyncstore.open_store(tmp_path) as store:
        manifest = await read_manifest((store, "d.ckpt"))
    assert manifest is not None
    chunk = manifest.storages[0].chunks[2]
    data[chunk.offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        IntegrityError,
        match=r"d\.ckpt: chunk 2 of tensor 'model\.layer\.weight'",
    ):
        await asyncstore.load(path)


async def test_forged_manifests_are_integrity_errors() -> None:
    # Checksums over a manifest can be recomputed by whoever forges one: the loader checks
    # that it describes the object consistently before allocating or reading anything.
    import msgspec

    replace = msgspec.structs.replace

    def storage(**changes: Any) -> Any:
        return lambda m: replace(m, storages=[replace(m.storages[0], **changes)])

    def chunk(**changes: Any) -> Any:
        def edit(m: Any) -> Any:
            first = m.storages[0]
            chunks = [replace(first.chunks[0], **changes)]
            return replace(m, storages=[replace(first, chunks=chunks)])

        return edit

    edits = [
        storage(nbytes=-8),
        storage(nbytes=12),
        storage(location="no-such-device"),
        chunk(offset=-100),
        chunk(offset=10**12),
        chunk(raw=-16),
        chunk(codec="lz4"),
        lambda m: replace(m, structure=replace(m.structure, raw=-1)),
        lambda m: replace(m, entries={"a": [99]}),
    ]
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await (await asyncstore.save({"a": torch.arange(4.0)}, (store, "good"), compression=None))
        good = await store.get("good")
        for edit in edits:
            await store.put("forged", rewrite_manifest(good, edit))
            with pytest.raises(IntegrityError):
                await asyncstore.load((store, "forged"))


async def test_a_manifest_asking_for_more_memory_than_there_is_is_refused() -> None:
    # A zstd chunk may claim any raw size up to what zstd can expand its stored bytes to:
    # the load refuses before allocating, rather than being killed by the OOM killer (or
    # allocating terabytes of swap).
    from asyncstore.checkpoint._format import ZSTD_MAX_RATIO
    from asyncstore.checkpoint._reader import available_memory

    from ..forge import Forged, ForgedStorage, StorageRef, forge, rebuild, write_pickle

    available = available_memory()
    assert available is not None  # Linux: /proc/meminfo
    huge = available + (1 << 30)
    stored = os.urandom(huge // ZSTD_MAX_RATIO + 4096)  # incompressible: stored as big
    structure = write_pickle({"a": rebuild(StorageRef(0), 0, [huge], [1])})
    blob = forge(
        Forged(structure, [ForgedStorage(stored, codec="zstd", raw=huge)], entries={"a": [0]})
    )
    async with asyncstore.open_store(f"memory://{unique()}") as store:
        await store.put("forged", blob)
        with pytest.raises(UnsafeCheckpoint, match=r"needs [\d,.]+ GiB .* keys="):
            await asyncstore.load((store, "forged"))


class Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


async def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    await (await asyncstore.save({"w": torch.ones(2), "x": Exploit(str(marker))}, path))
    with pytest.raises(UnsafeCheckpoint, match=r"(posix|os)\.system"):
        await asyncstore.load(path)
    assert not marker.exists()
    # The same payload in a torch.save file is refused too (torch's own weights_only).
    torch.save({"x": Exploit(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpoint):
        await asyncstore.load(tmp_path / "evil.pt")
    assert not marker.exists()
    # Trusted: weights_only=False runs it, as torch.load would.
    await asyncstore.load(path, weights_only=False)
    assert marker.exists()


async def test_safe_globals_allow_a_named_class(tmp_path: Path) -> None:
    path = tmp_path / "od.ckpt"
    state = {"opt": OrderedDict(a=torch.ones(1)), "frac": complex(1, 2), "big": 10**30}
    await (await asyncstore.save(state, path))
    assert_same_storage_layout(state, await asyncstore.load(path))


class HookedParameter:
    """Pickles as a parameter carrying a backward hook, as a crafted file could."""

    def __reduce__(self) -> tuple[Any, ...]:
        hooks = OrderedDict({0: bytearray})
        return (torch._utils._rebuild_parameter, (torch.ones(1), True, hooks))


async def test_backward_hooks_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "hooked.ckpt"
    await (await asyncstore.save({"p": HookedParameter()}, path))
    with pytest.raises(UnsafeCheckpoint, match="backward hooks"):
        await asyncstore.load(path)


def test_pickle_protocol_of_structure_is_plain_pickle(tmp_path: Path) -> None:
    # The structure stays readable with the standard library, given the storages.
    from asyncstore.checkpoint._pickle import pickle_structure

    data, storages, entries = pickle_structure({"a": torch.ones(2), "b": 1})
    assert entries == {"a": [0], "b": []}
    assert len(storages) == 1
    seen = []

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            seen.append(pid)
            return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                wrap_storage=storages[0].storage, dtype=torch.float32, _internal=True
            )

    assert torch.equal(Reader(io.BytesIO(data)).load()["a"], torch.ones(2))
    assert seen == [("storage", 0, "float32")]


@pytest.mark.parametrize("width", [2, 4, 8])
def test_byte_shuffle_matches_its_definition(width: int) -> None:
    from asyncstore.checkpoint import _format as fmt

    rng = random.Random(width)
    for size in (0, 1, width - 1, width, width + 1, 1000, 4099, 65_536 + 3):
        data = rng.randbytes(size)
        shuffled = fmt.shuffle(memoryview(bytearray(data)), width)
        whole = size - size % width
        # Byte k of every element, for k = 0 .. width-1; then the tail as it was.
        assert (
            bytes(shuffled)
            == b"".join(data[:whole][k::width] for k in range(width)) + (data[whole:])
        )
        restored = bytearray(size)
        fmt.unshuffle(shuffled, width, memoryview(restored))
        assert bytes(restored) == data
