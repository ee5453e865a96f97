"""How long the command line takes to answer, against what any Python program pays, same run.

Each command runs in a fresh interpreter (as a user's shell runs it), ``ROUNDS`` times in
turn with the others, and the median wall time is reported beside two baselines measured in
the same rounds: ``python -c pass`` (the interpreter alone) and ``python -c "import torch"``
(what every command paid when the command line imported torch at start-up).

1. ``asyncstore --help`` (the console script) and ``python -m asyncstore --help``.
2. ``asyncstore ls`` of a local run of three versions.
3. ``asyncstore inspect`` of a single-object version (its shapes need torch: see the text).
4. ``asyncstore inspect`` of the same version with ``--json``.

Run ``python benchmarks/bench_cli_startup.py``; it prints a markdown table.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 9
BIN = Path(sys.executable).parent


def _make_run(directory: str) -> None:
    # Written by a child: this process stays free of torch, like the commands it times.
    script = (
        "import sys, torch, asyncstore.torch as at\n"
        "with at.Checkpointer(sys.argv[1]) as c:\n"
        "    for step in (100, 200, 300):\n"
        "        c.save({'w': torch.randn(256, 256), 'b': torch.randn(256), 'step': step}, step)\n"
    )
    subprocess.run([sys.executable, "-c", script, directory], check=True)


def _commands(run: str) -> dict[str, list[str]]:
    asyncstore = str(BIN / "asyncstore")
    return {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        'python -c "import torch" (baseline)': [sys.executable, "-c", "import torch"],
        "asyncstore --help": [asyncstore, "--help"],
        "python -m asyncstore --help": [sys.executable, "-m", "asyncstore", "--help"],
        "asyncstore ls RUN": [asyncstore, "ls", run],
        "asyncstore inspect RUN --step 300": [asyncstore, "inspect", run, "--step", "300"],
        "asyncstore inspect RUN/step-000000300.ckpt --json": [
            asyncstore,
            "inspect",
            os.path.join(run, "step-000000300.ckpt"),
            "--json",
        ],
    }


def _time(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        run = os.path.join(directory, "run")
        _make_run(run)
        commands = _commands(run)
        for argv in commands.values():
            _time(argv)  # warm the page cache once
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(ROUNDS):
            for name, argv in commands.items():
                times[name].append(_time(argv))
    medians = {name: statistics.median(values) for name, values in times.items()}
    bare = medians["python -c pass (baseline)"]
    torch_import = medians['python -c "import torch" (baseline)']
    print(f"Median of {ROUNDS} runs each, interleaved; Python {sys.version.split()[0]}.")
    print()
    print("| command | median | x `python -c pass` | x `import torch` |")
    print("|---|---|---|---|")
    for name, median in medians.items():
        print(
            f"| `{name}` | {median * 1e3:.0f} ms | {median / bare:.1f} | "
            f"{median / torch_import:.2f} |"
        )


if __name__ == "__main__":
    main()
