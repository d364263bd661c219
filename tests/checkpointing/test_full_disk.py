"""A full disk and a rank whose write fails, for real: `./launch.sh pretrain` on 2 CPU ranks (gloo), each run
compared with an uninterrupted one by its final Hugging Face export, bit for bit.

* A run folder on a small tmpfs: the launch-time check refuses it before any rank starts (one line, exit 2).
  Launched anyway (`--no-check`: the space that was there at launch and another job took since), the first
  checkpoint fits and every later save fails: one line each, training goes on, the phase end stops the run
  with exit 4, `latest` names the last whole checkpoint and nothing partial is left. The tmpfs grown
  (`mount -o remount`), the same command finishes with the uninterrupted run's weights.
* One rank's writes fail (a file size limit set on that process alone with prlimit, as a quota would; the
  other rank writes its files fine): the save fails on both ranks, rank 0 does not move `latest`, one line
  names the rank. The limit lifted, the next save goes through and the same job ends with the
  uninterrupted run's weights.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.checkpointing.layout import LATEST
from pretrain.checkpointing.manifest import damage, manifest_bytes
from pretrain.config.load import load_config
from pretrain.launch.preflight import LaunchShape, check_config
from tests.support.filesystems import resize, small_filesystem
from tests.support.launching import child_env, free_port
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

STEPS = 10  # checkpoints at steps 2, 4, 6, 8 and the phase end, 10


def overrides(run_dir: Path) -> list[str]:
    return [f"--run.dir={run_dir}", '--run.phases=["phase1"]', f"--phase1.steps={STEPS}",
            "--checkpoint.every_steps=2", "--checkpoint.keep_last=1"]


def launch(config: Path, run_dir: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`./launch.sh pretrain` on 2 CPU ranks in a session of its own, output appended to `log`."""
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_") and k != "DS_ACCELERATOR"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = ["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", "2", "--master-port",
           str(free_port()), *extra, "--config", str(config), *overrides(run_dir)]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen[bytes], timeout: float = 900) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "phase1" / "model.safetensors")


def assert_same_weights(run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = exported(run_dir)
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference), "the final weights differ"


@pytest.fixture(scope="module")
def run_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("full_disk")
    return tiny_run_config(work / "run.json", build_shards(work / "shards"), work / "unused")


@pytest.fixture(scope="module")
def reference(run_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights; its checkpoint also checks the launch-time estimate (ZeRO-2, 2 ranks)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    log = run_dir.parent / "launch.log"
    status = finish(launch(run_config, run_dir, log))
    assert status == 0, log.read_text()[-4000:]
    config = load_config(str(run_config), overrides(run_dir))
    footprint = check_config(config, LaunchShape(2, "cpu")).footprint
    written = manifest_bytes(run_dir / "checkpoints" / f"phase1-step{STEPS:07d}")
    assert footprint is not None and written is not None
    assert abs(footprint.checkpoint - written) <= 0.05 * written, (footprint.checkpoint, written)
    return exported(run_dir)


def lines_with(text: str, marker: str) -> list[str]:
    return [line for line in text.splitlines() if marker in line]


@pytest.mark.multirank
def test_a_full_disk_costs_no_checkpoint_and_the_rerun_ends_with_the_same_weights(
        run_config: Path, reference: dict[str, torch.Tensor], tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", 3000) as disk:  # one checkpoint (1.8 MiB) and the rest, not two
        run_dir, log = disk / "run", tmp_path / "launch.log"
        # 1. The launch-time check refuses the folder before any rank starts.
        refused = subprocess.run(["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", "2", "--config",
                                  str(run_config), *overrides(run_dir)], cwd=REPO_ROOT, capture_output=True,
                                 text=True, timeout=120, env={**child_env(), "PYTHON": sys.executable})
        assert refused.returncode == 2 and refused.stdout == "", refused
        assert refused.stderr.startswith(f"launch.sh: config error: run.dir {run_dir}: ") and len(
            refused.stderr.splitlines()) == 1, refused.stderr
        assert "free on its file system, the run needs" in refused.stderr and not run_dir.exists()
        # 2. Launched anyway: step 2's checkpoint fits, every later one fails; the phase end stops the run.
        status = finish(launch(run_config, run_dir, log, "--no-check"))
        text = log.read_text()
        routine = lines_with(text, "training on: the next checkpoint tries again")
        stopping = lines_with(text, "stopping: free space, then rerun the same command")
        assert status == 4, text[-4000:]
        assert len(routine) == 3 and len(stopping) == 1, text[-4000:]  # steps 4, 6, 8; then 10
        for step, line in zip((4, 6, 8, 10), [*routine, *stopping], strict=True):  # the last one: the agent's, the
            line = line.removeprefix("launch.sh: ")  # rank's own line from its log (pretrain/launch/faults.py)
            assert line.startswith(f"checkpoint error: could not write {run_dir / 'checkpoints'}/phase1-step{step:07d}")
            assert "No space left on device" in line and "latest still names phase1-step0000002" in line
        assert "Traceback" not in text
        root = run_dir / "checkpoints"
        assert (root / LATEST).read_text() == "phase1-step0000002" and damage(root / "phase1-step0000002") is None
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["phase1-step0000002"]  # nothing partial
        # 3. More space: the same command resumes from step 2 and ends with the uninterrupted run's weights.
        resize(disk, 16 * 1024)
        log.write_text("")
        status = finish(launch(run_config, run_dir, log, "--no-check"))
        assert status == 0, log.read_text()[-4000:]
        assert "done: complete" in log.read_text() and "checkpoint error" not in log.read_text()
        assert_same_weights(run_dir, reference)


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the rank `rank` of the job writing to `run_dir` (its environment says RANK=...)."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"pretrain.train" in cmdline and str(run_dir).encode() in cmdline and f"RANK={rank}".encode() in environ \
                and b"deepspeed.launcher" not in cmdline:
            return int(entry.name)
    return None


def wait_for(condition, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 600
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within 600 s"
        time.sleep(0.02)


@pytest.mark.multirank
def test_a_rank_whose_write_fails_fails_the_save_on_every_rank(
        run_config: Path, reference: dict[str, torch.Tensor], tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    latest = run_dir / "checkpoints" / LATEST
    proc = launch(run_config, run_dir, log)
    try:
        wait_for(lambda: latest.is_file(), "a first checkpoint", proc, log)
        pid = rank_pid(run_dir, 1)
        assert pid is not None
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 * 1024, hard))  # rank 1's optimizer file is ~660 KiB
        wait_for(lambda: "training on: the next checkpoint" in log.read_text(), "a failed save", proc, log)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))  # the quota lifted: the next save goes through
        status = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    text = log.read_text()
    assert status == 0, text[-4000:]
    failed = lines_with(text, "checkpoint error: could not write")
    assert failed, text[-4000:]
    for line in failed:  # rank 0 wrote its files, yet `latest` stayed on the checkpoint before the failed one
        step = int(re.search(r"/phase1-step(\d{7}) \(", line).group(1))
        assert "(rank 1: zero_pp_rank_1_mp_rank_00_optim_states.pt: [Errno 27] File too large)" in line, line
        assert f"latest still names phase1-step{step - 2:07d}; training on" in line, line
    assert "Traceback" not in text and "done: complete" in text
    assert latest.read_text() == f"phase1-step{STEPS:07d}"
    assert_same_weights(run_dir, reference)
