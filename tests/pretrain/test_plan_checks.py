"""A DeepSpeed JSON that an engine would refuse, or that sets what the run config owns, is refused for every
phase before phase 1 trains.

Before, a phase-2 JSON with bf16 at ZeRO stage 0 or an unknown LAMB key crashed with a traceback
when phase 2's engine was built: after the whole of phase 1. Now `pretrain.train.main` exits 2 with
one line naming the phase, its file and the key, and nothing is trained or written. A JSON in the previous
layout (batch sizes, lr, bf16 in the DeepSpeed file) is refused the same way, naming the run-config key
to move each value to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.train import main
from tests.support.pretrain_fixtures import REPO_ROOT, build_shards, tiny_run_config

BASE_DS = json.loads((REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json").read_text())


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tmp_path_factory.mktemp("plan_checks") / "shards", train=32, val=8)


@pytest.mark.parametrize(
    ("change", "overrides", "expected"),
    [
        ({"optimizer": {"params": {"max_grad_norm": 1.0}}}, [], "unknown key(s) ['max_grad_norm']"),
        ({"optimizer": {"params": {"betas": [0.9, 1.5]}}}, [], "betas must be two values in [0, 1)"),
        ({"zero_optimization": {"stage": 0}}, ["--run.precision=bf16"], 'needs "zero_optimization": {"stage": 1}'),
        ({"optimizer": {"type": "lamb"}}, [], "CUDA-only FusedLamb"),
        ({"train_batch_size": 64, "optimizer": {"params": {"lr": 6e-3}}}, [],
         "train_batch_size, optimizer.params.lr belong to the run config: set phase2.batch_size=64, phase2.lr=0.006 "
         "in RUN.json and remove them here"),
    ],
    ids=["unknown-lamb-key", "bad-beta", "bf16-at-stage-0", "deepspeed-lamb", "previous-layout"],
)
def test_a_bad_phase2_json_is_a_config_error_before_phase1(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str], change: dict, overrides: list[str],
    expected: str,
) -> None:
    from pretrain.config.deepspeed import deep_merge

    bad = tmp_path / "phase2_ds.json"
    bad.write_text(json.dumps(deep_merge(BASE_DS, change)))
    run_json = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")
    code = main(["--config", str(run_json), f"--phase2.ds_config={bad}", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("config error: ") and "phase2.ds_config" in err[0], err
    assert str(bad) in err[0] and expected in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()  # phase 1 never started


def test_the_ranks_word_a_problem_as_the_launch_time_check_does(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run without launch.sh (or on another world size), the driver refuses with the launch check's own line."""
    from pretrain.errors import ConfigError
    from pretrain.launch.preflight import LaunchShape, check_command_line

    run_json = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")
    for bad in (f"--data.shards={tmp_path / 'absent'}", "--phase2.seq_len=128", "--model.overrides.vocab_size=7"):
        args = ["--config", str(run_json), bad]
        with pytest.raises(ConfigError) as refused:
            check_command_line(args, LaunchShape(1, "cpu"))
        assert main(args) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"config error: {refused.value}"], bad
    assert not (tmp_path / "run").exists()


def test_a_phase_without_validation_data_says_so_once_at_its_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards built without --val-fraction (an empty val split): the phase trains, and rank 0 says once why it
    shows no validation numbers instead of skipping them without a word."""
    no_val = build_shards(tmp_path / "shards", seq_lens=(32,), train=32, val=2)
    manifest = json.loads((no_val / "manifest.json").read_text())
    manifest["seq_lens"]["32"]["val"] = {"num_instances": 0, "nsp_random_fraction": None, "shards": []}
    (no_val / "manifest.json").write_text(json.dumps(manifest))
    run_json = tiny_run_config(tmp_path / "run.json", no_val, tmp_path / "run")
    code = main(["--config", str(run_json), '--run.phases=["phase1"]', "--phase1.steps=1", "--logging.val_every_steps=1",
                 "--checkpoint.export_at_phase_end=false"])
    out = capsys.readouterr().out
    assert code == 0, out
    notes = [line for line in out.splitlines() if line.startswith("note: phase1: no validation this phase: ")]
    assert len(notes) == 1 and "0 val instances at seq 32" in notes[0] and "--val-fraction" in notes[0], out


def test_a_run_folder_held_by_a_live_job_is_refused(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second job on the same run folder (a rerun beside ranks that outlived their launcher) stops at start-up
    with one line naming the holder, instead of writing checkpoints beside the first."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from pretrain.distributed.lifetime import "
         "hold_run_folder; hold_run_folder(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)",
         str(run_dir)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        run_json = tiny_run_config(tmp_path / "run.json", shards, run_dir)
        assert main(["--config", str(run_json)]) == 2
        line = capsys.readouterr().err.strip().splitlines()
        assert len(line) == 1 and "is in use by a live job" in line[0] and f"pid {holder.pid}" in line[0], line
        assert not (run_dir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
