"""The demo's steps: one `./launch.sh` command each, streamed to the console and a log file, or run in
the background beside the next steps (the random-weights SQuAD baseline takes the core the other
fine-tune leaves idle).

Stopping: every step is started with a parent-death signal (SIGTERM when the demo dies, even of SIGKILL),
and a SIGTERM/SIGHUP to the demo alone is passed on to its running steps. SIGINT is not passed on: a
terminal (or launch.sh) sends Ctrl-C to the demo's whole process group, steps included, and a second
SIGINT would abort a step's checkpoint. The demo then stops after the running steps end (`StopSignal`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.distributed.lifetime import die_with_parent

# The signal that stops the demo (None: none yet), and the steps running now.
received: dict[str, int | None] = {"signal": None}
running: list[subprocess.Popen] = []


class StopSignal(Exception):
    """The demo was signalled; the step that was running has ended."""

    def __init__(self, signum: int, step: str) -> None:
        super().__init__(f"demo: stopped by {signal.Signals(signum).name} during step '{step}'")
        self.signum = signum


def on_signal(signum: int, frame: object) -> None:
    received["signal"] = received["signal"] or signum
    if signum != signal.SIGINT:
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)


def install_signal_handlers() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)


def spawn(argv: list[str], **kwargs: object) -> subprocess.Popen:
    """A step's process: ends with the demo (PR_SET_PDEATHSIG, set from this main thread)."""
    proc = subprocess.Popen(argv, env=demo_env(), preexec_fn=die_with_parent, **kwargs)  # noqa: PLW1509
    running.append(proc)
    return proc


def check_exit(step: Step, returncode: int, log_path: Path) -> None:
    if received["signal"] is not None:
        raise StopSignal(received["signal"], step.name)
    if returncode != 0:
        raise SystemExit(f"demo: step '{step.name}' failed (exit {returncode}); its log: {log_path}")


@dataclass
class Step:
    name: str
    # Built when the step starts: the export's checkpoint path exists only after pretraining.
    argv: Callable[[], list[str]]
    seconds: float = 0.0
    output: list[str] = field(default_factory=list)
    # Runs beside the next steps (its log goes to its file only): the SQuAD fine-tunes are one process
    # each, so the random-weights baseline takes the second core instead of adding minutes.
    background: bool = False
    waits_for: str | None = None  # the background step that must have finished before this one starts
    process: subprocess.Popen | None = None


def start_background(step: Step, log_dir: Path) -> None:
    """Start a background step; `finish_background` collects it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{step.name.replace(' ', '_')}.log"
    print(f"(in the background, log: {log_path})", flush=True)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        step.process = spawn(step.argv(), stdout=log, stderr=subprocess.STDOUT)
    step.seconds = time.monotonic()


def finish_background(step: Step, log_dir: Path) -> None:
    if step.process is None:
        return
    returncode, step.process = step.process.wait(), None
    step.seconds = time.monotonic() - step.seconds
    log_path = log_dir / f"{step.name.replace(' ', '_')}.log"
    step.output = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    check_exit(step, returncode, log_path)


def run_step(step: Step, log_dir: Path, dry_run: bool) -> None:
    """Run one launch.sh command, streaming its output to the console and to a log file."""
    print(f"\n=== {step.name}", flush=True)
    argv = step.argv()
    if dry_run:
        subprocess.run([argv[0], "--dry-run", *argv[1:]], check=False, env=demo_env())
        return
    if step.background:
        start_background(step, log_dir)
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log_path = log_dir / f"{step.name.replace(' ', '_')}.log"
    captured = bytearray()
    with open(log_path, "wb") as log:
        proc = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        # Raw chunks, not lines: progress bars redraw with "\r" and must show as they happen.
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            log.write(chunk)
            captured += chunk
        returncode = proc.wait()
    step.output = captured.decode("utf-8", errors="replace").splitlines()
    step.seconds = time.monotonic() - started
    check_exit(step, returncode, log_path)


def demo_env() -> dict[str, str]:
    """One OpenMP thread per process unless the user chose: the demo's matrices are tiny, and on a
    busy 2-core machine a 2-thread process spin-waits (SQuAD steps measured 4x slower)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
