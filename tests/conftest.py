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
SLOW_TESTS = (  # prefixes of test ids: a folder ("tests/x/"), a file, or "file::test" (truncated to fit a line)
    "tests/bench/test_gpu_check.py::test_a_killed_run_keeps_the_rows_measured_before_the_kill",
    "tests/bench/test_gpu_check.py::test_failing_rows_are_reported_and_every_other_row_is_still_measured",
    "tests/bench/test_gpu_check.py::test_gpu_check_smoke_runs_the_production_step_and_saves_every_row",
    "tests/bench/test_gpu_check.py::test_preflight_names_every_missing_wheel_in_one_line",
    "tests/bench/test_gpu_check.py::test_preflight_stops_on_a_recipe_the_driver_refuses",
    "tests/bench/test_gpu_check_parts.py::test_a_kernel_test_dying_in_its_child_is_one_fail_row_and_the_chec",
    "tests/bench/test_gpu_check_parts.py::test_a_part_over_its_budget_is_stopped_said_in_the_file_and_the_ne",
    "tests/bench/test_gpu_check_selftest.py::test_the_training_rows_print_the_compiled_layers_graphs_recompi",
    "tests/bench/test_gpu_check_selftest.py::test_the_verdict_table_prints_the_margins_and_a_wrong_compiled_",
    "tests/checkpointing/test_checkpoint_costs.py::test_rank_zero_deletes_old_tags_after_the_final_barrier",
    "tests/checkpointing/test_foreign_folders.py",
    "tests/checkpointing/test_safe_load.py::test_the_driver_refuses_a_planted_checkpoint_in_one_line_and_exi",
    "tests/data/test_order.py::test_over_many_keys_each_position_takes_each_value_equally_often",
    "tests/data/test_order.py::test_the_permutation_is_a_bijection_of_every_size_up_to_300_and_inverts",
    "tests/data/test_shard_values.py::test_an_id_beyond_the_vocab_is_refused_before_training_in_one_line",
    "tests/data_prep/test_build.py::test_resume_after_sigkill_gives_identical_output",
    "tests/data_prep/test_input_shards.py::test_a_cancelled_array_element_fails_its_stage_and_the_relaunch_r",
    "tests/data_prep/test_input_shards.py::test_every_executor_gives_the_same_bytes",
    "tests/data_prep/test_input_shards.py::test_kill_in_each_stage_then_relaunch",
    "tests/data_prep/test_input_shards.py::test_slurm_arrays_give_the_same_bytes_and_rerun_only_what_is_miss",
    "tests/data_prep/test_worker_death.py::test_a_build_whose_worker_is_killed_says_so_in_one_line_and_the_same",
    "tests/data_prep/test_segments_build.py::test_bad_segments_is_one_line_naming_the_flag",
    "tests/data_prep/test_segments_build.py::test_full_sentences_node_builds_then_merge_equal_single_node",
    "tests/data_prep/test_segments_build.py::test_full_sentences_one_and_two_workers_give_identical_bytes",
    "tests/data_prep/test_segments_build.py::test_mode_is_part_of_the_folder_identity_and_old_folders_resume",
    "tests/data_prep/test_shard_contract.py::test_shards_read_with_plain_pyarrow_as_documented",
    "tests/demo/test_demo.py::test_demo_dry_run_prints_every_step_through_launch_sh",
    "tests/demo/test_demo_readouts.py::test_tensorboard_serves_several_run_folders",
    "tests/device_check/test_compiled_check.py::test_the_compiled_layer_self_test_passes_and_catches_wrong_c",
    "tests/device_check/test_compiled_check.py::test_the_plan_tests_the_compiled_layer_and_runs_it_eager_whe",
    "tests/device_check/test_compiled_layer_check.py::test_a_compiled_graph_whose_dropout_drops_nothing_or_t",
    "tests/device_check/test_compiled_layer_check.py::test_a_compiled_layer_two_percent_off_in_bf16_fails_an",
    "tests/device_check/test_contained.py::test_a_child_that_dies_of_a_device_fault_is_a_failed_test_and_the",
    "tests/device_check/test_contained.py::test_on_the_cpu_the_test_runs_in_this_process",
    "tests/device_check/test_contained_exit.py::test_a_child_that_lingers_after_its_verdict_is_killed_and_it",
    "tests/device_check/test_host_check.py::test_a_changed_key_or_an_untrusted_file_tests_again",
    "tests/device_check/test_host_check.py::test_a_child_that_finds_the_device_busy_is_answered_in_the_rank",
    "tests/device_check/test_host_check.py::test_one_child_tests_both_stages_and_a_restart_reads_the_verdict",
    "tests/device_check/test_kernel_check.py::test_a_failed_kernel_stage_fails_the_self_test_and_says_so",
    "tests/device_check/test_kernel_check.py::test_a_kernel_one_percent_off_in_bf16_is_caught_and_the_correc",
    "tests/device_check/test_kernel_check.py::test_the_dropout_smoke_check_passes_the_reference_and_catches_",
    "tests/device_check/test_kernel_run_shape.py::test_a_kernel_wrong_only_past_8_segments_or_2_heads_fails_",
    "tests/device_check/test_tf32_settings.py::test_tf32_set_through_the_new_api_passes_the_self_test_and_is",
    "tests/device_check/test_unpadded_check.py::test_the_reference_kernel_passes_and_planted_wrong_kernels_f",
    "tests/distributed/test_extension_builds.py::test_a_rank_started_with_a_login_path_loads_the_op_without_",
    "tests/distributed/test_startup_signal.py",
    "tests/distributed/test_step_watch.py::test_a_rank_holds_one_timer_from_start_up_to_its_last_step",
    "tests/finetune/glue/test_finetune.py::test_a_tiny_export_learns_a_learnable_task_well_above_chance",
    "tests/finetune/glue/test_finetune.py::test_every_tasks_official_files_end_to_end_with_two_seeds",
    "tests/launch/test_node_env.py::test_a_two_node_finetune_gives_deepspeeds_runner_no_value",
    "tests/launch/test_watchdog.py::test_watchdog_stops_the_job_group_once_its_launch_sh_is_killed",
    "tests/metrics/test_monitors.py::test_each_monitor_logs_the_tags_its_docstring_lists_and_adds_no_host_re",
    "tests/metrics/test_throughput.py::test_forward_has_no_data_dependent_shape",
    "tests/model/test_checkpointed_fallbacks.py",
    "tests/model/test_compile_failures.py::test_a_specialized_shape_recompiles_and_the_recompile_limit_says_",
    "tests/model/test_compile_fallbacks.py",
    "tests/model/test_compiled.py::test_compiled_layers_train_like_padded_eager_with_no_graph_break_or_recom",
    "tests/model/test_compiled.py::test_compiled_layers_under_activation_checkpointing_have_no_graph_break",
    "tests/optim/test_fused_lamb.py::test_fused_flat_step_equals_reference",
    "tests/optim/test_fused_lamb.py::test_fused_step_of_a_bf16_partition_computes_with_fp32_scalars",
    "tests/pretrain/test_batch_warmup.py::test_a_resume_in_micro_batch_rounds_of_another_size_keeps_the_warm",
    "tests/pretrain/test_batch_warmup.py::test_the_batch_grows_step_by_step_with_deepspeeds_boundary_on_each",
    "tests/pretrain/test_engine.py::test_init_distributed_from_slurm_environment",
    "tests/pretrain/test_engine.py::test_one_process_run_gets_its_timeout_and_backend_and_leaves_no_shm",
    "tests/pretrain/test_extensions.py::test_importing_the_trainer_loads_no_deepspeed",
    "tests/pretrain/test_extensions.py::test_the_trainer_calls_start_phase_first_then_after_step_and_adds_ev",
    "tests/pretrain/test_masking_schedule.py::test_the_rate_the_model_saw_follows_the_schedule_and_is_logged",
    "tests/pretrain/test_plan_checks.py::test_a_phase_without_validation_data_says_so_once_at_its_start",
    "tests/pretrain/test_plugin_boundary.py::test_a_plain_config_loads_no_plugin_module_and_a_codistill_sect",
    "tests/pretrain/test_trainer.py::test_a_recipe_step_never_synchronizes_the_device",
    "tests/pretrain/test_trainer.py::test_checkpoints_follow_the_clock_when_every_minutes_is_set",
    "tests/pretrain/test_trainer.py::test_grad_norm_is_logged_at_every_zero_stage_and_agrees",
    "tests/pretrain/test_trainer.py::test_packed_and_unpadded_steps_train_like_padded_ones",
    "tests/pretrain/test_trainer.py::test_the_logged_lr_is_the_lr_each_step_trained_with",
    "tests/pretrain/test_trainer.py::test_the_next_steps_batches_are_read_while_this_steps_work_is_queued",
    "tests/report/test_driver_records.py::test_a_stopped_and_resumed_run_keeps_its_clock_and_exports_a_card",
    "tests/report/test_report_trust.py::test_a_pruned_checkpoint_still_gives_the_card_its_steps",
    "tests/report/test_run_folder.py::test_no_module_but_run_folder_spells_a_run_folder_name",
)


def is_slow(item: pytest.Item) -> bool:
    """Whether `item` belongs to the slow tier (the module's docstring)."""
    path = item.nodeid.split("::")[0]
    return (any(item.get_closest_marker(marker) for marker in SLOW_MARKERS)
            or any(f"{path}::{fixture}" in SLOW_FIXTURES for fixture in getattr(item, "fixturenames", ()))
            or item.nodeid.startswith(SLOW_TESTS))


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


def compile_project_bytecode() -> None:
    """Compile the project's modules once, for every process the suite starts (ranks, agents, stores, the build's
    workers: hundreds, each importing 100-200 of them). Python writes these files on a first import by itself,
    except where PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines: there every process compiled
    the modules it imported anew, about 0.5 CPU-s per rank. The files land in `__pycache__/` (ignored by git),
    as any import would leave them; a module changed later is compiled again (its timestamp is checked)."""
    import compileall

    for package in ("pretrain", "data_prep", "tests", "bench"):
        compileall.compile_dir(REPO_ROOT / package, quiet=2)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the checkout is judged once, by pytest-xdist's controller
        session.stash[CHECKOUT_BEFORE] = checkout_changes()
    compile_project_bytecode()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests write only to temporary folders: a file the suite left in the checkout fails the run, named.

    (A batch script once wrote its requeue note into the checkout's root, and it was committed.) Judged by the
    controller, after both workers: a worker that ends first would see the other's launches at work."""
    before, after = session.stash.get(CHECKOUT_BEFORE, None), checkout_changes()
    if before is None or after is None or not (left := sorted(after - before)):
        return
    session.config.get_terminal_writer().line("")
    session.config.get_terminal_writer().line(
        "the tests changed the checkout (tests write only to temporary folders): " + ", ".join(left), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


CHECKOUT_BEFORE = pytest.StashKey[set[str] | None]()
