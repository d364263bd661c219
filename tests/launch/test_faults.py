"""Runs that heal themselves, for real: `./launch.sh pretrain` on 2 CPU ranks under the elastic agent
(pretrain/launch/agent.py), with ranks killed, frozen and failing on purpose.

Each healed run must end with the same weights as one uninterrupted run of the same command (shared by the
module: on CPU in fp32, exact resume on the same number of ranks is bitwise), and the terminal must tell the
story in one line per fault, with no traceback: kill -9 of a rank, a rank frozen (SIGSTOP) before its first step
and one frozen mid-phase, with restarts on; kill -9 with restarts off (one error line, exit status 1, nothing left
running, and its resume command finishes the run); a failure at the same step twice (restarts stop: a bug, not a
fault); a shard whose sha256 differs from its manifest (one line, exit 2, no restart).

Paced by the run, not by the machine: a hold file (tests/support/launching.py Hold) stops every rank before a
given step until the test has acted, and a rank is frozen before its first step once it can write its stacks.
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

from pretrain.distributed.step_watch import STACKS_SIGNAL
from pretrain.launch.processes import catches
from tests.launch.test_signals import job_env, processes_mentioning, start, wait_for_no_process_of
from tests.support.launching import Hold, free_port
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config
from tests.support.rendezvous_intruder import Intruder

pytestmark = pytest.mark.multirank

# A checkpoint every 4 steps; the longest test acts before steps 7 and 11 and then at the end (step 12, a checkpoint):
# 12 steps are enough, and every step more is one more in each of the module's full runs.
STEPS, EVERY = 12, 4
HANG_MINUTES = 0.1  # 6 s: a tiny step takes well under a second, even on a loaded machine
# 30 s: each start-up stage (imports; joining the job; the resume checks; the engine; the first step) of a tiny run
# takes a few seconds on 2 cores, and twice that beside another test; the clock starts again at each stage
STARTUP_MINUTES = 0.5


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
    """The uninterrupted run every healed run is compared with; meanwhile someone who reaches its rendezvous store
    plants a pickle and a forged "closed" state there (test_a_pickle_planted_in_the_live_rendezvous_store_runs_nothing)."""
    run_dir, cmd = work / "reference", command(work, work / "reference")
    with Intruder(int(cmd[cmd.index("--master-port") + 1]), work / "planted-marker") as intruder:
        status = run_to_end(cmd, work / "reference.log")
    assert status == 0, (work / "reference.log").read_text()[-4000:]
    (work / "planted-count").write_text(str(intruder.planted))
    return weights(run_dir)


def test_a_pickle_planted_in_the_live_rendezvous_store_runs_nothing(work: Path, reference: dict) -> None:
    """The store's key, listed by a client of the one-machine agent's store, holds a pickle that writes a marker, then
    a forged closed state: none is unpickled, the run ends as uninterrupted (its weights are everyone's reference),
    and one line names the store (tests/support/rendezvous_intruder.py)."""
    del reference
    log = (work / "reference.log").read_text()
    assert int((work / "planted-count").read_text()) >= 1 and not (work / "planted-marker").exists()
    assert log.count("launch.sh: warning: the rendezvous store at 127.0.0.1:") == 1, log[-4000:]


def last_step(run_dir: Path) -> int:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = [json.loads(line)["step"] for line in lines if '"phase"' in line]
    return steps[-1] if steps else 0


def rank_pid(run_dir: Path, rank: int, other_than: int = 0, wait_s: float = 0.0) -> int:
    """The pid of rank `rank` of the run (a new one: not `other_than`), waiting up to `wait_s` for it."""
    deadline = time.monotonic() + wait_s
    while True:
        for line in processes_mentioning(str(run_dir)):
            pid = int(line.split(":")[0])
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b" -m pretrain.train " in line.encode() and f"RANK={rank}".encode() in environ and pid != other_than:
                return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no rank {rank} running: {processes_mentioning(str(run_dir))}")
        time.sleep(0.05)


def when(run_dir: Path, log: Path, step: int, faults: int) -> None:
    """Wait until the run has logged `step` after `faults` fault lines (a restart rewinds the steps)."""
    deadline = time.monotonic() + 600
    while not (log.read_text().count("launch.sh: fault:") == faults and last_step(run_dir) >= step):
        assert time.monotonic() < deadline, f"step {step} not reached:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def freeze_once_it_can_tell(pid: int) -> None:
    """SIGSTOP `pid` once it can write its stacks (its handler for them is installed, the first thing the driver
    does): then still in start-up, seconds before its first step."""
    deadline = time.monotonic() + 120
    while not catches(pid, STACKS_SIGNAL):
        assert time.monotonic() < deadline, f"rank {pid} never installed its stacks handler"
        time.sleep(0.02)
    os.kill(pid, signal.SIGSTOP)


def fault_lines(text: str) -> list[str]:
    return re.findall(r"^launch\.sh: (?:fault|error): .*$", text, re.MULTILINE)


def test_a_killed_and_two_frozen_ranks_heal_to_the_same_weights(work: Path, reference: dict, tmp_path: Path) -> None:
    """kill -9 of rank 1; then, in the restart, rank 1 frozen before its first step (the start-up limit names it);
    then rank 0 frozen mid-phase; then both ranks hung on their way out after the last step: four restarts, one line
    each, the frozen ranks' stacks in their logs, and the weights of the uninterrupted run. With
    run.max_restarts=2: the budget counts the faults since the checkpoint the job restarts from, and the third and
    fourth faults come after newer ones (before, the third ended the job: 3 restarts > 2). The rank the fault did not
    hit is killed at once, its stacks written (run.survivor_stacks), not asked to stop: no 'done: stopped'."""
    run_dir, log, hold = tmp_path / "run", tmp_path / "launch.log", Hold(tmp_path / "hold").at(7)
    proc = start(command(work, run_dir, f"--run.hang_timeout_minutes={HANG_MINUTES}", "--run.max_restarts=2",
                         f"--run.startup_timeout_minutes={STARTUP_MINUTES}"), log, job_env(**hold.env))
    try:
        when(run_dir, log, 6, faults=0)  # held before step 7
        killed = rank_pid(run_dir, 1)
        os.kill(killed, signal.SIGKILL)
        when(run_dir, log, 6, faults=1)  # rank 0, still held, was asked for its stacks and killed
        hold.at(11)
        freeze_once_it_can_tell(rank_pid(run_dir, 1, other_than=killed, wait_s=120))
        when(run_dir, log, 10, faults=2)  # held before step 11
        os.kill(rank_pid(run_dir, 0), signal.SIGSTOP)
        hold.at_teardown()  # rank 1 goes on alone into step 11's collective; after the restart, both hang at the end
        when(run_dir, log, STEPS, faults=4)  # the teardown limit (the smaller: the hang limit, 6 s) ran out
        hold.release()
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 0, text[-4000:]
    killed_line, start_up, frozen, teardown = fault_lines(text)
    assert re.search(r"rank 1 \(host \S+\) died of SIGKILL at phase1 step 6; restarting from checkpoint "
                     r"phase1-step0000004 \(restart 1 of 2\); log: \S+rank-1\.log$", killed_line), killed_line
    assert re.search(r"rank 1 \(host \S+\) made no progress in 0\.5 min \(stopped by SIGSTOP; "
                     r"run\.startup_timeout_minutes\): killed during start-up; restarting from checkpoint "
                     r"phase1-step0000004 \(restart 2 of 2\); log: \S+rank-1\.log$", start_up), start_up
    assert re.search(r"rank 0 \(host \S+\) made no progress in 0\.1 min \(stopped by SIGSTOP; "
                     r"run\.hang_timeout_minutes\): killed at phase1 step 10; restarting from checkpoint "
                     r"phase1-step0000008 \(restart 1 of 2\)", frozen), frozen
    assert re.search(r"rank \d \(host \S+\) made no progress in 0\.1 min \(running but not progressing; "
                     r"run\.hang_timeout_minutes\): killed during teardown; restarting from checkpoint "
                     rf"phase1-step{STEPS:07d} \(restart 1 of 2\)", teardown), teardown
    assert Path(killed_line.rpartition("log: ")[2]).is_file()
    for line, waiting in ((start_up, "rank-0.log"), (frozen, "rank-1.log")):  # the peer that waited for the frozen
        peer = Path(line.rpartition("log: ")[2].split(";")[0]).with_name(waiting)  # one: its stacks, in its log
        assert "most recent call first" in peer.read_text(), line
    survivor = Path(killed_line.rpartition("log: ")[2]).with_name("rank-0.log").read_text()  # stacks, then SIGKILL
    assert "most recent call first" in survivor and "in _hold" in survivor, survivor[-3000:]
    assert "Traceback" not in text and text.count("done: complete") == 2
    assert "stopped (" not in text and not re.search(r"^done: (?!complete)", text, re.MULTILINE)  # no rank stopped
    assert same_weights(run_dir, reference)
    assert wait_for_no_process_of(run_dir) == []
    records = [json.loads(path.read_text()) for path in sorted((run_dir / "logs" / "faults").glob("*.json"))]
    assert [(r["restart"], r["kind"], r["step"], r["checkpoint"]) for r in records] == [
        (0, "signal", "phase1 step 6", "phase1-step0000004"), (1, "hang", "start-up", "phase1-step0000004"),
        (2, "hang", "phase1 step 10", "phase1-step0000008"), (3, "hang", "teardown", f"phase1-step{STEPS:07d}")]


def test_with_restarts_off_one_line_names_the_rank_and_the_resume_command(work: Path, reference: dict,
                                                                           tmp_path: Path) -> None:
    run_dir, log, hold = tmp_path / "run", tmp_path / "launch.log", Hold(tmp_path / "hold").at(7)
    # no survivor stacks (run.survivor_stacks=false): asserted in the test above, here a second of waiting at the fault
    proc = start(command(work, run_dir, "--run.max_restarts=0", "--run.survivor_stacks=false"), log,
                 job_env(**hold.env))
    try:
        when(run_dir, log, 6, faults=0)  # held before step 7
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        hold.release()
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 1, text[-4000:]
    assert wait_for_no_process_of(run_dir) == []
    (line,) = fault_lines(text)
    assert re.search(r"^launch\.sh: error: rank 1 \(host \S+\) died of SIGKILL at phase1 step 6; no restart left "
                     r"\(run\.max_restarts=0\); last checkpoint phase1-step0000004; log: \S+; resume with: "
                     r"\./launch\.sh pretrain ", line), line
    assert "Traceback" not in text and "done:" not in text
    resume = shlex.split(line.partition("resume with: ")[2])
    assert run_to_end(["bash", str(REPO_ROOT / "launch.sh"), *resume[1:]], log) == 0, log.read_text()[-4000:]
    assert same_weights(run_dir, reference)


def undefined_label_shards(folder: Path) -> Path:
    """Shards whose every next-sentence label is 7 (the format's are 0, 1 and -1), their values unchecked
    (data.verify_checksums=false): the NSP loss fails on the first step, every time (a data bug no restart can
    heal; an id outside the vocab no longer is one, the collate refuses it in one line)."""
    build_shards(folder, seq_lens=(32,), train=64, val=8)
    for shard in folder.rglob("train-*.arrow"):
        with ipc.open_file(shard) as reader:
            table = reader.read_all()
        field = table.schema.get_field_index("next_sentence_label")
        table = table.set_column(field, table.schema.field(field), pa.array([7] * table.num_rows, type=pa.int8()))
        with ipc.new_file(shard, table.schema) as writer:
            writer.write_table(table)
    return folder


def test_a_failure_at_the_same_step_again_stops_the_restarts(work: Path, tmp_path: Path) -> None:
    """Every attempt fails at step 1 with no checkpoint in between: one restart, then one error line (a bug,
    not a fault), exit status 1, nothing left running; the traceback only in the rank's log."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    shards = undefined_label_shards(tmp_path / "shards")
    status = run_to_end(command(work, run_dir, f"--data.shards={shards}", "--data.verify_checksums=false",
                                "--run.survivor_stacks=false"), log)  # stacks: asserted in the first fault test
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
