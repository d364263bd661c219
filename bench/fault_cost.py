"""Benchmark: what a fault costs. A CPU run through ./launch.sh whose ranks are killed every N seconds; goodput and
the median recovery, part by part.

    python bench/fault_cost.py [--kill-every 20] [--kills 5] [--ranks 2] [--steps 400] [--out DIR] [--quick]

A tiny BERT trains one long phase on 2 CPU ranks under the elastic agent (`./launch.sh pretrain --cpu`), with
a checkpoint every 10 steps. Once a process has logged its first step and then run `--kill-every` seconds, one
of its ranks gets SIGKILL (chosen at random, seeded); the agent restarts the job from the newest checkpoint.
After `--kills` faults, the last process trains `--kill-every` seconds more and launch.sh gets SIGTERM (the
ranks checkpoint and exit 0): every pace is an event this process waits for, so the run never ends before
its faults, however fast the machine. From what the run leaves (run_clock.json: each process's start,
its start-up marks and steps; metrics.jsonl) and what this process saw (when it killed, when the old ranks
were gone), each recovery splits into:

    stop          the kill -> the last rank of the old group gone (the agent stops the survivors)
    rendezvous    -> the new ranks' processes start (the agents meet again, the new group is spawned)
    start-up      -> the plan: interpreter and imports, joining the process group, the run's checks
    engine build  -> the model and DeepSpeed engine built
    checkpoint    -> the newest checkpoint loaded (and converted, on another number of ranks)
    first step    -> the first new optimizer step done (compile, first allocations, the data loader)
    replay        the steps the old group had done past the checkpoint, done again (at the new step time)

downtime = the kill -> the first new step; recovery = downtime + replay. Goodput, start-up, the run's downtime and
the steps redone are the run's own figures, by the definition the run and `./launch.sh report` use
(pretrain/metrics/goodput.py: from run_clock.json and the fault records); beside them, what this process's
stopwatch saw: each downtime from its kill rather than from the agent's record, and the wall time from
launch.sh's start to its end (the run's wall leaves out launch.sh's checks before the first process). On 2 CPU
cores the figures are this machine's; what they tell about a GPU cluster is which part to cut (docs/faults.md
projects them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.train_step import synthetic_shards  # noqa: E402
from pretrain.launch.processes import running  # noqa: E402
from pretrain.metrics.clock import ProcessSpan, read_clock_file  # noqa: E402
from pretrain.metrics.goodput import Accounting, account, read_faults, steady_step_seconds  # noqa: E402
from pretrain.run_folder import CLOCK_FILE, shards_verified_path  # noqa: E402

PARTS = ("stop", "rendezvous", "start-up", "engine build", "checkpoint", "first step", "replay")
SEQ_LEN = 32


@dataclass
class Fault:
    """One kill this process made: when, and when the old group was gone."""

    killed_at: float
    rank_pid: int
    old_pids: list[int]
    gone_at: float | None = None


@dataclass
class Observed:
    launched_at: float
    ended_at: float = 0.0
    status: int | None = None
    faults: list[Fault] = field(default_factory=list)


def rank_pids(launcher: int) -> list[int]:
    """The running `pretrain.train` ranks under `launcher` (launch.sh's pid): this benchmark's own, never another
    run's on the same machine (torch starts each rank in a session of its own, so they are told by their parents)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = stat.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pretrain.train" in words and b"-m" in words and descends_from(int(stat.parent.name), launcher):
            found.append(int(stat.parent.name))
    return sorted(found)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is `pid`'s parent, or its parent's, and so on (/proc/PID/stat's fourth field)."""
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


def alive(pid: int) -> bool:
    return running(pid)  # gone, or dead and not yet reaped: not running


def add_ballast(shards: Path, gigabytes: float, seed: int = 1) -> None:
    """More training instances (random full-length rows, written vectorized), `gigabytes` of shard files, listed in
    the manifest: a corpus of a real size for rank 0's shard hashing at start-up, which a CPU toy run lacks."""
    import numpy as np
    import pyarrow as pa

    from data_prep.shard_format.atomic_io import atomic_write_json, sha256_file
    from data_prep.shard_format.shards import shard_schema, write_shard_table

    manifest = json.loads((shards / "manifest.json").read_text(encoding="utf-8"))
    split = manifest["seq_lens"][str(SEQ_LEN)]["train"]
    rows_per_file = 4_000_000  # ~260 MB of uint16 ids at seq 32
    rng = np.random.default_rng(seed)
    for index in range(max(1, round(gigabytes * 1e9 / (rows_per_file * SEQ_LEN * 2)))):
        ids = rng.integers(5, 512, (rows_per_file, SEQ_LEN), dtype=np.uint16)
        ids[:, 0], ids[:, SEQ_LEN // 2], ids[:, -1] = 2, 3, 3  # [CLS] A [SEP] B [SEP]
        offsets = pa.array(np.arange(0, ids.size + 1, SEQ_LEN, dtype=np.int32))
        table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.ravel())),
                          "a_len": pa.array(np.full(rows_per_file, SEQ_LEN // 2 + 1, dtype=np.uint16)),
                          "next_sentence_label": pa.array(rng.integers(0, 2, rows_per_file, dtype=np.int8))},
                         schema=shard_schema(512, static_masking=False))
        rel = f"seq{SEQ_LEN}/train-ballast-{index:05d}.arrow"
        count, sha = write_shard_table(shards / rel, table)
        split["shards"].append({"file": rel, "num_instances": count, "sha256": sha})
        split["num_instances"] += count
    manifest["vocab"]["sha256"] = sha256_file(shards / "vocab.txt")
    atomic_write_json(shards / "manifest.json", manifest)


def write_run(out: Path, steps: int, ranks: int, corpus_gb: float) -> Path:
    shards = synthetic_shards(out / "shards", vocab_size=512, seq_len=SEQ_LEN, count=ranks * 8 * 64)  # epochs repeat
    if corpus_gb > 0:
        add_ballast(shards, corpus_gb)
    config = {
        "run": {"dir": str(out / "run"), "seed": 1, "phases": ["phase1"], "max_restarts": 1000},
        "model": {"preset": "tiny"},
        "data": {"shards": str(shards), "num_workers": 0, "verify_checksums": True},
        "phase1": {"seq_len": SEQ_LEN, "ds_config": str(REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json"),
                   "steps": steps, "lr": 1e-3, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        "checkpoint": {"every_steps": 10, "keep_last": 2, "export_at_phase_end": False},
        "logging": {"progress_bar": False, "val_every_steps": 0, "tensorboard": True},
    }
    path = out / "run.json"
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return path


def drive(run_json: Path, run_dir: Path, args: argparse.Namespace) -> Observed:
    """Launch, kill a rank every `kill_every` seconds of a logging process (`kills` times), then stop the run."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    observed = Observed(launched_at=time.time())
    log = (run_dir.parent / "launch.log").open("w")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen([str(REPO_ROOT / "launch.sh"), "pretrain", "--cpu", "--gpus", str(args.ranks), "--config",
                             str(run_json)], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    rng = random.Random(0)
    try:
        while proc.poll() is None:
            started = wait_for_first_step(run_dir, len(observed.faults), proc)
            if started is None:
                break
            time.sleep(max(0.0, started + args.kill_every - time.time()))
            pids = rank_pids(proc.pid)
            if proc.poll() is not None or not pids:
                break
            if len(observed.faults) == args.kills:  # every fault made and healed: a user's stop ends the run
                os.kill(proc.pid, signal.SIGTERM)
                break
            victim = rng.choice(pids)
            if args.rehash:  # the baseline: forget that this launch hashed its shards, as before the cut
                shards_verified_path(run_dir).unlink(missing_ok=True)
            os.kill(victim, signal.SIGKILL)
            fault = Fault(time.time(), victim, pids)
            observed.faults.append(fault)
            while any(alive(pid) for pid in pids):
                time.sleep(0.02)
            fault.gone_at = time.time()
        observed.status = proc.wait(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    observed.ended_at = time.time()
    return observed


def wait_for_first_step(run_dir: Path, faults: int, proc: subprocess.Popen[bytes]) -> float | None:
    """Unix time of the first step of the process that follows `faults` faults (None: the run ended first)."""
    while proc.poll() is None:
        try:
            spans = read_clock_file(run_dir / CLOCK_FILE)["processes"]
        except (OSError, ValueError):
            spans = []
        if len(spans) > faults and "first_step" in spans[faults].startup:
            span = spans[faults]
            return span.started_at + span.startup["first_step"]
        time.sleep(0.1)
    return None


def recovery(fault: Fault, after: ProcessSpan, index: int, costs: Accounting) -> dict[str, float]:
    """One recovery split into PARTS (seconds, by this process's stopwatch from its kill), with the downtime and the
    whole; and the run's own downtime of it (from the agent's record of the fault, pretrain/metrics/goodput.py)."""
    marks = after.startup
    planned, built = marks.get("planned", 0.0), marks.get("engine_built", marks.get("planned", 0.0))
    loaded = marks.get("checkpoint_loaded", built)
    first = marks.get("first_step", loaded)
    gone = fault.gone_at or fault.killed_at
    parts = {
        "stop": gone - fault.killed_at,
        "rendezvous": after.started_at - gone,
        "start-up": planned,
        "engine build": built - planned,
        "checkpoint": loaded - built,
        "first step": first - loaded,
        "replay": costs.processes[index - 1].redone_steps * steady_step_seconds(after),
    }
    parts["downtime"] = after.started_at + first - fault.killed_at
    parts["recovery"] = parts["downtime"] + parts["replay"]
    outage = costs.outage_before(index)
    parts["run downtime"] = outage.seconds if outage is not None else 0.0
    return parts


def report(observed: Observed, run_dir: Path) -> dict[str, object]:
    spans = read_clock_file(run_dir / CLOCK_FILE)["processes"]
    costs = account(spans, read_faults(run_dir))
    recoveries = [recovery(fault, spans[i + 1], i + 1, costs)
                  for i, fault in enumerate(observed.faults) if i + 1 < len(spans)]
    return {"status": observed.status, "faults": len(observed.faults), "faults_recorded": len(costs.faults),
            "processes": len(spans), "wall_s": costs.wall_s, "productive_s": costs.productive_s,
            "goodput": costs.goodput, "startup_s": costs.startup_s, "downtime_s": costs.downtime_s,
            "redone_steps": costs.redone_steps, "stopwatch_wall_s": observed.ended_at - observed.launched_at,
            "recoveries": recoveries,
            "median": {part: statistics.median(r[part] for r in recoveries) for part in
                       (*PARTS, "downtime", "recovery", "run downtime")} if recoveries else {}}


def print_table(result: dict[str, object]) -> None:
    recoveries, median = result["recoveries"], result["median"]
    print(f"faults {result['faults']} ({result['faults_recorded']} in the fault records), processes "
          f"{result['processes']}, exit status {result['status']}")
    print(f"goodput {result['goodput']:.1%} (the run's definition, as ./launch.sh report gives it): "
          f"{result['productive_s']:.1f} s of kept steps in {result['wall_s']:.1f} s; start-up {result['startup_s']:.1f} s, "
          f"downtime {result['downtime_s']:.1f} s, {result['redone_steps']} step(s) redone; launch.sh ran "
          f"{result['stopwatch_wall_s']:.1f} s by this process's stopwatch")
    header = ["#", *PARTS, "downtime", "recovery", "run downtime"]
    print(" | ".join(f"{h:>12}" for h in header))
    for index, parts in enumerate(recoveries, 1):  # type: ignore[arg-type]
        print(" | ".join([f"{index:>12}", *(f"{parts[p]:>12.2f}" for p in header[1:])]))
    if median:
        print(" | ".join(["median".rjust(12), *(f"{median[p]:>12.2f}" for p in header[1:])]))  # type: ignore[index]
        largest = max(PARTS, key=lambda part: median[part])  # type: ignore[index]
        print(f"largest part of a recovery: {largest} ({median[largest]:.2f} s of {median['recovery']:.2f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/fault_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds of training between kills")
    parser.add_argument("--kills", type=int, default=5, help="faults to inject, then the run finishes")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1_000_000, help="optimizer steps of the run (it is stopped first)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole run may take")
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a new temporary one)")
    parser.add_argument("--corpus-gb", type=float, default=0.0,
                        help="add this many GB of training shards (rank 0 hashes them at start-up, as on a real corpus)")
    parser.add_argument("--quick", action="store_true", help="2 kills 3 s apart (the test's mode)")
    parser.add_argument("--compare", action="store_true",
                        help="run the scenario twice: first with every restart re-hashing the shards (the baseline, "
                             "as before logs/shards_verified.json), then as the toolkit runs; print both and the ratio")
    args = parser.parse_args(argv)
    if args.quick:
        args.kill_every, args.kills = 3.0, 2
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_fault_cost_"))
    out.mkdir(parents=True, exist_ok=True)
    modes = [("baseline: every restart re-hashes the shards", True), ("toolkit", False)] if args.compare else \
        [("toolkit", False)]
    results = {}
    for name, rehash in modes:
        work = out / ("baseline" if rehash else "toolkit")
        work.mkdir(exist_ok=True)
        run_json = write_run(work, args.steps, args.ranks, args.corpus_gb)
        observed = drive(run_json, work / "run", argparse.Namespace(**{**vars(args), "rehash": rehash}))
        results[name] = report(observed, work / "run")
        print(f"== {name}")
        print_table(results[name])
        if observed.status != 0:
            print(f"error: the run ended with status {observed.status} (its log: {work / 'launch.log'})")
            return 1
    (out / "fault_cost.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    if args.compare:
        base, ours = results[modes[0][0]]["median"], results[modes[1][0]]["median"]
        print(f"median recovery {ours['recovery']:.2f} s vs {base['recovery']:.2f} s re-hashing "
              f"({ours['recovery'] / base['recovery']:.2f}x); start-up {ours['start-up']:.2f} s vs "
              f"{base['start-up']:.2f} s ({ours['start-up'] / base['start-up']:.2f}x)")
    print(f"(the runs and their logs: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
