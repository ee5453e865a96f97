"""The benchmarks' charts (benchmarks/_plots.py): each draws from a small results dict shaped
as its bench script saves them, to a valid PNG, and the same figures give the same bytes."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="the charts need the 'plots' extra")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MACHINE = "Test CPU, 2 cores, 4 GiB RAM; Python 3.11; SeaweedFS on loopback"


@pytest.fixture(scope="module")
def plots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """benchmarks/_plots.py, with matplotlib's cache in a temporary directory (a home
    directory that cannot be written would make matplotlib warn, and warnings fail)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MPLCONFIGDIR", str(tmp_path_factory.mktemp("mplconfig")))
        patch.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module("_plots")
    sys.modules.pop("_plots", None)


def store_results() -> dict[str, Any]:
    return {
        "date": "2026-01-01",
        "machine": MACHINE,
        "small": {
            "objects": 400,
            "object_bytes": 50_000,
            "baseline": {"put_per_s": 170.0, "get_per_s": 270.0},
            "asyncstore": [
                {"inflight": c, "put_per_s": 100.0 * c**0.5, "get_per_s": 300.0 * c**0.4}
                for c in (1, 8, 32, 64)
            ],
        },
        "large": {
            "mib": 64,
            "part_mib": 16,
            "repeat": 1,
            "baseline_put_inflight": 4,
            "baseline_get_inflight": 32,
            "baseline": {"put_mb_s": 91.0, "get_mb_s": 132.0},
            "asyncstore": {"put_mb_s": 101.0, "get_mb_s": 124.0},
        },
    }


def checkpoint_results() -> dict[str, Any]:
    rows = [
        {"writer": "raw write + fsync", "blocking": None, "total": 0.68},
        {"writer": "torch.save + fsync", "blocking": 2.5, "total": 2.5},
        {"writer": "DCP async_save (later)", "blocking": 0.47, "total": 6.0},
        {"writer": "asyncstore save, None (later)", "blocking": 0.13, "total": 0.75},
    ]
    return {
        "date": "2026-01-01",
        "machine": MACHINE,
        "saves": {
            "fp32": {"mib": 61.0, "raw_total": 0.68, "rows": rows},
            "bf16": {"mib": 63.0, "raw_total": 0.7, "rows": rows},
        },
    }


def cache_results() -> dict[str, Any]:
    return {
        "date": "2026-01-01",
        "machine": MACHINE,
        "objects": 400,
        "object_bytes": 50_000,
        "reads": [
            {"read": "cold", "per_s": 1375.0, "cache": True, "limit": False},
            {"read": "warm memory tier", "per_s": 427_164.0, "cache": True, "limit": False},
            {"read": "store directly", "per_s": 1690.0, "cache": False, "limit": False},
            {"read": "plain open().read()", "per_s": 26_162.0, "cache": False, "limit": True},
        ],
        "hit_rates": {
            "epochs": 3,
            "objects": 400,
            "capacity": 200,
            "policies": [
                {"policy": "lru", "hit_rate": 0.102},
                {"policy": "plan", "hit_rate": 0.333},
            ],
            "optimum": 0.333,
        },
    }


def dataset_results() -> dict[str, Any]:
    return {
        "date": "2026-01-01",
        "machine": MACHINE,
        "objects": 400,
        "object_bytes": 50_000,
        "batch": 64,
        "baseline_per_s": 271.0,
        "store_per_s": 1144.0,
        "epochs": [
            {"workers": w, "cold": 800.0, "warm": [7000.0, 7500.0, 8000.0], "ceiling": 14_000.0}
            for w in (0, 2)
        ],
        "larger_than_memory": {
            "total_mb": 20.0,
            "memory_mb": 6.4,
            "plain_per_s": 35_679.0,
            "rows": [
                {"policy": p, "workers": w, "warm": 8000.0, "in_loader": 20_000.0}
                for w in (0, 2)
                for p in ("plan", "lru")
            ],
        },
    }


SYNTHETIC = {
    "bench_store": store_results,
    "bench_checkpoint": checkpoint_results,
    "bench_cache": cache_results,
    "bench_dataset": dataset_results,
}


def test_every_chart_has_synthetic_results(plots: ModuleType) -> None:
    assert set(plots.DRAWERS) == set(SYNTHETIC)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_chart_is_a_deterministic_png(plots: ModuleType, name: str, tmp_path: Path) -> None:
    results = SYNTHETIC[name]()
    first = plots.draw(name, results, images_dir=tmp_path / "a")
    second = plots.draw(name, results, images_dir=tmp_path / "b")
    assert first == tmp_path / "a" / f"{name}.png"
    data = first.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert b"Software" not in data  # no matplotlib version in the file
    assert 5_000 < len(data) < 300_000
    assert second.read_bytes() == data


def test_results_round_trip_through_json(plots: ModuleType, tmp_path: Path) -> None:
    # Charts are redrawn from the saved JSON: it must give back the same figures.
    results = cache_results()
    path = plots.save_results("bench_cache", results, results_dir=tmp_path)
    assert json.loads(path.read_text()) == results
    again = plots.save_results("bench_cache", json.loads(path.read_text()), results_dir=tmp_path)
    assert again.read_bytes() == path.read_bytes()
