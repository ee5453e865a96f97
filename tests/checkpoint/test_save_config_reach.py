"""Every save option reaches the engine from every save entry point, seen by its effect on
what is stored: ``level=19`` stores less than ``level=1``, ``chunk_bytes`` sets the chunk
count, ``exclude`` leaves its entry raw, ``metadata`` is in the manifest, and
``compression=None`` stores every chunk raw."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_saver

import asyncstore
import asyncstore.torch
from asyncstore.checkpoint import CheckpointInfo, inspect
from asyncstore.torch.dcp import StorageWriter

from ..ranks import spawn_ranks, wait_ranks

CHUNK = 65536
TUNED: dict[str, Any] = {
    "compression": "zstd",
    "level": 19,
    "chunk_bytes": CHUNK,
    "exclude": ["skip"],
    "metadata": {"tag": "reach"},
}
PLAIN: dict[str, Any] = {"compression": "zstd", "level": 1, "chunk_bytes": CHUNK}
RAW: dict[str, Any] = {"compression": None, "chunk_bytes": CHUNK}


def text_like() -> torch.Tensor:
    # Words of a small vocabulary: zstd's higher levels find clearly more to share.
    rng = random.Random(0)
    vocab = [bytes(rng.randrange(97, 123) for _ in range(rng.randrange(2, 9))) for _ in range(2000)]
    data = b" ".join(rng.choice(vocab) for _ in range(1 << 17))[: 1 << 19]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def state() -> dict[str, torch.Tensor]:
    data = text_like()
    return {"a": data, "skip": data.clone()}


def info(path: Path) -> CheckpointInfo:
    return asyncio.run(inspect(str(path)))


def check(saved: Callable[[dict[str, Any]], list[CheckpointInfo]], *, entries: bool) -> None:
    """``saved(options)`` saves :func:`state` with ``options`` and returns what it wrote;
    ``entries``: its entries keep their names (``exclude`` matches ``"skip"``)."""
    tuned, plain, raw = saved(TUNED), saved(PLAIN), saved(RAW)

    def sizes(found: list[CheckpointInfo], name: str | None = None) -> int:
        return sum(t.stored_bytes for i in found for t in i.tensors if name in (None, t.name))

    if entries:
        assert sizes(tuned, "a") < 0.95 * sizes(plain, "a")  # level
        assert {t.name: t.codec for i in tuned for t in i.tensors}["skip"] == "raw"  # exclude
        assert {t.name: t.codec for i in plain for t in i.tensors}["skip"] != "raw"
    else:
        assert sizes(tuned) < 0.95 * sizes(plain)
    total = sum(t.nbytes for i in tuned for t in i.tensors)
    assert sum(t.chunks for i in tuned for t in i.tensors) == total // CHUNK  # chunk_bytes
    assert all(i.metadata.get("tag") == "reach" for i in tuned)  # metadata
    assert all(t.codec == "raw" for i in raw for t in i.tensors)  # compression=None


def counter() -> Callable[[], int]:
    count = iter(range(1_000_000))
    return lambda: next(count)


def test_asyncstore_save(tmp_path: Path) -> None:
    n = counter()

    def saved(options: dict[str, Any]) -> list[CheckpointInfo]:
        path = tmp_path / f"{n()}.ckpt"

        async def go() -> None:
            await (await asyncstore.save(state(), str(path), **options))

        asyncio.run(go())
        return [info(path)]

    check(saved, entries=True)


@pytest.mark.parametrize("func", ["save", "save_async"])
def test_torch_save_and_save_async(tmp_path: Path, func: str) -> None:
    n = counter()

    def saved(options: dict[str, Any]) -> list[CheckpointInfo]:
        path = tmp_path / f"{n()}.ckpt"
        if func == "save":
            asyncstore.torch.save(state(), path, **options)
        else:
            asyncstore.torch.save_async(state(), path, **options).result()
        return [info(path)]

    check(saved, entries=True)


def _checkpointer_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    # The run's options, and the metadata a save of it passes.
    run = {k: v for k, v in options.items() if k != "metadata"}
    return run, options.get("metadata", {})


@pytest.mark.parametrize("differential", [True, False])
def test_async_checkpointer_save(tmp_path: Path, differential: bool) -> None:
    n = counter()

    def saved(options: dict[str, Any]) -> list[CheckpointInfo]:
        run, metadata = _checkpointer_options(options)
        url = tmp_path / f"run{n()}"

        async def go() -> str:
            async with asyncstore.Checkpointer(url, differential=differential, **run) as ckpt:
                await (await ckpt.save(state(), 7, metadata=metadata))
                return (await ckpt.versions())[-1].key

        return [info(url / asyncio.run(go()))]

    check(saved, entries=True)


def test_checkpointer_takes_one_save_config(tmp_path: Path) -> None:
    from asyncstore._config import SaveConfig

    n = counter()

    def saved(options: dict[str, Any]) -> list[CheckpointInfo]:
        url = tmp_path / f"run{n()}"
        with asyncstore.torch.Checkpointer(url, save_config=SaveConfig(**options)) as ckpt:
            ckpt.save(state(), 3).result()
            return [info(url / ckpt.versions()[-1].key)]

    check(saved, entries=True)
    with pytest.raises(asyncstore.InvalidArgument, match="save_config was given with level"):
        asyncstore.Checkpointer(tmp_path / "both", save_config=SaveConfig(), level=3)


def test_sync_checkpointer_save(tmp_path: Path) -> None:
    n = counter()

    def saved(options: dict[str, Any]) -> list[CheckpointInfo]:
        run, metadata = _checkpointer_options(options)
        url = tmp_path / f"run{n()}"
        with asyncstore.torch.Checkpointer(url, **run) as ckpt:
            ckpt.save(state(), 3, metadata=metadata).result()
            return [info(url / ckpt.versions()[-1].key)]

    check(saved, entries=True)


def _rank_objects(directory: Path) -> list[CheckpointInfo]:
    return [info(path) for path in sorted(directory.glob("__*.ckpt"))]


# In one process, with no process group: DCP says it saves in a single process.
ONE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@ONE_PROCESS
def test_dcp_storage_writer(tmp_path: Path) -> None:
    n = counter()

    def saved(options: dict[str, Any]) -> list[CheckpointInfo]:
        url = tmp_path / f"ckpt{n()}"
        state_dict_saver.save(state(), storage_writer=StorageWriter(url, **options))
        return _rank_objects(url)

    # Each rank object names its entries by the state's names: exclude matches "skip".
    check(saved, entries=True)


@ONE_PROCESS
def test_checkpointer_dcp_save_and_save_training_state(tmp_path: Path) -> None:
    n = counter()

    def saved(options: dict[str, Any]) -> tuple[int, int]:
        # The stored bytes of a dcp_save's version, and of a save_training_state's.
        url = tmp_path / f"run{n()}"
        model = torch.nn.Linear(1, 1)
        model.register_buffer("data", text_like())
        with asyncstore.torch.Checkpointer(url, **options) as ckpt:
            ckpt.dcp_save(state(), 4)
            ckpt.save_training_state(5, model).result()
        return tuple(  # type: ignore[return-value]
            sum(
                t.stored_bytes
                for i in _rank_objects(url / f"step-00000000{step}.dcp")
                for t in i.tensors
            )
            for step in (4, 5)
        )

    tuned, plain = saved({**PLAIN, "level": 19}), saved(PLAIN)
    assert tuned[0] < 0.95 * plain[0]
    assert tuned[1] < 0.95 * plain[1]


def test_cli_import(tmp_path: Path) -> None:
    from asyncstore.cli import main

    src = tmp_path / "state.pt"
    torch.save(state(), src)
    sizes = {}
    for level in (1, 19):
        dst = tmp_path / f"imported{level}"
        assert (
            main(
                [
                    "import",
                    str(src),
                    str(dst),
                    "--compression",
                    "zstd",
                    "--level",
                    str(level),
                    "--chunk-bytes",
                    str(CHUNK),
                ]
            )
            == 0
        )
        found = _rank_objects(dst)
        sizes[level] = sum(t.stored_bytes for i in found for t in i.tensors)
        assert sum(t.chunks for i in found for t in i.tensors) == 2 * (1 << 19) // CHUNK
    assert sizes[19] < 0.95 * sizes[1]
    raw = tmp_path / "raw"
    assert main(["import", str(src), str(raw), "--compression", "none"]) == 0
    assert all(t.codec == "raw" for i in _rank_objects(raw) for t in i.tensors)


RANKS_SCRIPT = """
    import sys

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import asyncstore.torch
    from asyncstore.torch.dcp import StorageWriter

    url, level = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.frombuffer(bytearray(open(sys.argv[3], "rb").read()), dtype=torch.uint8)
    # Each rank's own values: every rank writes its objects.
    state = {f"r{rank}.weight": data.clone(), f"r{rank}.bias": data.clone()}
    options = dict(compression="zstd", level=level, chunk_bytes=65536, exclude=["*.bias"])
    dcp.save(state, storage_writer=StorageWriter(url + "/plain", **options))
    with asyncstore.torch.Checkpointer(url + "/run", **options) as ckpt:
        ckpt.dcp_save(state, 7)
    dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_two_ranks_save_with_the_options_they_are_given(tmp_path: Path) -> None:
    # Real gloo ranks, through the plugin's writer and a Checkpointer's dcp_save: level and
    # exclude (by the state's names) reach every rank's object.
    data = tmp_path / "data.bin"
    data.write_bytes(text_like().numpy().tobytes())
    stored: dict[int, dict[str, tuple[int, str]]] = {}
    for level in (1, 19):
        where = tmp_path / f"level{level}"
        wait_ranks(spawn_ranks(RANKS_SCRIPT, 2, str(where), str(level), str(data)), timeout=240)
        for directory in (where / "plain", where / "run" / "step-000000007.dcp"):
            objects = _rank_objects(directory)
            assert len(objects) == 2  # one per rank
            for found in objects:
                for t in found.tensors:
                    stored.setdefault(level, {})[f"{directory.name}/{t.name}"] = (
                        t.stored_bytes,
                        t.codec,
                    )
    names = {name.rsplit("/", 1)[1] for name in stored[19]}
    assert names == {"r0.weight", "r0.bias", "r1.weight", "r1.bias"}  # the state's names
    for name, (size, codec) in stored[19].items():
        if name.endswith(".bias"):
            assert codec == "raw", name  # exclude, by the state's name
        else:
            assert codec != "raw", name
            assert size < 0.95 * stored[1][name][0], name  # level
