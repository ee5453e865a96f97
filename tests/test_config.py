"""One configuration style: every component's options are a msgspec Struct, validated by one
function whose errors name the argument, the value and what was expected."""

from __future__ import annotations

import pytest

from asyncstore import InvalidArgument, Prefetcher
from asyncstore._config import (
    CacheConfig,
    DatasetConfig,
    LoadConfig,
    PrefetchConfig,
    SaveConfig,
    build,
)
from asyncstore.cache import TieredCache
from asyncstore.checkpoint._load import LoadOptions
from asyncstore.checkpoint._save import SaveOptions
from asyncstore.stores import MemoryStore, S3Config
from asyncstore.torch import StreamingDataset

from .conftest import unique

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("cls", "values", "message"),
    [
        (CacheConfig, {"memory_bytes": 0}, r"^memory_bytes=0: expected int >= 1 \(an option"),
        (
            CacheConfig,
            {"memory_bytes": 1, "policy": "fifo"},
            r"^policy='fifo': invalid enum value 'fifo'; use one of 'lru', 'plan'",
        ),
        (PrefetchConfig, {"lookahead": True}, r"^lookahead=True: expected int \| str, got bool"),
        (
            PrefetchConfig,
            {"lookahead": "deep"},
            r"^lookahead='deep': invalid enum value 'deep'; use one of 'auto'",
        ),
        (DatasetConfig, {"shuffle": 1}, r"^shuffle=1: expected bool, got int"),
        (DatasetConfig, {"rank": 0}, r"^rank=0, world_size=None: pass rank and world_size"),
        (DatasetConfig, {"depth": 3}, r"unknown option 'depth'; the options are: cache_dir, "),
    ],
)
def test_build_names_the_argument_and_what_was_expected(
    cls: type, values: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        build(cls, values, "Component")


def test_save_and_load_options_are_checked_in_one_place() -> None:
    with pytest.raises(
        InvalidArgument, match=r"^exclude=\['a', 3\]: expected str, got int in exclude\[1\]"
    ):
        build(SaveConfig, {"exclude": ["a", 3]}, "save()")
    with pytest.raises(InvalidArgument, match=r"^level=30: expected int <= 22"):
        build(SaveConfig, {"level": 30}, "save()")
    with pytest.raises(InvalidArgument, match=r"^weights_only='yes': expected bool"):
        build(LoadConfig, {"weights_only": "yes"}, "load()")
    assert build(SaveConfig, {"exclude": ["*.embed*"]}, "save()").exclude == ("*.embed*",)


def test_save_options_typed_dict_matches_save_config() -> None:
    # The sync adapters type their **options with SaveOptions and LoadOptions: they must
    # name exactly the options save() and load() take.
    assert set(SaveOptions.__optional_keys__) == {
        *SaveConfig.__struct_fields__,
        "store_options",
        "format",
    }
    assert set(LoadOptions.__optional_keys__) == {
        *LoadConfig.__struct_fields__,
        "into",
        "safe_globals",
        "store_options",
    }


def test_credentials_are_never_echoed() -> None:
    with pytest.raises(InvalidArgument) as caught:
        build(S3Config, {"aws_secret_access_key": 12345}, "s3://bucket")
    assert "12345" not in str(caught.value)
    assert "aws_secret_access_key=<hidden>" in str(caught.value)


def test_defaults_and_validated_values_are_kept() -> None:
    config = build(PrefetchConfig, {"max_inflight": 8}, "Prefetcher")
    assert config == PrefetchConfig(lookahead="auto", max_inflight=8)
    assert build(CacheConfig, {"memory_bytes": 5, "ttl": 3}, "TieredCache").ttl == 3.0


async def test_components_expose_their_validated_config() -> None:
    store = MemoryStore(f"memory://{unique()}")
    async with TieredCache(store, memory_bytes=1 << 20, policy="plan") as cache:
        assert cache.config.memory_bytes == 1 << 20
        assert cache.config.policy == "plan"
        prefetcher = Prefetcher(cache, [], max_bytes=1000)
        assert prefetcher.config == PrefetchConfig(max_bytes=1000)
        await prefetcher.aclose()
    with pytest.raises(InvalidArgument, match=r"^max_bytes=0: expected int >= 1"):
        Prefetcher(store, [], max_bytes=0)
    with pytest.raises(InvalidArgument, match=r"^batch_size=0"):
        StreamingDataset(store, keys=["k"], batch_size=0)
