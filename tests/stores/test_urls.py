"""Which URLs are accepted: one URL-to-path function for every entry point, and the same
refusals for memory://, file:// and s3:// (docs/stores.md, "Which URLs are accepted")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import asyncstore
import asyncstore.torch
from asyncstore import InvalidURL
from asyncstore.checkpoint import read_manifest
from asyncstore.stores._open import local_path

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("file:///d/my%20dir/a%20b.ckpt", "/d/my dir/a b.ckpt"),
        ("file://localhost/d/x", "/d/x"),
        ("FILE://LOCALHOST/d/x", "/d/x"),
        ("file:/d/x", "/d/x"),
        ("file:///d/x/", "/d/x"),
        ("file:///", "/"),
        ("file:///d/%E6%95%B0%25", "/d/数%"),
        ("/d/my%20dir", "/d/my%20dir"),  # a plain path is never decoded
        ("/d/../e", "/e"),  # a plain path is normalised as the OS would
    ],
)
def test_local_urls_and_paths(url: str, path: str) -> None:
    assert local_path(url) == path


def test_plain_paths_are_relative_to_cwd_and_expand_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert local_path("data") == f"{tmp_path}/data"
    assert local_path("~/data") == f"{tmp_path}/home/data"
    store = asyncstore.open_store("~/data")
    assert isinstance(store, asyncstore.LocalStore)
    assert store.root == f"{tmp_path}/home/data"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("file:///tmp/a%00b", "NUL byte"),
        ("file:///tmp/a/../b", r"'\.\.' segment.*'file:///tmp/b'"),
        ("file:///tmp/%2E%2E/b", r"'\.\.' segment.*'file:///b'"),
        ("file:///tmp/./b", r"'\.' or"),
        ("file:///tmp//b", r"empty, .*'file:///tmp/b'"),
        ("file:////tmp/b", "empty"),
        ("file://otherhost/tmp/b", "names host 'otherhost'"),
        ("file:relative/b", "needs an absolute path"),
        ("file://localhost", "needs an absolute path"),
        ("file:///tmp/%FF", "not UTF-8"),
        ("file:///tmp/b?x=1", "query or fragment"),
        ("file:///tmp/b#x", "query or fragment"),
        ("file://[::1/tmp", "malformed"),
        ("file://user:pw@localhost/tmp", "embeds credentials"),
        ("./file:x\x00", "NUL byte"),
        ("s3://bucket//x", "empty path segment.*'s3://bucket/x'"),
        ("s3://bucket/x//", "empty path segment.*'s3://bucket/x'"),
        ("s3://bucket/a/../b", "malformed path"),
        ("memory://name//x", "empty path segment.*'memory://name/x'"),
        ("memory://name/a/./b", "malformed path"),
    ],
)
def test_refused_urls(url: str, match: str) -> None:
    with pytest.raises(InvalidURL, match=match):
        asyncstore.open_store(url)


@pytest.mark.parametrize(
    "url",
    ["s3://bucket//x.ckpt", "s3://bucket/run//x.ckpt", "memory://m//x.ckpt", "file:///d/../x.ckpt"],
)
async def test_refused_checkpoint_urls(url: str) -> None:
    with pytest.raises(InvalidURL):
        await asyncstore.save({"w": torch.ones(1)}, url)
    with pytest.raises(InvalidURL):
        await asyncstore.load(url)


def test_file_url_with_an_encoded_name_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once, the name stayed encoded and the directory was taken relative to the cwd.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (tmp_path / "my dir").mkdir()
    state = {"w": torch.arange(4.0)}
    spellings = [
        f"file://{tmp_path}/my%20dir/a%20b.ckpt",
        f"file://localhost{tmp_path}/my%20dir/a%20b.ckpt",
        f"file:{tmp_path}/my%20dir/a%20b.ckpt",
        f"{tmp_path}/my dir/a b.ckpt",
    ]
    asyncstore.torch.save(state, spellings[0])
    assert sorted(os.listdir(tmp_path / "my dir")) == ["a b.ckpt"]
    assert os.listdir(cwd) == []
    for url in spellings:
        assert torch.equal(asyncstore.torch.load(url)["w"], state["w"])
    asyncstore.torch.save_async(state, spellings[1]).result()
    asyncstore.torch.save(state, spellings[2])
    assert sorted(os.listdir(tmp_path / "my dir")) == ["a b.ckpt"]
    assert os.listdir(cwd) == []


async def test_torch_save_file_at_an_encoded_url_loads(tmp_path: Path) -> None:
    (tmp_path / "my dir").mkdir()
    torch.save({"w": torch.ones(3)}, tmp_path / "my dir" / "t 100%.pt")
    url = f"file://{tmp_path}/my%20dir/t%20100%25.pt"
    assert torch.equal((await asyncstore.load(url))["w"], torch.ones(3))
    assert torch.equal(asyncstore.torch.load(url)["w"], torch.ones(3))


async def test_read_manifest_of_an_encoded_url(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/a%23b.ckpt"  # '#' must be encoded, or it starts a fragment
    await (await asyncstore.save({"w": torch.ones(2)}, url))
    assert (tmp_path / "a#b.ckpt").exists()
    assert (await read_manifest(url)).storages
