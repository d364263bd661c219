"""When a step checkpoint is due: every `checkpoint.every_steps` optimizer steps or every
`checkpoint.every_minutes` of wall-clock time, whichever comes first (a phase end and a stop always
write one besides).

Why a clock: a fixed step count costs a different share of the run at every GPU count. BERT-Large
phase 1 does 200 optimizer steps in about a minute on 256 GPUs and in about 20 minutes on 8, while a
save costs several seconds of serial work on any count. Minutes bound both the work a crash loses
and the share of time spent saving, whatever the job's size.

Agreement: a save is collective, so every rank must save after the same step. Step counts agree by
themselves; clocks do not (each rank started its clock at a slightly different moment). So each rank
asks `time_due(now)` just before the step's statistics all-reduce and sends it there as 0/1; the
reduced value is > 0 on every rank as soon as it is 1 on any (a max over ranks), and every rank then
decides with `should_save(step, due_anywhere)`, the same inputs giving the same answer everywhere.

No torch and no clock of its own: `now` is passed in (the trainer passes `time.monotonic()`), so the
rule is tested without DeepSpeed or sleeping, and the run config can check the keys without torch.

The two keys are declared here (`CadenceSection`, with their check): the run config's checkpoint section
inherits them, and the run plan hands the trainer that section (`config.checkpoint`), typed as this declaration.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import ConfigError
from pretrain.keys import setting
from pretrain.run_folder import metrics_path

SAVE_SECONDS_TAG = "checkpoint/save_s"  # every save's cost, logged with the step it follows (metrics.jsonl)
# The failure rate the interval advice assumes without one given: one failure every ~8 h on 1,024 GPUs, i.e.
# one per 8,192 GPU-hours (docs/faults.md projects with it). Meta's Llama 3 run met 466 interruptions in 54
# days on 16K GPUs, one per ~45,000 GPU-hours: a gentler rate; this one errs towards saving often.
GPU_HOURS_PER_FAILURE = 8.0 * 1024
# A write speed for the first save-cost estimate (a shared file system per job; measured saves replace it).
ASSUMED_WRITE_BYTES_PER_S = 1e9


def young_daly_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """The checkpoint interval that loses the least time to saves and to redone work: sqrt(2 x C x MTBF)
    (Young 1974; Daly 2006's first-order form), for a save that costs `save_seconds` and a mean time between
    failures of `mtbf_seconds`. Valid while C is much smaller than the MTBF."""
    if save_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError(f"young_daly_seconds: save cost {save_seconds} and MTBF {mtbf_seconds} must be > 0")
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def measured_save_seconds(run_dir: Path, last: int = 5) -> float | None:
    """The median cost of the run's last `last` saves (its metrics.jsonl), or None before its first save."""
    path = metrics_path(Path(run_dir))
    if not path.is_file():
        return None
    found = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            value = json.loads(line).get(SAVE_SECONDS_TAG)
        except (ValueError, AttributeError):
            continue  # a line cut by a killed process
        if isinstance(value, int | float) and value > 0:
            found.append(float(value))
    return statistics.median(found[-last:]) if found else None


def mtbf_seconds(devices: int, gpu_hours_per_failure: float = GPU_HOURS_PER_FAILURE) -> float:
    """The job's mean time between failures if each device fails independently at the assumed rate."""
    return 3600.0 * gpu_hours_per_failure / max(devices, 1)


def interval_advice(save_seconds: float, devices: int, mtbf_hours: float | None = None,
                    recovery_seconds: float = 0.0) -> str:
    """One line: the Young/Daly interval for this save cost and job size, and the share of time it leaves lost; with
    `recovery_seconds` (R: a failure's downtime, its detection included, as a run measured it) that loss holds R per
    failure too (R does not move the interval: it is paid whatever the interval)."""
    mtbf = 3600.0 * mtbf_hours if mtbf_hours else mtbf_seconds(devices)
    interval = young_daly_seconds(save_seconds, mtbf)
    # expected loss per interval: one save, plus per failure half an interval redone and the recovery (first order)
    lost = save_seconds / interval + (interval / 2 + recovery_seconds) / mtbf
    rate = "" if mtbf_hours else f", one per {GPU_HOURS_PER_FAILURE:,.0f} GPU-hours on {devices} devices"
    recovery = f" and a recovery of {recovery_seconds:.3g} s each" if recovery_seconds > 0 else ""
    return (f"save every {interval / 60:.3g} min (checkpoint.every_minutes; Young/Daly for a {save_seconds:.3g} s save "
            f"and a failure every {hours(mtbf)} h{rate}{recovery}: {lost:.2%} of the time lost)")


def advised_interval(run_dir: Path, checkpoint_bytes: int, devices: int) -> str:
    """The interval advice for a job of `devices` whose checkpoints take `checkpoint_bytes`: from the save cost the
    run measured (its metrics.jsonl), else estimated from the checkpoint's size (the launch-time check and
    `./launch.sh scale` print it)."""
    measured = measured_save_seconds(run_dir)
    save = measured or max(checkpoint_bytes / ASSUMED_WRITE_BYTES_PER_S, 1.0)
    how = "measured" if measured else f"estimated at {ASSUMED_WRITE_BYTES_PER_S / 1e9:g} GB/s until a save is measured"
    return f"{interval_advice(save, devices)} (save cost {how})"


def hours(seconds: float) -> str:
    """Hours to read at a glance: 4,096, 8, 0.5."""
    value = seconds / 3600
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


@dataclass
class CadenceSection:
    """checkpoint.<key>: when step checkpoints are due. CheckpointSection (pretrain/config/sections.py) inherits
    these keys; a trainer made without a config (a test, a benchmark) takes `CadenceSection()`, the defaults."""

    every_steps: int | None = setting(
        500,
        "optimizer steps between checkpoints (a phase end and a stop always write one); null: none by "
        "step count. With every_minutes set too, whichever comes first",
    )
    every_minutes: float | None = setting(
        None,
        "wall-clock minutes between checkpoints, counted from the last checkpoint (or this process's start "
        "of the phase); all ranks save after the first step at which any rank's clock is due. null: by step "
        "count only. The GPU recipes set 30 and every_steps null: a step count is a different share of the "
        "run at each GPU count",
    )

    def check_cadence(self) -> None:
        """Each key null or > 0 (both null: checkpoints only at phase ends and stops)."""
        if self.every_steps is not None and self.every_steps <= 0:
            raise ConfigError(f"checkpoint.every_steps: must be > 0 or null, got {self.every_steps}")
        if self.every_minutes is not None and self.every_minutes <= 0:
            raise ConfigError(f"checkpoint.every_minutes: must be > 0 or null, got {self.every_minutes}")


class CheckpointCadence:
    """The save rule of one phase on one rank. `started`: when this process began (or resumed) the phase,
    on the clock the trainer passes as `now` (the first minutes interval counts from there)."""

    def __init__(self, every: CadenceSection, started: float) -> None:
        every.check_cadence()  # ConfigError naming the key, hand-made too
        self.every_steps = every.every_steps
        self.every_seconds = None if every.every_minutes is None else 60.0 * every.every_minutes
        self.last_saved = started

    def step_due(self, step: int) -> bool:
        """`step` (the phase's optimizer steps done) is a multiple of every_steps: the same on every rank."""
        return self.every_steps is not None and step % self.every_steps == 0

    def time_due(self, now: float) -> bool:
        """This rank's clock: every_minutes have passed since the last checkpoint (or the start). Local to
        the rank: agree on it over the ranks before acting on it (module docstring)."""
        return self.every_seconds is not None and now - self.last_saved >= self.every_seconds

    def should_save(self, step: int, time_due_anywhere: bool) -> bool:
        """Save after this step: its number is due, or some rank's clock said so (the agreed flag)."""
        return self.step_due(step) or time_due_anywhere

    def saved(self, now: float) -> None:
        """A checkpoint was just written (any kind): the minutes interval starts again from `now`. The
        step interval does not move: tags stay on multiples of every_steps."""
        self.last_saved = now
