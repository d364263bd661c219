"""Signals that stop a job, for real: launch.sh on 2 CPU ranks through the DeepSpeed launcher, and the
SLURM batch script run by bash with a stand-in `scontrol` that records its arguments (no SLURM here).

Ctrl-C, a supervisor's SIGTERM to launch.sh's process group, and SIGHUP must make the ranks checkpoint
and exit; a SIGKILL of launch.sh or of its group must leave no process of the job behind; the same
command then resumes, and completes with every step logged once. A stale build lock planted in the
job's own TORCH_EXTENSIONS_DIR is removed with one line.
The batch script must requeue itself after a SIGUSR1 stop only: not after a cancel (SIGTERM), a
completed run or a configuration error. Each signal comes while the ranks wait before a known step (a hold file,
tests/support/launching.py Hold), so it lands mid-phase however fast the machine is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.launching import Hold, child_env, copy_machine_op_build, free_port
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

# Each launch trains one step past its resume point before its signal (the hold), five of them in the longest test,
# and the last launch trains the rest: a phase long enough that every stop lands inside it, and no longer.
STEPS = 12


def job_env(**extra: str) -> dict[str, str]:
    """This environment without SLURM_* (launch.sh would pick srun) and with one thread per rank."""
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_") and k != "DS_ACCELERATOR"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    return env


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    return path.read_text().count('"phase"') if path.is_file() else 0


# Every signal at its default, as a terminal's shell starts a command. A pytest started in the background of
# a non-interactive shell (`pytest &`) has SIGINT ignored, under nohup SIGHUP too; every child inherits that,
# and a shell that starts with a signal ignored cannot trap it: launch.sh would never see the test's Ctrl-C.
DEFAULT_SIGNALS = ["env", "--default-signal"]


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A session of its own: killpg reaches exactly this job's process group, never pytest's. `env` execs
    # launch.sh in place, so the pid is launch.sh's.
    with log.open("ab") as out:
        return subprocess.Popen([*DEFAULT_SIGNALS, *cmd], cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def signal_once_training(
    proc: subprocess.Popen[bytes], run_dir: Path, log: Path, signum: int, whole_group: bool = False,
    check: Callable[[], None] | None = None, hold: Hold | None = None,
) -> int:
    """Wait for the first optimizer step of this launch (the trainer's handlers are installed), run `check`,
    send `signum` to its pid (or its whole process group), and return its exit status. With `hold` (set before the
    launch at its second step), the ranks wait before that step until the signal is out: it lands mid-phase
    whatever the machine's speed."""
    before = logged_steps(run_dir)
    deadline = time.monotonic() + 600
    while logged_steps(run_dir) <= before:
        assert proc.poll() is None, f"exited {proc.returncode} before training:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, "no training step within 600 s"
        time.sleep(0.1)
    if check is not None:
        check()
    if whole_group:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    if hold is not None:
        hold.release()
    return proc.wait(timeout=600)


def hold_second_step(hold: Hold, run_dir: Path) -> Hold:
    """Hold the next launch of `run_dir` before its second step: the one after its resume point's next."""
    path = run_dir / "checkpoints" / "latest"
    done = int(path.read_text().strip().rpartition("step")[2]) if path.is_file() else 0
    return hold.at(done + 2)


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in arg for arg in args):
            found.append(f"{cmdline.parent.name}: {b' '.join(args).decode(errors='replace')}")
    return found


def latest_state(run_dir: Path) -> dict:
    checkpoints = run_dir / "checkpoints"
    tag = (checkpoints / "latest").read_text().strip()
    return json.loads((checkpoints / tag / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def run_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("launch_signals")
    shards = build_shards(work / "shards", seq_lens=(32,), train=64, val=8)
    return tiny_run_config(work / "tiny.json", shards, work / "unused")


def overrides(run_dir: Path) -> list[str]:
    return [f"--run.dir={run_dir}", '--run.phases=["phase1"]', f"--phase1.steps={STEPS}",
            "--checkpoint.every_steps=1000", "--checkpoint.export_at_phase_end=false",
            "--logging.val_every_steps=1000",
            "--run.survivor_stacks=false"]  # 1b's fault: no stacks asserted here (test_faults.py does), a second saved


def private_extensions(root: Path) -> Path:
    """A TORCH_EXTENSIONS_DIR of this test's own, holding a copy of this machine's build of DeepSpeed's CPU
    communication op (loaded in seconds; compiled there when the machine has none) and a stale lock."""
    lock = copy_machine_op_build(root) / "lock"
    lock.touch()  # left by a compile killed midway: no process holds it
    return lock


def job_pids(run_dir: Path) -> list[int]:
    return [int(line.split(":")[0]) for line in processes_mentioning(str(run_dir))]


def rank_pids(run_dir: Path) -> list[int]:
    """The pids of the driver's ranks of the run in `run_dir` (not launch.sh, its agent or its watchdog)."""
    return [int(line.split(":")[0]) for line in processes_mentioning(str(run_dir)) if " -m pretrain.train " in line]


def wait_for_no_process_of(text: Path | str) -> list[str]:
    deadline = time.monotonic() + 120  # only limits a failing wait
    while processes_mentioning(str(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_mentioning(str(text))


def logged_step_numbers(run_dir: Path) -> list[int]:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"phase"' in line]


@pytest.mark.multirank
def test_signals_stop_with_a_checkpoint_and_leave_no_process_behind(run_config: Path, tmp_path: Path) -> None:
    """One run folder through six launches: Ctrl-C mid-phase, SIGTERM while the ranks restarted after a fault start,
    SIGHUP, SIGKILL of launch.sh and of its group, then a complete run that logged every step once."""
    run_dir = tmp_path / "run"
    log = tmp_path / "launch.log"
    extensions = tmp_path / "extensions"
    stale_lock = private_extensions(extensions)
    hold = Hold(tmp_path / "hold")
    env = job_env(TORCH_EXTENSIONS_DIR=str(extensions), **hold.env)
    cmd = ["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", "2", "--master-port",
           str(free_port()), "--config", str(run_config), *overrides(run_dir)]

    # 1. Ctrl-C (SIGINT to launch.sh): a checkpoint, one line, no traceback, exit 130. The planted stale lock
    #    was removed with one line, and the ranks loaded the op from the private extensions folder.
    proc = start(cmd, log, env)
    status = signal_once_training(proc, run_dir, log, signal.SIGINT, check=lambda: loaded_from(run_dir, extensions),
                                  hold=hold_second_step(hold, run_dir))
    text = log.read_text()
    assert status == 130, text[-4000:]
    assert text.count("SIGINT: stopping with a checkpoint") == 1 and "done: SIGINT" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert text.count(f"removed stale lock {stale_lock}") == 1 and not stale_lock.exists()
    first = latest_state(run_dir)  # the only checkpoint: every_steps is beyond the phase
    assert first["phase"] == "phase1" and not first["complete"] and 0 < first["step"] < STEPS
    assert wait_for_no_process_of(run_dir) == []

    # 1b. A fault (rank 1 killed while the ranks wait before their second step), then, once the restarted ranks
    #     exist, SIGTERM to launch.sh while they start (their interpreters just started, no handler yet: the agent
    #     passes it on once they have one): a stop, not a second fault, one line, a checkpoint at their first
    #     step, exit 0. The window where the flaky 143 came from: a stop 3 s into a restarted process.
    hold_second_step(hold, run_dir)
    proc = start(cmd, log, env)
    before = logged_steps(run_dir)
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) <= before:  # held before its second step
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    killed = {pid for pid in rank_pids(run_dir)}
    os.kill(max(killed), signal.SIGKILL)
    while not (log.read_text().count("launch.sh: fault:") == 1 and len(set(rank_pids(run_dir)) - killed) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    hold.release()
    status = proc.wait(timeout=600)
    text = log.read_text()
    assert status == 0, text[-4000:]
    assert text.count(f"stopped (SIGTERM) at phase1 step {first['step'] + 1}; checkpoint") == 1, text[-4000:]
    assert latest_state(run_dir)["step"] == first["step"] + 1 and "Traceback" not in text
    assert text.count("launch.sh: fault:") == 1 and "launch.sh: error:" not in text  # the stop is no fault
    assert wait_for_no_process_of(run_dir) == []
    first = latest_state(run_dir)

    # 2. The same command resumes; SIGHUP to its whole process group (a closed terminal) is passed on as SIGTERM:
    #    a checkpoint again, exit 0. (SIGTERM itself takes the same path in launch.sh and the ranks.)
    hold_second_step(hold, run_dir)
    status = signal_once_training(start(cmd, log, env), run_dir, log, signal.SIGHUP, whole_group=True, hold=hold)
    assert status == 0, log.read_text()[-4000:]
    assert wait_for_no_process_of(run_dir) == []
    third = latest_state(run_dir)
    assert first["step"] < third["step"] < STEPS

    # 3. SIGKILL of launch.sh alone, mid-training: its watchdog stops the ranks (they checkpoint on its SIGTERM).
    hold_second_step(hold, run_dir)
    proc = start(cmd, log, env)
    signal_once_training(proc, run_dir, log, signal.SIGKILL, hold=hold)
    assert wait_for_no_process_of(run_dir) == []
    assert "launch.sh (pid " in log.read_text()
    assert third["step"] < latest_state(run_dir)["step"] < STEPS

    # 4. SIGKILL of launch.sh's whole group while the ranks start: nothing is left either.
    proc = start(cmd, log, env)
    deadline = time.monotonic() + 300
    while len(job_pids(run_dir)) < 4 and time.monotonic() < deadline:  # launch.sh, the elastic agent, 2 ranks
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_for_no_process_of(run_dir) == []
    watchdogs = [line for line in processes_mentioning("pretrain.distributed.lifetime") if f" watch {proc.pid} " in line]
    assert wait_for_no_process_of(run_dir) == [] and all(wait_for_no_process_of(w.split(":")[0]) == []
                                                         for w in watchdogs)  # the watchdog ended too

    # 5. Once more, unsignalled: it resumes and completes the phase, every step logged once.
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "done: complete" in done.stdout
    final = latest_state(run_dir)
    assert final["complete"] and final["step"] == STEPS
    assert logged_step_numbers(run_dir) == list(range(1, STEPS + 1))


def loaded_from(run_dir: Path, extensions: Path) -> None:
    """Every rank of the job has mapped the communication op's library from `extensions`."""
    ranks = [pid for pid in job_pids(run_dir)
             if b"pretrain.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
             and b"deepspeed.launcher" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 2, processes_mentioning(str(run_dir))
    for pid in ranks:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert f"{extensions}/deepspeed_shm_comm/deepspeed_shm_comm.so" in maps, f"rank {pid} did not load it there"


@pytest.mark.multirank
def test_batch_script_requeues_only_after_a_usr1_stop(run_config: Path, tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "scontrol.calls"
    (fake_bin / "scontrol").write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    (fake_bin / "scontrol").chmod(0o755)
    hold = Hold(tmp_path / "hold")
    # SLURM_SUBMIT_DIR: where the script leaves its requeue note (the job's submit folder), never the checkout.
    env = job_env(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(tmp_path), PATH=f"{fake_bin}:{os.environ['PATH']}",
                  **hold.env)
    note = tmp_path / "bert-pretrain-4242.requeue"
    run_dir = tmp_path / "run"
    log = tmp_path / "sbatch.log"
    # One plain CPU process, so that no srun is needed; the script's own logic runs unchanged.
    cmd = ["bash", str(REPO_ROOT / "slurm" / "slurm_pretrain.sbatch"), str(run_config), "--launcher", "none",
           "--cpu", *overrides(run_dir)]

    def requeues() -> list[str]:
        return calls.read_text().splitlines() if calls.exists() else []

    # SIGUSR1 to the batch shell, as `#SBATCH --signal=B:USR1@600` sends it: checkpoint, exit 0, requeue.
    hold_second_step(hold, run_dir)
    status = signal_once_training(start(cmd, log, env), run_dir, log, signal.SIGUSR1, hold=hold)
    assert status == 0, log.read_text()[-4000:]
    assert "done: SIGUSR1" in log.read_text()
    assert requeues() == ["requeue 4242"]
    assert "time-limit stop (SIGUSR1)" in note.read_text()
    first = latest_state(run_dir)
    assert not first["complete"]

    # scancel (SIGTERM): the ranks checkpoint, and the job is not requeued.
    hold_second_step(hold, run_dir)
    status = signal_once_training(start(cmd, log, env), run_dir, log, signal.SIGTERM, hold=hold)
    assert status == 0, log.read_text()[-4000:]
    assert requeues() == ["requeue 4242"]
    assert first["step"] < latest_state(run_dir)["step"] < STEPS

    # The requeued job (SLURM counts the restart) says why it runs again, resumes and completes: no requeue.
    done = subprocess.run(cmd, cwd=REPO_ROOT, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "done: complete" in done.stdout and latest_state(run_dir)["complete"]
    assert "runs again (requeue 1: this script requeued it after a time-limit stop" in done.stdout
    assert requeues() == ["requeue 4242"] and not note.exists()

    # A configuration error keeps its status (2) and is not requeued.
    bad = subprocess.run([*cmd, "--phase1.steps=0"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "phase1.steps: must be > 0" in bad.stderr + bad.stdout
    assert requeues() == ["requeue 4242"]
