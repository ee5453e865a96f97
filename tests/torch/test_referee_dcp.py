"""PyTorch's own DCP tests as the referee of the plugin: a representative subset of them runs
with our ``StorageWriter``/``StorageReader`` substituted for torch's ``FileSystemWriter``/
``FileSystemReader``, and must pass exactly where torch's own classes pass.

``benchmarks/referee_dcp.py`` runs every selected file twice, with torch's classes and with
ours, and prints the table (docs/distributed.md, "Tested"); ``PASSING`` below is what torch's
own classes pass in the subset there. Running torch's side again here would only re-check
torch (a third of a minute of CI on 2 cores): this test runs ours, and fails if any of those
tests stops passing with ours, or if another starts (then the list is brought up to date).

The test files are read from ``../shared/pytorch-tests/distributed-checkpoint/`` beside
the repository (never copied into it); the module skips only where that is absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "referee_dcp", ROOT / "benchmarks" / "referee_dcp.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


referee = _harness()

if not referee.TESTS.is_dir():
    pytest.skip(
        f"PyTorch's DCP test files are not at {referee.TESTS} (a checkout without the shared "
        "referee files); CI has them",
        allow_module_level=True,
    )

SUBSET = (
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoad",
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadRot13",
    "test_format_utils.py::TestFormatUtils::test_dcp_to_torch_save",
    "test_format_utils.py::TestFormatUtils::test_torch_save_to_dcp",
)
"""Single-process tests of tensors, blobs and dtype casts (what every save and load does),
and DCP's two format conversions (``dcp_to_torch_save`` / ``torch_save_to_dcp``, ours
substituted for the test module's). The whole selection (multi-rank resharding, e2e) takes
too long for 2 cores in CI: run ``python benchmarks/referee_dcp.py`` for it."""

PASSING = {
    "TestDistributedStateDictSaveLoad::test_read_write_only_tensor_thread_count_1",
    "TestDistributedStateDictSaveLoad::test_read_write_only_tensor_thread_count_2",
    "TestDistributedStateDictSaveLoadRot13::test_read_write_tensor_and_blob_thread_count_1",
    "TestDistributedStateDictSaveLoadRot13::test_read_write_tensor_and_blob_thread_count_2",
    "TestFormatUtils::test_dcp_to_torch_save",
    "TestFormatUtils::test_torch_save_to_dcp",
}
"""What torch's own classes pass in the subset (``python benchmarks/referee_dcp.py``; the
subset's other test, ``test_dtype_mismatch_casting``, fails with torch's too), and so what
ours must pass, exactly."""


@pytest.mark.timeout(900)
def test_every_test_passing_with_torchs_classes_passes_with_ours() -> None:
    ours = referee.run(SUBSET, "ours")
    assert ours, "no PyTorch test ran: the referee harness found nothing to run"
    passed = {name for name, outcome in ours.items() if outcome == "passed"}
    lost = sorted(PASSING - passed)
    assert not lost, f"pass with torch's FileSystemWriter/Reader, not with ours: {lost}"
    assert passed == PASSING, f"now passing with ours too: {sorted(passed - PASSING)}"
