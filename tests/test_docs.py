"""The examples in the README and the docs run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Self-contained examples: those that import what they use and need no server.
DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "stores.md",
    ROOT / "docs" / "cache.md",
    ROOT / "docs" / "datasets.md",
    ROOT / "docs" / "checkpoints.md",
    ROOT / "docs" / "distributed.md",
    ROOT / "docs" / "metrics.md",
    ROOT / "docs" / "quickstart.md",
]


# DCP's notice, in the single-process example of docs/distributed.md.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def examples() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
        found += [(f"{path.name}#{i}", b) for i, b in enumerate(blocks) if b.startswith("import")]
    return found


@pytest.mark.parametrize(("name", "code"), examples(), ids=[n for n, _ in examples()])
def test_example_runs(
    name: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, name, "exec"), {"__name__": "__main__"})


def test_there_are_examples() -> None:
    assert len(examples()) >= 4
