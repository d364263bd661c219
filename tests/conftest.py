"""Shared fixtures (where ../shared/data is), the test tiers, and the check that tests leave the checkout alone.

The tiers: `slow` marks every test that starts ranks (multirank), reads the real sample data (shared_data) or brings
up a cluster (cluster), and the tests named below that start processes or train for seconds without one of those
markers (the slowest of a full run's `--durations`). `python -m pytest -m "not slow"` is the fast tier a developer
runs while working; CI runs everything (`python -m pytest -ra`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT


def shared_data_dir() -> Path | None:
    """The real sample data: $BERT_DS_SHARED_DATA, else ../shared/data beside the checkout."""
    configured = os.environ.get("BERT_DS_SHARED_DATA")
    path = Path(configured) if configured else REPO_ROOT.parent / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture
def shared_data() -> Path:
    path = shared_data_dir()
    if path is None:
        pytest.skip("../shared/data is absent (set BERT_DS_SHARED_DATA to a folder laid out like it)")
    return path


SLOW_MARKERS = ("multirank", "shared_data", "cluster")
SLOW_FIXTURES = (  # "file::fixture": a module fixture that builds engines; every test of that file using it is slow
    "tests/checkpointing/test_safe_load.py::shipped",  # an engine of every shipped precision and ZeRO stage
    "tests/pretrain/test_engine_costs.py::counts",  # the shipped GPU engine, built on CPU
)
SLOW_TESTS = (  # "file::test" (every parametrization) or "file" (every test in it)
    "tests/bench/test_gpu_check.py::test_a_killed_run_keeps_the_rows_measured_before_the_kill",
    "tests/bench/test_gpu_check.py::test_failing_rows_are_reported_and_every_other_row_is_still_measured",
    "tests/bench/test_gpu_check.py::test_gpu_check_smoke_runs_the_production_step_and_saves_every_row",
    "tests/bench/test_gpu_check.py::test_preflight_names_every_missing_wheel_in_one_line",
    "tests/bench/test_gpu_check.py::test_preflight_stops_on_a_recipe_the_driver_refuses",
    "tests/bench/test_gpu_check_parts.py::test_a_kernel_test_dying_in_its_child_is_one_fail_row_and_the_check_goes_on",
    "tests/bench/test_gpu_check_parts.py::test_a_part_over_its_budget_is_stopped_said_in_the_file_and_the_next_part_runs",
    "tests/bench/test_gpu_check_selftest.py::test_the_verdict_table_prints_the_margins_and_a_wrong_compiled_layer_fails",
    "tests/data/test_order.py::test_the_permutation_is_a_bijection_of_every_size_up_to_300_and_inverts",
    "tests/data/test_shard_values.py::test_an_id_beyond_the_vocab_is_refused_before_training_in_one_line",
    "tests/data_prep/test_build.py::test_resume_after_sigkill_gives_identical_output",
    "tests/data_prep/test_input_shards.py::test_a_cancelled_array_element_fails_its_stage_and_the_relaunch_runs_it",
    "tests/data_prep/test_input_shards.py::test_kill_in_each_stage_then_relaunch",
    "tests/data_prep/test_input_shards.py::test_slurm_arrays_give_the_same_bytes_and_rerun_only_what_is_missing",
    "tests/distributed/test_extension_builds.py::test_a_rank_started_with_a_login_path_loads_the_op_without_rebuilding",
    "tests/distributed/test_startup_signal.py",
    "tests/distributed/test_step_watch.py::test_a_rank_holds_one_timer_from_start_up_to_its_last_step",
    "tests/launch/test_node_env.py::test_a_two_node_finetune_gives_deepspeeds_runner_no_value",
    "tests/launch/test_watchdog.py::test_watchdog_stops_the_job_group_once_its_launch_sh_is_killed",
    "tests/metrics/test_throughput.py::test_forward_has_no_data_dependent_shape",
    "tests/model/test_checkpointed_fallbacks.py",
    "tests/model/test_compile_failures.py::test_a_specialized_shape_recompiles_and_the_recompile_limit_says_so",
    "tests/model/test_compile_fallbacks.py",
    "tests/model/test_compiled.py::test_compiled_layers_train_like_padded_eager_with_no_graph_break_or_recompile",
    "tests/pretrain/test_engine.py::test_one_process_run_gets_its_timeout_and_backend_and_leaves_no_shm",
    "tests/pretrain/test_extensions.py::test_importing_the_trainer_loads_no_deepspeed",
    "tests/pretrain/test_plugin_boundary.py::test_a_plain_config_loads_no_plugin_module_and_a_codistill_section_only",
    "tests/pretrain/test_trainer.py::test_a_recipe_step_never_synchronizes_the_device",
)


def is_slow(item: pytest.Item) -> bool:
    """Whether `item` belongs to the slow tier (the module's docstring)."""
    path = item.nodeid.split("::")[0]
    name = item.nodeid.split("[")[0]
    return (any(item.get_closest_marker(marker) for marker in SLOW_MARKERS)
            or any(f"{path}::{fixture}" in SLOW_FIXTURES for fixture in getattr(item, "fixturenames", ()))
            or any(entry == path or name.startswith(entry) for entry in SLOW_TESTS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


def checkout_changes() -> set[str] | None:
    """`git status` of the checkout (ignored paths left out), or None outside a git checkout."""
    import subprocess

    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(status.stdout.splitlines()) if status.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[CHECKOUT_BEFORE] = checkout_changes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests write only to temporary folders: a file the suite left in the checkout fails the run, named.

    (A batch script once wrote its requeue note into the checkout's root, and it was committed.)"""
    before, after = session.stash.get(CHECKOUT_BEFORE, None), checkout_changes()
    if before is None or after is None or not (left := sorted(after - before)):
        return
    session.config.get_terminal_writer().line("")
    session.config.get_terminal_writer().line(
        "the tests changed the checkout (tests write only to temporary folders): " + ", ".join(left), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


CHECKOUT_BEFORE = pytest.StashKey[set[str] | None]()
