"""Test setup: 8 fake CPU devices (set before JAX starts) and a shared compilation cache."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from pstar_jax.compat import patient_cpu_collectives  # noqa: E402

patient_cpu_collectives()  # 8 device threads on 2 loaded cores reach an all-reduce a minute apart
# Measured machine rates go to a folder of the test session, not the user's cache.
os.environ["PSTAR_MACHINES_DIR"] = tempfile.mkdtemp(prefix="pstar_machines_")

import jax  # noqa: E402

# Many tests compile the same tiny stage functions; a persistent cache makes repeats cheap.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "pstar_jax_test_xla_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Implicit rank promotion hides shape bugs (a [B] + [B, 1] that should have been an error).
jax.config.update("jax_numpy_rank_promotion", "raise")

# Cases of parametrized (and a few plain) tests that take 5.5-15 s each on 2 cores go to the slow
# tier (`-m "not slow"` skips them; the default run keeps them): the quick tier keeps a cheaper
# case of each. Seconds as measured in the quick tier on 2026-12-04 (1,143 tests, 13 min before).
SLOW_CASES = {
    "test_zero.py::test_sft_zero_over_8_devices_equals_one_device_both_engines": 15.1,
    "test_plain.py::test_full_remat_needs_less_memory_and_micro_batches_do_not_add_up": 14.8,
    "test_plain.py::test_scanned_equals_unrolled_math_fp32[True]": 13.8,
    "test_plain.py::test_scanned_equals_unrolled_math_fp32[False]": 8.4,
    "test_plain.py::test_micro_batches_equal_one_big_batch_fp32": 7.0,
    "test_fit_messages.py::test_train_names_a_seq_len_that_fits": 12.0,
    "test_lora_peft.py::test_a_lora_step_gives_pefts_loss_and_gradients[qwen3_norms]": 11.1,
    "test_pre_layout.py::test_a_checkpoint_of_before_the_layers_resumes_and_trains_as_it_did[full]": 9.6,
    "test_batch.py::test_packed_row_equals_its_examples_alone[llama]": 9.2,
    "test_batch.py::test_packed_row_equals_its_examples_alone[gpt]": 7.4,
    "test_gpt.py::test_stages_compose_to_gpt_loss[tied]": 8.3,
    "test_decode.py::test_decode_logits_equal_the_full_forward[gpt]": 8.1,
    "test_decode.py::test_decode_logits_equal_the_full_forward[qwen2_tied]": 7.8,
    "test_decode.py::test_decode_logits_equal_the_full_forward[qwen3]": 6.8,
    "test_llama.py::test_chunked_engine_equals_plain_engine_fp32[untied]": 8.0,
    "test_llama.py::test_stages_compose_to_module_loss_and_grads[llama]": 6.9,
    "test_frozen.py::test_identical_blocks_share_compiles_under_sizes_per_kind": 7.8,
    "test_frozen.py::test_sizes_per_kind_train_bit_identically_to_one_size": 6.4,
    "test_hf_models.py::test_hf_weights_give_hf_logits[gpt2]": 7.7,
    "test_hf_models.py::test_hf_weights_give_hf_logits[llama_head_dim]": 5.5,
    "test_hf.py::test_init_from_hf_then_export_hf_is_byte_identical[gpt2]": 5.6,
    "test_hf.py::test_init_from_hf_then_export_hf_is_byte_identical[qwen2]": 5.5,
    "test_flops.py::test_a_plan_never_beats_the_machine_matmul_rate": 6.3,
}


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        if item.nodeid.rpartition("tests/")[2] in SLOW_CASES:
            item.add_marker(pytest.mark.slow)


# CI's record of the tests that ended (.ci/run): a native crash (an abort inside XLA or another
# library) ends pytest before it can report anything, so each test's start and end go to the file
# PSTAR_TEST_PROGRESS names, flushed at once; .ci/run then names the test that was running and, with
# PSTAR_TEST_RESUME set, runs once more every test that had not ended.
_PROGRESS = os.environ.get("PSTAR_TEST_PROGRESS")


def _ended_tests() -> set[str]:
    with open(_PROGRESS) as f:
        return {line.split(" ", 2)[2].rstrip("\n") for line in f if line.startswith("end ")}


def pytest_collection_finish(session):
    if _PROGRESS and os.environ.get("PSTAR_TEST_RESUME"):
        ended = _ended_tests()
        kept = [item for item in session.items if item.nodeid not in ended]
        session.config.hook.pytest_deselected(items=[item for item in session.items if item.nodeid in ended])
        session.items[:] = kept


def _note(line: str) -> None:
    with open(_PROGRESS, "a") as f:
        f.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    if _PROGRESS:
        _note(f"start {nodeid}")


def pytest_runtest_logfinish(nodeid, location):
    if _PROGRESS:
        _note(f"end {'failed' if nodeid in _FAILED else 'ok'} {nodeid}")


_FAILED: set[str] = set()


def pytest_runtest_logreport(report):
    if _PROGRESS and report.failed:
        _FAILED.add(report.nodeid)
