"""PyTorch's own serialization tests, as the referee of ``asyncstore.torch.save`` / ``load``.

Runs ``../shared/pytorch-tests/test_serialization.py`` (beside the repository, never copied
into it) with ``torch.save`` and ``torch.load`` as that module sees them replaced by ours,
through the harness of benchmarks/referee_serialization.py (which prints the whole table,
torch's own functions beside ours). The tests that pass with ours are listed here exactly:
a regression fails, and a test that starts passing must be added to the list. The few
slowest tests (multi-GB files) run only in the benchmark.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent.parent / "benchmarks"
SUITE = (
    Path(__file__).resolve().parent.parent.parent.parent
    / "shared/pytorch-tests/test_serialization.py"
)

pytestmark = pytest.mark.skipif(
    not SUITE.exists(), reason=f"PyTorch's test_serialization.py is not at {SUITE}"
)

# Minutes on 2 cores between them, and gigabytes of memory: the benchmark runs them.
SLOW = frozenset(
    {
        "TestSerialization.test_serialization_4gb_file",
        "TestSerialization.test_serialization_2gb_file",
        "TestOldSerialization.test_serialization_offset",
        "TestOldSerialization.test_serialization_offset_filelike_weights_only_True",
        "TestOldSerialization.test_serialization_offset_filelike_weights_only_False",
    }
)

# Every test that passes with asyncstore's save and load (of those not in SLOW).
PASSING = frozenset(
    {
        "TestBothSerializationCPU.test_serialization_new_format_old_format_compat_weights_only_False_cpu",
        "TestBothSerializationCPU.test_serialization_new_format_old_format_compat_weights_only_True_cpu",
        "TestOldSerialization.test_load_error_msg",
        "TestOldSerialization.test_load_nonexistent_device",
        "TestOldSerialization.test_pickle_module",
        "TestOldSerialization.test_safe_load_basic_types",
        "TestOldSerialization.test_save_different_dtype_unallocated",
        "TestOldSerialization.test_serialization",
        "TestOldSerialization.test_serialization_fake_zip",
        "TestOldSerialization.test_serialization_filelike",
        "TestOldSerialization.test_serialization_filelike_api_requirements",
        "TestOldSerialization.test_serialization_filelike_exceptions",
        "TestOldSerialization.test_serialization_filelike_missing_attrs",
        "TestOldSerialization.test_serialization_filelike_stress",
        "TestOldSerialization.test_serialization_filelike_uses_readinto",
        "TestOldSerialization.test_serialization_gzip",
        "TestOldSerialization.test_serialization_offset_gzip",
        "TestOldSerialization.test_serialization_safe",
        "TestOldSerialization.test_serialization_save_warnings",
        "TestOldSerialization.test_serialization_sparse",
        "TestOldSerialization.test_serialization_sparse_safe",
        "TestOldSerialization.test_serialization_storage_slice",
        "TestOldSerialization.test_serialization_zipfile_utils",
        "TestOldSerialization.test_serialize_device",
        "TestOldSerialization.test_skip_data_load",
        "TestSerialization.test_load_error_msg",
        "TestSerialization.test_load_nonexistent_device",
        "TestSerialization.test_lr_scheduler_serialization",
        "TestSerialization.test_meta_serialization_weights_only_False",
        "TestSerialization.test_meta_serialization_weights_only_True",
        "TestSerialization.test_mmap_load_offset_calculation_path_type0",
        "TestSerialization.test_mmap_load_offset_calculation_path_type1",
        "TestSerialization.test_pathlike_serialization_weights_only_False",
        "TestSerialization.test_pathlike_serialization_weights_only_True",
        "TestSerialization.test_pickle_module",
        "TestSerialization.test_safe_load_basic_types",
        "TestSerialization.test_save_different_dtype_unallocated",
        "TestSerialization.test_save_load_preserves_dtype_bfloat16_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_bfloat16_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_bool_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_bool_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_complex128_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_complex128_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_complex64_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_complex64_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_float16_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_float16_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_float32_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_float32_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_float64_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_float64_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_int16_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_int16_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_int32_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_int32_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_int64_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_int64_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_int8_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_int8_weights_only_True",
        "TestSerialization.test_save_load_preserves_dtype_uint8_weights_only_False",
        "TestSerialization.test_save_load_preserves_dtype_uint8_weights_only_True",
        "TestSerialization.test_serialization",
        "TestSerialization.test_serialization_byte_literal_byte_literals0_weights_only_False",
        "TestSerialization.test_serialization_byte_literal_byte_literals0_weights_only_True",
        "TestSerialization.test_serialization_byte_literal_byte_literals1_weights_only_False",
        "TestSerialization.test_serialization_byte_literal_byte_literals1_weights_only_True",
        "TestSerialization.test_serialization_dtype_complex32_weights_only_False",
        "TestSerialization.test_serialization_dtype_complex32_weights_only_True",
        "TestSerialization.test_serialization_dtype_float8_e4m3fn_weights_only_False",
        "TestSerialization.test_serialization_dtype_float8_e4m3fn_weights_only_True",
        "TestSerialization.test_serialization_dtype_float8_e5m2_weights_only_False",
        "TestSerialization.test_serialization_dtype_float8_e5m2_weights_only_True",
        "TestSerialization.test_serialization_dtype_uint16_weights_only_False",
        "TestSerialization.test_serialization_dtype_uint16_weights_only_True",
        "TestSerialization.test_serialization_dtype_uint32_weights_only_False",
        "TestSerialization.test_serialization_dtype_uint32_weights_only_True",
        "TestSerialization.test_serialization_dtype_uint64_weights_only_False",
        "TestSerialization.test_serialization_dtype_uint64_weights_only_True",
        "TestSerialization.test_serialization_efficient_zerotensor_weights_only_False",
        "TestSerialization.test_serialization_efficient_zerotensor_weights_only_True",
        "TestSerialization.test_serialization_fake_zip",
        "TestSerialization.test_serialization_filelike",
        "TestSerialization.test_serialization_filelike_api_requirements",
        "TestSerialization.test_serialization_filelike_exceptions",
        "TestSerialization.test_serialization_filelike_missing_attrs",
        "TestSerialization.test_serialization_filelike_stress",
        "TestSerialization.test_serialization_filelike_uses_readinto",
        "TestSerialization.test_serialization_gzip",
        "TestSerialization.test_serialization_math_bits_weights_only_False",
        "TestSerialization.test_serialization_math_bits_weights_only_True",
        "TestSerialization.test_serialization_mmap_loading",
        "TestSerialization.test_serialization_mmap_loading_ctx",
        "TestSerialization.test_serialization_mmap_loading_options_path_type0_weights_only_False",
        "TestSerialization.test_serialization_mmap_loading_options_path_type0_weights_only_True",
        "TestSerialization.test_serialization_mmap_loading_options_path_type1_weights_only_False",
        "TestSerialization.test_serialization_mmap_loading_options_path_type1_weights_only_True",
        "TestSerialization.test_serialization_nested_class",
        "TestSerialization.test_serialization_offset_gzip",
        "TestSerialization.test_serialization_python_attr_weights_only_False",
        "TestSerialization.test_serialization_python_attr_weights_only_True",
        "TestSerialization.test_serialization_safe",
        "TestSerialization.test_serialization_save_warnings",
        "TestSerialization.test_serialization_sparse",
        "TestSerialization.test_serialization_sparse_safe",
        "TestSerialization.test_serialization_storage_slice",
        "TestSerialization.test_serialization_uintx_intx",
        "TestSerialization.test_serialization_with_header",
        "TestSerialization.test_serialization_zipfile_actually_jit",
        "TestSerialization.test_serialization_zipfile_utils",
        "TestSerialization.test_serialization_zipfile_weights_only_False",
        "TestSerialization.test_serialization_zipfile_weights_only_True",
        "TestSerialization.test_serialize_device",
        "TestSerialization.test_skip_data_load",
        "TestSerialization.test_skip_data_serialization_error_cases",
        "TestSerialization.test_skip_data_serialization_materialize_fake_False",
        "TestSerialization.test_skip_data_serialization_materialize_fake_True",
        "TestSerialization.test_skip_data_serialization_preserves_views_materialize_fake_False",
        "TestSerialization.test_skip_data_serialization_preserves_views_materialize_fake_True",
        "TestSerialization.test_weights_only_assert",
        "TestSerialization.test_weights_only_blocked_func_error_msg",
        "TestSerialization.test_weights_only_env_variables_force_weights_only_False",
        "TestSerialization.test_weights_only_env_variables_force_weights_only_True",
        "TestSerialization.test_weights_only_error_unsafe_global_True",
        "TestSerialization.test_weights_only_safe_globals_blocklist",
        "TestSerialization.test_weights_only_safe_globals_build",
        "TestSerialization.test_weights_only_safe_globals_build_with_slots_slots_all",
        "TestSerialization.test_weights_only_safe_globals_build_with_slots_slots_some",
        "TestSerialization.test_weights_only_safe_globals_newobj",
        "TestSerialization.test_weights_only_with_zoneinfo_unpickle_registration_success",
        "TestSubclassSerialization.test_cloned_deepcopy_requires_grad_False",
        "TestSubclassSerialization.test_cloned_deepcopy_requires_grad_True",
        "TestSubclassSerialization.test_empty_class_serialization",
        "TestSubclassSerialization.test_safe_globals_context_manager_weights_only",
        "TestSubclassSerialization.test_safe_globals_for_weights_only",
        "TestSubclassSerialization.test_sets_are_loadable_with_weights_only",
        "TestSubclassSerialization.test_tensor_subclass_deepcopy",
        "TestSubclassSerialization.test_tensor_subclass_getstate_overwrite",
        "TestSubclassSerialization.test_tensor_subclass_wrapper_serialization",
    }
)


@pytest.fixture(scope="module")
def referee() -> ModuleType:
    """benchmarks/referee_serialization.py, imported."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("referee_serialization")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.timeout(600)
def test_pytorch_serialization_tests_pass_with_ours(referee: ModuleType) -> None:
    outcomes = referee.run("ours", exclude=SLOW)
    assert len(outcomes) > 150, "the suite ran only in part"
    passing = {name for name, (outcome, _, _) in outcomes.items() if outcome == "pass"}
    regressed = {name: outcomes.get(name, ("missing", ""))[1] for name in PASSING - passing}
    assert not regressed, f"these passed with ours and fail now: {regressed}"
    assert not passing - PASSING, (
        f"these pass with ours now: add them to PASSING: {sorted(passing - PASSING)}"
    )
