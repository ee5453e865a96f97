"""PyTorch's own serialization tests as the referee of ``asyncstore.torch.save`` / ``load``.

Runs ``test_serialization.py`` from ``../shared/pytorch-tests/`` (beside the repository; it
is never copied into it) twice, each in its own process: once as PyTorch ships it, once with
the names ``torch.save`` and ``torch.load`` *as the test module sees them* replaced by
asyncstore's. Only the test module's view of ``torch`` changes: torch itself, and every
library calling ``torch.save`` inside it, keep PyTorch's functions. Prints one row per test
(pass, fail or skip under each) and the totals::

    .venv/bin/python benchmarks/referee_serialization.py            # the table
    .venv/bin/python benchmarks/referee_serialization.py --failing  # ours' failures, why

The test module ``tests/torch/test_referee_serialization.py`` runs the same harness (a subset,
for the time CI has) and checks that the tests listed there pass with ours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import unittest
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT.parent / "shared" / "pytorch-tests" / "test_serialization.py"
MODES = ("torch", "ours")


class _TorchView(types.ModuleType):
    """``torch`` as the test module sees it: every attribute is torch's, except those set
    on this object (``save`` and ``load``)."""

    def __init__(self, real: types.ModuleType, **replaced: Any) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__["_real"] = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)


class _Record(unittest.TestResult):
    """Each test's outcome (``pass``, ``fail``, ``skip``) and, for a failure, why."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.seconds: dict[str, float] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._started = time.perf_counter()

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        self.seconds[self._name(test)] = time.perf_counter() - self._started

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return f"{type(test).__name__}.{test._testMethodName}"

    def addSuccess(self, test: unittest.TestCase) -> None:
        self.outcomes.setdefault(self._name(test), ("pass", ""))

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self.outcomes[self._name(test)] = ("pass", "")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self.outcomes[self._name(test)] = ("skip", reason)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self.outcomes[self._name(test)] = ("fail", _why(err))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self.outcomes[self._name(test)] = ("fail", _why(err))

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self.outcomes[self._name(test)] = ("fail", "unexpected success")

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:
        if err is not None:
            self.outcomes[self._name(test)] = ("fail", _why(err))


def _why(err: Any) -> str:
    kind, value, _ = err
    return f"{kind.__name__}: {' '.join(str(value).split())}"[:300]


def _worker(
    mode: str, only: list[str] | None, exclude: list[str]
) -> dict[str, tuple[str, str, float]]:
    """Import the suite, substitute ours when ``mode`` is ``"ours"``, run it here."""
    import torch
    from torch.testing._internal import common_utils

    # As PyTorch runs it (``python test_serialization.py``): the module is ``__main__``
    # (some tests match messages naming ``__main__.SomeClass``), its closing
    # ``run_tests()`` left to this harness.
    run_tests = common_utils.run_tests
    common_utils.run_tests = lambda *args, **kwargs: None
    try:
        spec = importlib.util.spec_from_file_location("__main__", SUITE)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["__main__"] = module
        spec.loader.exec_module(module)
    finally:
        common_utils.run_tests = run_tests
    if mode == "ours":
        import asyncstore.torch

        module.torch = _TorchView(  # type: ignore[attr-defined]
            torch, save=asyncstore.torch.save, load=asyncstore.torch.load
        )
    suite = unittest.TestLoader().loadTestsFromModule(module)
    wanted = None if only is None else set(only)
    suite = unittest.TestSuite(
        t
        for t in _flatten(suite)
        if (wanted is None or _Record._name(t) in wanted) and _Record._name(t) not in exclude
    )
    record = _Record()
    suite.run(record)
    return {
        name: (outcome, why, record.seconds.get(name, 0.0))
        for name, (outcome, why) in record.outcomes.items()
    }


def _flatten(suite: Iterable[Any]) -> Iterable[unittest.TestCase]:
    for item in suite:
        if isinstance(item, unittest.TestCase):
            yield item
        else:
            yield from _flatten(item)


def run(
    mode: str,
    only: list[str] | None = None,
    package: Path = ROOT,
    exclude: Iterable[str] = (),
) -> dict[str, tuple[str, str, float]]:
    """Run the suite (the tests in ``only``, less those in ``exclude``) in a new process,
    with torch's functions (``mode="torch"``) or ours (``"ours"``, imported from the
    ``asyncstore`` package under ``package``); each test's (outcome, why, seconds)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: pass one of {MODES}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        args = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--out", str(out)]
        if only is not None:
            args += ["--only", *only]
        exclude = list(exclude)
        if exclude:
            args += ["--exclude", *exclude]
        env = dict(os.environ, PYTHONPATH=str(package), PYTHONWARNINGS="ignore")
        done = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"the {mode} run failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        loaded: dict[str, list[Any]] = json.loads(out.read_text())
    return {name: (str(row[0]), str(row[1]), float(row[2])) for name, row in loaded.items()}


def main() -> None:
    """The command line: the table, or one run (``--worker``) in this process."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="+", help="run only these tests (Class.test_name)")
    parser.add_argument("--exclude", nargs="+", default=[], help="leave these tests out")
    parser.add_argument("--failing", action="store_true", help="print why ours fail")
    parser.add_argument(
        "--shipped",
        type=Path,
        help="a directory holding another asyncstore package (an earlier release, say): "
        "adds a column for its functions",
    )
    args = parser.parse_args()
    if args.worker:
        outcomes = _worker(args.worker, args.only, args.exclude)
        Path(args.out).write_text(json.dumps(outcomes, indent=1, sort_keys=True))
        return
    if not SUITE.exists():
        sys.exit(f"{SUITE} is absent: the referee needs PyTorch's test_serialization.py there")
    columns = [("torch", "torch", ROOT)]
    if args.shipped is not None:
        columns.append(("shipped", "ours", args.shipped.resolve()))
    columns.append(("ours", "ours", ROOT))
    results: dict[str, dict[str, tuple[str, str, float]]] = {}
    for label, mode, package in columns:
        started = time.perf_counter()
        results[label] = run(mode, args.only, package, args.exclude)
        print(f"# {label}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    labels = [label for label, _, _ in columns]
    names = sorted(set().union(*results.values()))
    width = max(len(name) for name in names)
    print(f"{'test':<{width}}  " + "  ".join(f"{label:<7}" for label in labels))
    for name in names:
        row = [results[label].get(name, ("-", "", 0.0))[0] for label in labels]
        print(f"{name:<{width}}  " + "  ".join(f"{outcome:<7}" for outcome in row))
    print()
    passing = [n for n in names if results["torch"].get(n, ("",))[0] == "pass"]
    for label in labels:
        kinds = [outcome for outcome, _, _ in results[label].values()]
        counts = {kind: kinds.count(kind) for kind in ("pass", "fail", "skip")}
        also = sum(1 for n in passing if results[label].get(n, ("",))[0] == "pass")
        print(
            f"{label}: {counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip; "
            f"{also} of the {len(passing)} that pass with torch's"
        )
    if args.failing:
        print()
        for name in passing:
            outcome, why, _ = results["ours"].get(name, ("-", "", 0.0))
            if outcome != "pass":
                print(f"{name}: {why}")


if __name__ == "__main__":
    main()
