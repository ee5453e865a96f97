"""docs/architecture.md's module map names every module of the package, and only those:
a newcomer reading it finds each concept where it lives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncstore"
DOC = ROOT / "docs" / "architecture.md"


def mapped_modules() -> set[str]:
    """The modules the map's rows name, relative to the package: a row's first cell lists
    paths, where a name without a directory lies in the directory of the row's first."""
    text = DOC.read_text()
    table = text[text.index("## Module map") :]
    found: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", first_cell)
        directory = ""
        for i, name in enumerate(names):
            name = name.removeprefix("asyncstore/")
            if i == 0:
                directory = name.rpartition("/")[0]
            elif "/" not in name and directory:
                name = f"{directory}/{name}"
            found.add(name)
    return found


def package_modules() -> set[str]:
    return {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }


def test_the_module_map_names_every_module_and_only_those() -> None:
    mapped = {n for n in mapped_modules() if not n.endswith(("__init__.py", "__main__.py"))}
    actual = package_modules()
    assert sorted(actual - mapped) == [], "modules docs/architecture.md does not place"
    assert sorted(mapped - actual) == [], "docs/architecture.md names modules that do not exist"


def test_the_layers_drawn_are_the_layers_enforced() -> None:
    # Every top-level package or helper module the diagram names is one of import-linter's
    # layers, and every layer is drawn.
    pyproject = (ROOT / "pyproject.toml").read_text()
    contract = pyproject[pyproject.index('id = "layers"') :]
    listed = re.search(r"layers = \[(.*?)\]", contract, flags=re.DOTALL)
    assert listed is not None
    enforced = {
        part.strip()
        for layer in re.findall(r'"([^"]+)"', listed.group(1))
        for part in re.split(r"[|:]", layer)
    }
    top_level = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    top_level |= {p.stem for p in PACKAGE.glob("_*.py") if not p.stem.startswith("__")}
    top_level.add("errors")
    text = DOC.read_text()
    start = text.index("```text")
    diagram = text[start : text.index("```", start + 7)]
    drawn = set(re.findall(r"\b_?[a-z]+\b", diagram)) & top_level
    assert drawn == enforced
