"""`./launch.sh pretrain` checks the run before it starts a launcher: a typo'd key, missing shards or a
DeepSpeed JSON that sets a recipe's key is one line and exit 2, and no rank process ever starts.

"No rank started" is observed, not timed: $PYTHON is a shim that records every command line it runs
and then runs the real interpreter, so the test sees that only `pretrain.launch.plan` ran (never
`deepspeed.launcher.runner`, `srun` or `pretrain.train`), and that no run folder was written. Before,
each of these errors came from every rank, after DeepSpeed had spawned them. The check module, and
`--help` of every command, import no torch or DeepSpeed (fresh interpreters, `sys.modules`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.data.shard_checks import check_phase_shards
from pretrain.errors import ConfigError
from pretrain.launch.preflight import LaunchShape, check_command_line
from tests.support.launching import child_env
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

LAUNCH = REPO_ROOT / "launch.sh"
HEAVY = ("torch", "deepspeed", "transformers")
BASE_DS = REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tmp_path_factory.mktemp("preflight") / "shards", train=32, val=8)


@pytest.fixture
def job(tmp_path: Path, shards: Path) -> dict[str, Path]:
    """A valid tiny run; a $PYTHON shim that logs each command line to `calls` before running python, and
    `srun` / `deepspeed` on PATH that log theirs and fail."""
    calls = tmp_path / "calls.log"
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >>{calls}\nexec {sys.executable} "$@"\n')
    for name in ("srun", "deepspeed"):
        (shim.parent / name).write_text(f'#!/usr/bin/env bash\nprintf "{name} %s\\n" "$*" >>{calls}\nexit 1\n')
    for tool in shim.parent.iterdir():
        tool.chmod(0o755)
    run_json = tiny_run_config(tmp_path / "run.json", shards, tmp_path / "run")
    return {"run_json": run_json, "run_dir": tmp_path / "run", "calls": calls, "python": shim, "cwd": tmp_path}


def launch_env(job: dict[str, Path], **extra: str) -> dict[str, str]:
    env = {key: value for key, value in child_env().items() if not key.startswith("SLURM_")}
    env.update(PYTHON=str(job["python"]), PATH=f"{job['python'].parent}{os.pathsep}{env['PATH']}", **extra)
    env.pop("PYTHONPATH", None)
    return env


def recorded(job: dict[str, Path]) -> list[str]:
    return job["calls"].read_text().splitlines() if job["calls"].is_file() else []


def assert_refused_before_any_rank(proc: subprocess.CompletedProcess[str], job: dict[str, Path], expected: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("launch.sh: config error: ") and expected in lines[0], lines
    assert not any(line.startswith("+ ") for line in proc.stdout.splitlines()), proc.stdout  # nothing was run
    calls = recorded(job)
    plans = [call for call in calls if call.startswith("-m pretrain.launch.plan ")]
    assert any(" launch " in call and " --check-run " in call for call in plans), calls  # the shim records
    started = [call for call in calls if call not in plans and any(word in call for word in ("deepspeed", "srun",
                                                                                           "pretrain.train"))]
    assert started == [], started
    assert not job["run_dir"].exists()


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--phase1.warmup_fracton=0.1"], "phase1.warmup_fracton: unknown key; did you mean phase1.warmup_fraction?"),
        (["--data.shards=no/such/folder"], "data.shards: no/such/folder/manifest.json: no manifest"),
        (["--phase2.ds_config={owned}"], "phase2.ds_config ({owned}): train_batch_size belongs to the run config: "
                                         "set phase2.batch_size=64 in RUN.json and remove it here"),
    ],
    ids=["typo-key", "missing-shards", "owned-key-in-deepspeed-json"],
)
def test_launch_sh_refuses_a_bad_run_before_any_rank_starts(
    job: dict[str, Path], arguments: list[str], expected: str
) -> None:
    owned = job["cwd"] / "owned.json"
    owned.write_text(json.dumps({**json.loads(BASE_DS.read_text()), "train_batch_size": 64}))
    arguments = [arg.format(owned=owned) for arg in arguments]
    command = ["bash", str(LAUNCH), "pretrain", "--cpu", "--gpus", "2", "--config", str(job["run_json"]), *arguments]
    proc = subprocess.run(command, cwd=job["cwd"], env=launch_env(job), capture_output=True, text=True, timeout=120)
    assert_refused_before_any_rank(proc, job, expected.format(owned=owned))


def test_every_launcher_path_checks_first(job: dict[str, Path]) -> None:
    """A hostfile launch, a SLURM allocation (srun) and the SLURM batch script: the same one line, no rank."""
    typo, expected = "--phase1.warmup_fracton=0.1", "did you mean phase1.warmup_fraction?"
    (job["cwd"] / "hosts").write_text("localhost slots=2\n")
    config = ["--config", str(job["run_json"])]
    hostfile = ["bash", str(LAUNCH), "pretrain", "--cpu", "--gpus", "2", "--hostfile", "hosts", *config, typo]
    proc = subprocess.run(hostfile, cwd=job["cwd"], env=launch_env(job), capture_output=True, text=True, timeout=120)
    assert_refused_before_any_rank(proc, job, expected)
    slurm = launch_env(job, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1",
                       SLURM_GPUS_ON_NODE="2")
    srun = ["bash", str(LAUNCH), "pretrain", *config, typo]
    proc = subprocess.run(srun, cwd=job["cwd"], env=slurm, capture_output=True, text=True, timeout=120)
    assert_refused_before_any_rank(proc, job, expected)
    batch = ["bash", str(REPO_ROOT / "slurm" / "slurm_pretrain.sbatch"), str(job["run_json"]), typo]
    proc = subprocess.run(batch, cwd=REPO_ROOT, env=slurm, capture_output=True, text=True, timeout=120)
    assert_refused_before_any_rank(proc, job, expected)


def test_a_good_run_is_checked_and_summarised_and_a_dry_run_only_notes_problems(job: dict[str, Path]) -> None:
    base = ["bash", str(LAUNCH), "--dry-run", "pretrain", "--cpu", "--gpus", "2", "--config", str(job["run_json"])]
    proc = subprocess.run(base, cwd=job["cwd"], env=launch_env(job), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == (
        f"launch.sh: checked {job['run_json']} for 2 rank(s): phase1 seq 32, batch 16 = 4 x 2 accumulation x 2 "
        "ranks; phase2 seq 64, batch 16 = 4 x 2 accumulation x 2 ranks; disk at most 4 checkpoints x 1.8 MiB + "
        "2 exports x 500.8 KiB; save every 90.5 min (checkpoint.every_minutes; Young/Daly for a 1 s save and a "
        "failure every 4,096 h, one per 8,192 GPU-hours on 2 devices: 0.04% of the time lost) (save cost estimated "
        "at 1 GB/s until a save is measured)")  # keep_last 2 + 1 being written + phase 1's end: footprint.py
    proc = subprocess.run([*base, "--data.shards=later"], cwd=job["cwd"], env=launch_env(job), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "-m pretrain.launch.agent" in proc.stdout  # printed, as a dry run does
    assert proc.stderr.strip().startswith("launch.sh: note: config error: data.shards: later/manifest.json")
    assert proc.stderr.strip().endswith("(continuing: --dry-run)")


def test_the_check_is_light_and_so_is_every_help(job: dict[str, Path]) -> None:
    """A fresh interpreter: the check itself, and each command's --help, leave torch and DeepSpeed unimported
    and print no third-party warning."""
    probe = (
        "import sys; from pretrain.launch.preflight import LaunchShape, check_command_line; "
        f"print(check_command_line(['--config', {str(job['run_json'])!r}], LaunchShape(2, 'cpu'))); "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    env = {**child_env(), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.splitlines()[0], "[]"] and "checked" in proc.stdout
    for module, args in [("pretrain.train", []), ("pretrain.finetune.squad", []), ("pretrain.finetune.squad", ["finetune"]),
                         ("pretrain.finetune.squad", ["evaluate"]), ("pretrain.launch.scale", []), ("pretrain.config.rehearsal", []),
                         ("pretrain.launch.preflight", []), ("pretrain.export", [])]:  # fmt: skip
        command = [sys.executable, "-X", "importtime", "-m", module, *args, "--help"]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=job["cwd"])
        assert proc.returncode == 0 and "usage:" in proc.stdout, (module, proc.stderr[-2000:])
        imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()]
        assert not [name for name in imported if name.split(".")[0] in HEAVY], (module, args)
        others = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        assert others == [], (module, others)  # no warning of any kind
    assert "--phase1.warmup_fraction=VALUE" in subprocess.run(
        [sys.executable, "-m", "pretrain.train", "--help"], env=env, capture_output=True, text=True, timeout=120
    ).stdout
    proc = subprocess.run(["bash", str(LAUNCH), "pretrain", "--help"], env=launch_env(job), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--no-check" in proc.stdout and proc.stderr == ""
    assert not [call for call in recorded(job) if "deepspeed" in call or "pretrain.train" in call]


# ---------------------------------------------------------------------------------------------- the checks
def test_batch_arithmetic_is_checked_for_the_world_size_of_the_launch(job: dict[str, Path]) -> None:
    args = ["--config", str(job["run_json"]), "--phase1.batch_size=16", "--phase1.gradient_accumulation_steps=null"]
    assert "batch 16 = 4 x 2 accumulation x 2 ranks" in check_command_line(args, LaunchShape(2, "cpu"))
    with pytest.raises(ConfigError, match=r"^phase1.batch_size: 16 is not divisible by phase1.micro_batch_size 4 x "
                                          r"data-parallel size 8$"):
        check_command_line(args, LaunchShape(8, "cpu"))


def test_a_node_range_is_checked_for_every_node_count_before_any_node_starts(job: dict[str, Path],
                                                                              shards: Path) -> None:
    """--nodes MIN:MAX: a restart without a lost node must keep each phase's global batch. The shipped tiny_cpu
    recipe fixes gradient_accumulation_steps (its batch follows the ranks): `--nodes 1:2` is refused in one line,
    seconds after the command, naming the node count and the setting; the batch and micro-batch set instead pass."""
    tiny = REPO_ROOT / "ds_configs" / "recipes" / "tiny_cpu.json"
    (job["cwd"] / "hosts").write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")
    command = ["bash", str(LAUNCH), "pretrain", "--cpu", "--gpus", "1", "--hostfile", "hosts", "--nodes", "1:2",
               "--config", str(tiny), f"--data.shards={shards}", "--phase1.seq_len=32", "--phase2.seq_len=64",
               f"--run.dir={job['run_dir']}"]
    proc = subprocess.run(command, cwd=job["cwd"], env=launch_env(job), capture_output=True, text=True, timeout=120)
    assert_refused_before_any_rank(proc, job, (
        "phase1.gradient_accumulation_steps: with --nodes 1:2 a restart on 1 node(s) would change phase1's global "
        "batch of 16 sequences (1 node(s): 8 sequences there): it is micro_batch_size x gradient_accumulation_steps x "
        "ranks; set phase1.batch_size=16 and phase1.micro_batch_size and leave phase1.gradient_accumulation_steps "
        "unset (derived for the ranks a restart has)"))
    derived = ["--config", str(job["run_json"]), *(f"--phase{n}.{key}" for n in (1, 2)
                                                   for key in ("batch_size=16", "gradient_accumulation_steps=null"))]
    assert "batch 16 = 4 x 2 accumulation x 2 ranks" in check_command_line(derived, LaunchShape(2, "cpu", 1, (1,)))
    # BERT-Large's 64K batch at micro-batch 64 on nodes of 8 GPUs: 4 nodes divide it, 3 do not
    with pytest.raises(ConfigError, match=r"^phase1.batch_size: with --nodes 3:4 a restart on 3 node\(s\) cannot "
                                          r"keep phase1's global batch of 65536 sequences \(3 node\(s\): 65536 is not "
                                          r"divisible by phase1.micro_batch_size 64 x data-parallel size 24\)"):
        big = ["--config", str(job["run_json"]), "--phase1.batch_size=65536", "--phase1.micro_batch_size=64",
               "--phase1.gradient_accumulation_steps=null", '--run.phases=["phase1"]']
        check_command_line(big, LaunchShape(32, "cpu", 8, (3,)))


def test_codistillation_batches_are_checked_per_group(job: dict[str, Path]) -> None:
    """Each codistillation group splits its own batch: 2 groups of a 4-rank job are data-parallel over 2."""
    args = ["--config", str(job["run_json"]), "--codistill.enabled=true", "--codistill.groups=2",
            "--phase1.batch_size=16", "--phase1.gradient_accumulation_steps=null"]
    assert "batch 16 = 4 x 2 accumulation x 2 ranks" in check_command_line(args, LaunchShape(4, "cpu"))
    with pytest.raises(ConfigError, match=r"^codistill.groups: 2 groups do not split a world of 3 ranks"):
        check_command_line(args, LaunchShape(3, "cpu"))


def test_shard_problems_name_the_key_and_the_file(tmp_path: Path, shards: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no shards at sequence length 128 \(it has \[32, 64\]\)"):
        check_phase_shards(shards, 128, None, "data.shards")
    broken = build_shards(tmp_path / "broken", train=8, val=2)
    (broken / "vocab.txt").write_text((broken / "vocab.txt").read_text() + "extra\n")
    with pytest.raises(ConfigError, match=r"^data.shards: .*vocab.txt \(size 49, .*differs from the manifest's vocab"):
        check_phase_shards(broken, 32, None, "data.shards")
    (broken / "seq32" / "train-00001.arrow").unlink()
    with pytest.raises(ConfigError, match=r"^phase1.shards: .*train-00001.arrow: listed in the manifest but missing$"):
        check_phase_shards(broken, 32, None, "phase1.shards")


def test_an_unwritable_run_folder_is_refused(job: dict[str, Path]) -> None:
    blocker = job["cwd"] / "a_file"
    blocker.write_text("")
    args = ["--config", str(job["run_json"]), f"--run.dir={blocker}/run"]
    with pytest.raises(ConfigError, match=r"^run.dir: .*a_file is not a folder"):
        check_command_line(args, LaunchShape(2, "cpu"))
    if os.geteuid() != 0:  # root writes anywhere: the mode bits only bind other users
        locked = job["cwd"] / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=r"^checkpoint.dir: .*locked is not writable"):
            check_command_line(["--config", str(job["run_json"]), f"--checkpoint.dir={locked}/c"], LaunchShape(1))


def test_unpadded_attention_where_its_kernel_cannot_run_is_refused_at_launch(job: dict[str, Path]) -> None:
    """An explicit unpadded in fp32 on GPUs (no flash kernel there), an explicit compile under ZeRO-3: one line
    before any rank, naming what is missing and what runs there. The defaults (auto, compile null) choose what
    runs instead: padded SDPA, eager layers."""
    args = ["--config", str(job["run_json"]), "--run.precision=fp32"]
    with pytest.raises(ConfigError, match=r"^model.attention=unpadded: the flash kernel needs bf16 or fp16 on CUDA, "
                                          r"phase1 computes in fp32 \(run.precision\); model.attention=padded runs there$"):
        check_command_line([*args, "--model.attention=unpadded"], LaunchShape(2, "cuda"))
    assert "checked" in check_command_line(args, LaunchShape(2, "cuda"))  # auto: padded SDPA there
    assert "checked" in check_command_line([*args, "--model.attention=padded"], LaunchShape(2, "cuda"))
    assert "checked" in check_command_line([*args, "--model.attention=unpadded"], LaunchShape(2, "cpu"))  # reference
    zero3 = ["--config", str(job["run_json"]), "--phase1.ds_overrides.zero_optimization.stage=3"]
    with pytest.raises(ConfigError, match=r"^model.compile: compiled layers are not supported with ZeRO-3"):
        check_command_line([*zero3, "--model.compile=true"], LaunchShape(2, "cuda"))
    assert "checked" in check_command_line(zero3, LaunchShape(2, "cuda"))  # null: eager layers under ZeRO-3
    assert "checked" in check_command_line([*zero3, "--model.compile=false"], LaunchShape(2, "cuda"))
