"""Runs that heal themselves, for real: `./launch.sh pretrain` on 2 CPU ranks under the elastic agent
(pretrain/launch/agent.py), with ranks killed, frozen and failing on purpose.

Each healed run must end with the same weights as one uninterrupted run of the same command (shared by the
module: on CPU in fp32, exact resume on the same number of ranks is bitwise), and the terminal must tell the
story in one line per fault, with no traceback: kill -9 and SIGSTOP of a rank with restarts on; kill -9 with
restarts off (one error line, exit status 1, nothing left running, and its resume command finishes the
run); a failure at the same step twice (restarts stop: a bug, not a fault); a shard whose sha256 differs from
its manifest (one line, exit 2, no restart).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from safetensors.torch import load_file

from tests.launch.test_signals import job_env, processes_mentioning, start, wait_for_no_process_of
from tests.support.launching import free_port
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

pytestmark = pytest.mark.multirank

STEPS, EVERY = 24, 4
HANG_MINUTES = 0.1  # 6 s: a tiny step takes well under a second, even on a loaded machine


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    shards = build_shards(root / "shards", seq_lens=(32,), train=64, val=8)
    tiny_run_config(root / "run.json", shards, root / "unused", phase1=STEPS)
    return root


def command(work: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["bash", str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", "2", "--master-port",
            str(free_port()), "--config", str(work / "run.json"), f"--run.dir={run_dir}", '--run.phases=["phase1"]',
            f"--checkpoint.every_steps={EVERY}", "--logging.val_every_steps=1000", *extra]


def run_to_end(cmd: list[str], log: Path) -> int:
    proc = start(cmd, log, job_env())
    try:
        return proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "export" / "phase1" / "model.safetensors"))


def same_weights(run_dir: Path, reference: dict[str, torch.Tensor]) -> bool:
    healed = weights(run_dir)
    return healed.keys() == reference.keys() and all(torch.equal(healed[k], reference[k]) for k in reference)


@pytest.fixture(scope="module")
def reference(work: Path) -> dict[str, torch.Tensor]:
    """The uninterrupted run every healed run is compared with."""
    run_dir = work / "reference"
    status = run_to_end(command(work, run_dir), work / "reference.log")
    assert status == 0, (work / "reference.log").read_text()[-4000:]
    return weights(run_dir)


def last_step(run_dir: Path) -> int:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = [json.loads(line)["step"] for line in lines if '"phase"' in line]
    return steps[-1] if steps else 0


def rank_pid(run_dir: Path, rank: int) -> int:
    for line in processes_mentioning(str(run_dir)):
        pid = int(line.split(":")[0])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b" -m pretrain.train " in line.encode() and f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} running: {processes_mentioning(str(run_dir))}")


def when(run_dir: Path, log: Path, step: int, faults: int) -> None:
    """Wait until the run has logged `step` after `faults` fault lines (a restart rewinds the steps)."""
    deadline = time.monotonic() + 600
    while not (log.read_text().count("launch.sh: fault:") == faults and last_step(run_dir) >= step):
        assert time.monotonic() < deadline, f"step {step} not reached:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def fault_lines(text: str) -> list[str]:
    return re.findall(r"^launch\.sh: (?:fault|error): .*$", text, re.MULTILINE)


def test_a_killed_and_a_frozen_rank_heal_to_the_same_weights(work: Path, reference: dict, tmp_path: Path) -> None:
    """kill -9 of rank 1, then after the restart SIGSTOP of rank 0: two restarts, one line each, and the
    weights of the uninterrupted run."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    proc = start(command(work, run_dir, f"--run.hang_timeout_minutes={HANG_MINUTES}"), log, job_env())
    try:
        when(run_dir, log, 6, faults=0)
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        when(run_dir, log, 14, faults=1)
        os.kill(rank_pid(run_dir, 0), signal.SIGSTOP)
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 0, text[-4000:]
    killed, frozen = fault_lines(text)
    assert re.search(r"rank 1 \(host \S+\) died of SIGKILL at phase1 step \d+; restarting from checkpoint "
                     r"phase1-step\d+ \(restart 1 of 3\); log: \S+rank-1\.log$", killed), killed
    assert re.search(r"rank 0 \(host \S+\) made no progress in 0\.1 min \(stopped by SIGSTOP\): killed at phase1 "
                     r"step \d+; restarting from checkpoint phase1-step\d+ \(restart 2 of 3\)", frozen), frozen
    assert Path(killed.rpartition("log: ")[2]).is_file()
    assert "Traceback" not in text and text.count("done: complete") == 2
    assert same_weights(run_dir, reference)
    assert wait_for_no_process_of(run_dir) == []


def test_with_restarts_off_one_line_names_the_rank_and_the_resume_command(work: Path, reference: dict,
                                                                           tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    proc = start(command(work, run_dir, "--run.max_restarts=0"), log, job_env())
    try:
        when(run_dir, log, 6, faults=0)
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 1, text[-4000:]
    assert wait_for_no_process_of(run_dir) == []
    (line,) = fault_lines(text)
    assert re.search(r"^launch\.sh: error: rank 1 \(host \S+\) died of SIGKILL at phase1 step \d+; no restart left "
                     r"\(run\.max_restarts=0\); last checkpoint phase1-step\d+; log: \S+; resume with: \./launch\.sh "
                     r"pretrain ", line), line
    assert "Traceback" not in text and "done:" not in text
    resume = shlex.split(line.partition("resume with: ")[2])
    assert run_to_end(["bash", str(REPO_ROOT / "launch.sh"), *resume[1:]], log) == 0, log.read_text()[-4000:]
    assert same_weights(run_dir, reference)


def out_of_vocabulary_shards(folder: Path) -> Path:
    """Shards whose every token id is beyond the vocab, their checksums unchecked: the model's embedding fails
    on the first step, every time (a data bug no restart can heal)."""
    build_shards(folder, seq_lens=(32,), train=64, val=8)
    for shard in folder.rglob("train-*.arrow"):
        with ipc.open_file(shard) as reader:
            table = reader.read_all()
        ids = table.column("input_ids")
        bad = pa.array([[65000] * len(row) for row in ids.to_pylist()], type=ids.type)
        table = table.set_column(table.schema.get_field_index("input_ids"), table.schema.field("input_ids"), bad)
        with ipc.new_file(shard, table.schema) as writer:
            writer.write_table(table)
    return folder


def test_a_failure_at_the_same_step_again_stops_the_restarts(work: Path, tmp_path: Path) -> None:
    """Every attempt fails at step 1 with no checkpoint in between: one restart, then one error line (a bug,
    not a fault), exit status 1, nothing left running; the traceback only in the rank's log."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    shards = out_of_vocabulary_shards(tmp_path / "shards")
    status = run_to_end(command(work, run_dir, f"--data.shards={shards}", "--data.verify_checksums=false"), log)
    text = log.read_text()
    assert status == 1, text[-4000:]
    fault, error = fault_lines(text)
    assert "at phase1 step 1; restarting from the start (no checkpoint yet) (restart 1 of 3)" in fault, fault
    assert "at phase1 step 1; the same failure as the last one" in error and "a bug, not a fault" in error, error
    assert "Traceback" not in text and wait_for_no_process_of(run_dir) == []
    assert "Traceback" in Path(error.split("; log: ")[1].split(";")[0]).read_text()


def test_a_start_up_error_of_the_ranks_is_one_line_and_status_2(work: Path, tmp_path: Path) -> None:
    """A shard whose sha256 differs from the manifest is found by rank 0 at start-up (the launch check does not
    hash): one line, exit 2, no restart, nothing of the launcher's or a C++ runtime's."""
    shards = tmp_path / "shards"
    build_shards(shards, seq_lens=(32,), train=64, val=8)
    shard = next(p for p in sorted(shards.rglob("*")) if p.is_file() and p.suffix not in (".json", ".txt"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    log = tmp_path / "launch.log"
    status = run_to_end(command(work, tmp_path / "run", f"--data.shards={shards}"), log)
    text = log.read_text()
    assert status == 2, text[-4000:]
    errors = [line for line in text.splitlines() if "sha256" in line]
    assert len(errors) == 1 and errors[0].startswith("launch.sh: config error: data.shards: "), text[-4000:]
    assert not fault_lines(text) and "Traceback" not in text and "terminate called" not in text
