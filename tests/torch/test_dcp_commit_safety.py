"""A DCP save removes the objects of the checkpoint it replaces, and nothing else: a
``.metadata`` crafted or copied from elsewhere cannot make it delete the user's files."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.metadata import MetadataIndex

import asyncstore
from asyncstore.checkpoint._distributed import encode_metadata
from asyncstore.torch.dcp import StorageReader, StorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The user's files, by key under the run: beside the checkpoint, inside it, and inside it
# under names that a save's rank objects could have.
USERS = {
    "precious.txt": b"the user's own file, beside the checkpoint",
    "ckpt/notes.txt": b"the user's notes",
    "ckpt/__0_deadbeef.ckpt": b"the user's file, named like a rank object",
    "ckpt/sub/__1_0123456789abcdef.ckpt": b"the user's file, one folder down",
}
# How a crafted .metadata names them, and what nothing names at all.
CRAFTED = [
    ["__0_deadbeef.ckpt", "notes.txt", "sub/__1_0123456789abcdef.ckpt", "zz/../../precious.txt"],
    ["../precious.txt", "notes.txt", "__0_deadbeef.ckpt"],
]


def contents(url: str, options: dict[str, Any]) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        async with asyncstore.open_store(url, **options) as store:
            return {info.key: await store.get(info.key) async for info in store.list()}

    return asyncio.run(read())


def put(url: str, options: dict[str, Any], objects: dict[str, bytes]) -> None:
    async def write() -> None:
        async with asyncstore.open_store(url, **options) as store:
            for key, data in objects.items():
                await store.put(key, data)

    asyncio.run(write())


def rank_objects(objects: dict[str, bytes]) -> set[str]:
    return {key for key, data in objects.items() if data.startswith(b"ASYNCKPT")}


def test_a_save_removes_the_replaced_saves_objects_and_nothing_a_crafted_metadata_names(
    run_url: tuple[str, dict[str, Any] | None], caplog: pytest.LogCaptureFixture
) -> None:
    base, given = run_url
    options = given or {}
    url = f"{base}/ckpt"
    state_dict_saver.save(
        {"w": torch.ones(3)}, storage_writer=StorageWriter(url, store_options=options)
    )
    put(base, options, USERS)
    for step, names in enumerate(CRAFTED):
        previous = rank_objects(contents(base, options))
        assert len(previous) == 1
        # The checkpoint's own .metadata, with the user's files named beside its object.
        metadata = StorageReader(url, store_options=options).read_metadata()
        assert metadata.storage_data is not None
        for i, name in enumerate(names):
            metadata.storage_data[MetadataIndex(f"crafted.{i}")] = (name, "0")
        put(base, options, {"ckpt/.metadata": encode_metadata(metadata)})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncstore.checkpoint"):
            state_dict_saver.save(
                {"w": torch.full((3,), float(step))},
                storage_writer=StorageWriter(url, store_options=options),
            )
        after = contents(base, options)
        for key, data in USERS.items():
            assert after.get(key) == data, key
        # The replaced save's rank object went, as the existing behaviour has it.
        now = rank_objects(after)
        assert len(now) == 1
        assert not now & previous
        assert "left alone" in caplog.text
        assert "'notes.txt'" in caplog.text
        back = {"w": torch.zeros(3)}
        state_dict_loader.load(back, storage_reader=StorageReader(url, store_options=options))
        assert torch.equal(back["w"], torch.full((3,), float(step)))
