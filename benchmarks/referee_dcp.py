"""PyTorch's own DCP tests as a referee for asyncstore's DCP plugin.

Runs the selected test files of ``torch/test/distributed/checkpoint`` (kept, unchanged, in
``../shared/pytorch-tests/distributed-checkpoint/`` beside the repository, never in it)
twice: with torch's own ``FileSystemWriter``/``FileSystemReader``, and with
:mod:`asyncstore.torch.dcp`'s ``StorageWriter``/``StorageReader`` in their place. Prints one
row per PyTorch test: passed, failed or skipped with each.

The substitution replaces only what a test module sees: its names bound to DCP's
``FileSystemWriter``/``FileSystemReader``/``FsspecWriter``/``FsspecReader`` and
``format_utils``' ``dcp_to_torch_save``/``torch_save_to_dcp`` (for
``asyncstore.torch``'s), the DCP modules
it imported (a view of each with those classes replaced), and its ``save``/``load``/
``async_save`` calls given a path ``checkpoint_id`` and no storage object (routed to ours
when our plugin accepts the id, as DCP's own choice of plugin would). DCP's own code keeps
torch's classes. Both runs also get the CPU settings torch's tests need here: GPU-count skips
use their ``allow_cpu`` option, and the ``"cpu:gloo,cpu:gloo"`` backend string is ``"gloo"``.

Usage: ``python benchmarks/referee_dcp.py [FILE_OR_NODE ...] [--impl torch|ours|both]``.
Rank processes that torch's tests spawn run this file as their main module, which is how
they get the same substitution (``ASYNCSTORE_REFEREE_IMPL`` says which).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tempfile
import time
import types
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT.parent / "shared" / "pytorch-tests" / "distributed-checkpoint"
FILES = (
    "test_file_system_checkpoint_cpu.py",
    "test_dtensor_resharding.py",
    "test_dtensor_checkpoint.py",
    "test_save_load_api.py",
    "test_format_utils.py",
    "test_dcp_to_torch_save.py",
    "test_fsspec.py",
    "e2e/test_e2e_save_and_load.py",
)
ENV = "ASYNCSTORE_REFEREE_IMPL"
IMPLS = ("torch", "ours")


def _cpu_settings() -> None:
    """What torch's tests need on a machine without GPUs, in both runs."""
    import functools

    import torch.distributed as dist
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed._tensor import common_dtensor

    original = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = True) -> Any:
        return original(x, allow_cpu=allow_cpu)  # type: ignore[no-untyped-call]

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    if not hasattr(common_dtensor, "_get_device_type"):
        # Newer test files import this helper, which torch 2.13's testing package lacks:
        # the accelerator when there are enough of them for the world, else the CPU.
        import torch

        def _get_device_type(world_size: int) -> str:
            accelerator = torch.accelerator.current_accelerator()
            if accelerator is None or torch.accelerator.device_count() < world_size:
                return "cpu"
            return accelerator.type

        common_dtensor._get_device_type = _get_device_type  # type: ignore[attr-defined]
    common_dtensor.skip_if_lt_x_gpu = skip_if_lt_x_gpu  # type: ignore[attr-defined]

    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "cpu:gloo,cpu:gloo":
            kwargs["backend"] = "gloo"  # torch 2.13 refuses a device named twice
        return init(*args, **kwargs)

    dist.init_process_group = init_process_group


def _ours() -> dict[str, Any]:
    """Torch's DCP classes and functions a test module may name, each mapped to ours."""
    from torch.distributed.checkpoint import filesystem, state_dict_loader, state_dict_saver

    from asyncstore.torch.dcp import StorageReader, StorageWriter

    class Writer(StorageWriter):
        """``FileSystemWriter(path, ...)``'s signature over ours: ``path`` and
        ``overwrite`` carry over; torch's file-layout knobs (threads, single file per
        rank, extensions) have no counterpart and are left out."""

        def __init__(self, path: Any = None, *args: Any, overwrite: bool = True, **_: Any):
            super().__init__(path, overwrite=overwrite)

    class Reader(StorageReader):
        """``FileSystemReader(path, ...)``'s signature over ours."""

        def __init__(self, path: Any = None, *args: Any, **_: Any):
            super().__init__(path)

    def routed(function: Callable[..., Any], slot: str) -> Callable[..., Any]:
        # A path checkpoint_id without a storage object: DCP would pick a plugin by asking
        # each in turn; ours is asked first here (through the class the test sees, so a
        # test that patches its validate_checkpoint_id is obeyed).
        mine = Writer if slot == "storage_writer" else Reader

        def call(*args: Any, **kwargs: Any) -> Any:
            checkpoint_id = kwargs.get("checkpoint_id")
            if (
                kwargs.get(slot) is None
                and checkpoint_id is not None
                and mine.validate_checkpoint_id(checkpoint_id)
            ):
                kwargs[slot] = mine(checkpoint_id)
            return function(*args, **kwargs)

        call.__name__ = function.__name__
        call.__doc__ = function.__doc__
        return call

    table: dict[str, Any] = {"FileSystemWriter": Writer, "FileSystemReader": Reader}
    originals: dict[Any, Any] = {}
    try:
        from torch.distributed.checkpoint import _fsspec_filesystem as fs

        table["FsspecWriter"], table["FsspecReader"] = Writer, Reader
        originals.update({fs.FsspecWriter: Writer, fs.FsspecReader: Reader})
    except ImportError:
        pass
    # DCP's format conversions, for ours of the same names and arguments.
    from torch.distributed.checkpoint import format_utils

    import asyncstore.torch

    for name in ("dcp_to_torch_save", "torch_save_to_dcp"):
        table[name] = getattr(asyncstore.torch, name)
        originals[getattr(format_utils, name)] = table[name]
    originals[filesystem.FileSystemWriter] = Writer
    originals[filesystem.FileSystemReader] = Reader
    for module, slot, names in (
        (state_dict_saver, "storage_writer", ("save", "async_save", "save_state_dict")),
        (state_dict_loader, "storage_reader", ("load", "load_state_dict")),
    ):
        for name in names:
            function = getattr(module, name, None)
            if function is not None:
                originals[function] = table[name] = routed(function, slot)
    return {"by_name": table, "by_object": originals}


class _View(types.ModuleType):
    """A DCP module as a test module sees it: ours in place of torch's storage classes."""

    def __init__(self, module: types.ModuleType, table: dict[str, Any]) -> None:
        super().__init__(module.__name__, module.__doc__)
        self._module = module
        self._table = {name: table[name] for name in table if hasattr(module, name)}

    def __getattr__(self, name: str) -> Any:
        table = self.__dict__.get("_table", {})
        if name in table:
            return table[name]
        return getattr(self.__dict__["_module"], name)


def _substitute(module: types.ModuleType, swap: dict[str, Any]) -> None:
    by_object: dict[Any, Any] = swap["by_object"]
    for name, value in list(vars(module).items()):
        if isinstance(value, types.ModuleType):
            if value.__name__.startswith("torch.distributed.checkpoint"):
                setattr(module, name, _View(value, swap["by_name"]))
            continue
        try:
            replacement = by_object.get(value)
        except TypeError:  # unhashable
            continue
        if replacement is not None:
            setattr(module, name, replacement)


class _Finder(importlib.abc.MetaPathFinder):
    """Substitutes in each referee test module once it has run its imports."""

    def __init__(self, swap: dict[str, Any]) -> None:
        self.swap = swap

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.origin is None or spec.loader is None:
            return None
        if not Path(spec.origin).resolve().is_relative_to(TESTS.resolve()):
            return None
        loader = spec.loader
        swap = self.swap

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return None

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                _substitute(module, swap)

        spec.loader = Loader()
        return spec


def install(impl: str) -> None:
    """Set up this process (the pytest process, or a rank it spawned) for ``impl``."""
    _cpu_settings()
    if impl == "ours":
        sys.meta_path.insert(0, _Finder(_ours()))


def _outcomes(report: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    if not report.exists():
        return outcomes
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        for child in case:
            if child.tag in ("failure", "error") and os.environ.get("REFEREE_WHY"):
                print(f"--- {name}\n{(child.text or '')[-1500:]}", file=sys.stderr)
    return outcomes


def run(targets: Sequence[str], impl: str, timeout: float = 1800) -> dict[str, str]:
    """Run ``targets`` (files or node ids under the referee directory) with ``impl``'s
    classes; returns each test's outcome ("passed", "failed" or "skipped")."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        ini = Path(scratch) / "pytest.ini"
        ini.write_text("[pytest]\n")
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--assert=plain",  # pytest's rewriting importer would bypass the substitution
            "-c",
            str(ini),
            "--rootdir",
            str(TESTS),
            f"--junitxml={report}",
            *(str(TESTS / target) for target in targets),
        ]
        env = dict(os.environ, **{ENV: impl})
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        subprocess.run(
            command,
            env=env,
            cwd=scratch,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
        return _outcomes(report)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the referee table for the selected files (all of them by default)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=list(FILES))
    parser.add_argument("--impl", choices=(*IMPLS, "both"), default="both")
    args = parser.parse_args(argv)
    if not TESTS.is_dir():
        print(f"{TESTS} is absent: nothing to referee", file=sys.stderr)
        return 2
    impls = IMPLS if args.impl == "both" else (args.impl,)
    results: dict[str, dict[str, str]] = {}
    for impl in impls:
        started = time.monotonic()
        for target in args.targets:
            results.setdefault(impl, {}).update(run([target], impl))
        print(f"{impl}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    names = sorted({name for outcome in results.values() for name in outcome})
    width = max((len(name) for name in names), default=4)
    print(f"{'test':<{width}}  " + "  ".join(f"{impl:<8}" for impl in impls))
    for name in names:
        row = "  ".join(f"{results[impl].get(name, '-'):<8}" for impl in impls)
        print(f"{name:<{width}}  {row}")
    for impl in impls:
        counts = {k: list(results[impl].values()).count(k) for k in ("passed", "failed", "skipped")}
        print(f"{impl}: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    return 0


if os.environ.get(ENV) in IMPLS:
    # In the pytest process and in every rank process torch's tests spawn (they run this
    # file again as their main module before unpickling the test case).
    install(os.environ[ENV])

if __name__ == "__main__":
    if sys.argv[1:2] == ["--pytest"]:
        import pytest

        sys.exit(pytest.main(sys.argv[2:]))
    sys.exit(main())
