"""Time to quality: at every validation, the run's wall-clock, device-hours and samples; each
`logging.quality_targets` mark logged the first time val/mlm_acc reaches it.

The fast-BERT line of work (MLPerf, MosaicBERT, Cramming, 24h-BERT) compares runs by what it took to
reach a quality, not by throughput: MLPerf's BERT target is a masked-LM accuracy of 0.720 on its
held-out set. Our val/mlm_acc is the same kind of number (the share of held-out masked tokens predicted
exactly) on this run's own held-out shards, so a mark is comparable between runs on the same data, and
with MLPerf's only as far as the data and masking agree.

Tags (TensorBoard and metrics.jsonl, rank 0), on the rows that carry val/mlm_acc:

    time/wall_s, time/device_hours, time/samples       every validation (pretrain/metrics/clock.py says what
                                                       the clock counts, across resumes)
    target/mlm_acc_<mark>/wall_s, .../device_hours, .../samples
                                                       once, at the first validation with val/mlm_acc >= mark

and every metrics.jsonl row gets "wall_s" beside "step", so the report can put any curve against the
wall-clock. Nothing here touches a device: the validation numbers were read on the host already.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.keys import setting
from pretrain.metrics.clock import RunClock
from pretrain.metrics.goodput import account, read_faults

ACCURACY_TAG = "val/mlm_acc"
STEP_SECONDS_TAG = "perf/step_s"  # a training step's row carries it (pretrain/metrics/throughput.py)
GOODPUT_TAG = "time/goodput"  # the run's productive step time over its wall time (pretrain/metrics/goodput.py)


def target_key(mark: float) -> str:
    """How a mark is named in tags and in run_clock.json: 0.72 -> "0.72"."""
    return format(mark, "g")


def target_tag(mark: float, field: str) -> str:
    return f"target/mlm_acc_{target_key(mark)}/{field}"


@dataclass
class QualitySection:
    """logging.<key>: the quality marks (LoggingSection, pretrain/config/sections.py, inherits this key)."""

    quality_targets: list[float] = setting(
        [0.3, 0.5, 0.65, 0.72],
        "val/mlm_acc marks whose wall-clock, device-hours and samples are logged the first time a validation "
        "reaches them (target/* tags; 0.72 is MLPerf's BERT target); [] logs none (pretrain/metrics/quality.py)",
    )

    def check_targets(self) -> None:
        """Each mark an accuracy in (0, 1], no mark twice (ConfigError naming the key and the value)."""
        marks, key = self.quality_targets, "logging.quality_targets"
        for index, mark in enumerate(marks):
            if not 0.0 < mark <= 1.0:
                raise ConfigError(f"{key}[{index}]: {mark} is not a masked-LM accuracy in (0, 1]")
        if len({target_key(mark) for mark in marks}) != len(marks):
            raise ConfigError(f"{key}: {marks} names a mark twice")


# MLPerf's BERT quality target (masked-LM accuracy 0.720) and lower marks that a short or small run reaches
# (declared with the key, above).
DEFAULT_QUALITY_TARGETS = tuple(QualitySection().quality_targets)


@dataclass(frozen=True)
class QualityPlan:
    """What the driver hands the metrics writer: where the clock lives, the job's devices (both derived by the
    run plan) and the config's logging section, typed as the marks' declaration."""

    run_dir: Path
    ranks: int
    marks: QualitySection

    def __post_init__(self) -> None:  # built on every rank: a bad mark fails them all alike
        self.marks.check_targets()


class TimeToQuality:
    """The clock and the marks of one process (rank 0): `observe` adds the time/* and target/* numbers."""

    def __init__(self, settings: QualityPlan, clock: RunClock | None = None) -> None:
        self.targets = sorted(settings.marks.quality_targets)
        self.clock = clock or RunClock(settings.run_dir, settings.ranks)
        # the run's faults so far, read once: the next one ends this process (its records come after it)
        self.faults = read_faults(settings.run_dir)

    def begin(self, step: int) -> None:
        self.clock.begin(step)

    def observe(self, step: int, values: dict[str, float], samples: int | None,
                now: float | None = None) -> dict[str, float]:
        """The numbers to log with a row of `step`: the run's goodput with a training step's row (perf/step_s),
        the time/* and target/* numbers with a row that carries val/mlm_acc."""
        step_seconds = values.get(STEP_SECONDS_TAG)
        self.clock.logged(step, now, step_seconds)
        numbers: dict[str, float] = {}
        if step_seconds is not None:  # the same figure as ./launch.sh report's, by the same definition
            numbers[GOODPUT_TAG] = account(self.clock.spans(now), self.faults).goodput
        if ACCURACY_TAG not in values:
            return numbers
        wall_s, device_hours = self.clock.wall_seconds(now), self.clock.device_hours(now)
        numbers.update({"time/wall_s": wall_s, "time/device_hours": device_hours})
        if samples is not None:
            numbers["time/samples"] = float(samples)
        accuracy = float(values[ACCURACY_TAG])
        for mark in self.targets:
            key = target_key(mark)
            if key in self.clock.targets or not accuracy >= mark:
                continue
            reached: dict[str, Any] = {"step": step, "wall_s": wall_s, "device_hours": device_hours,
                                       "samples": samples, ACCURACY_TAG: accuracy}
            self.clock.targets[key] = reached
            numbers[target_tag(mark, "wall_s")] = wall_s
            numbers[target_tag(mark, "device_hours")] = device_hours
            if samples is not None:
                numbers[target_tag(mark, "samples")] = float(samples)
        self.clock.save(now)
        return numbers

    def wall_seconds(self, now: float | None = None) -> float:
        return self.clock.wall_seconds(now)

    def mark(self, name: str) -> None:
        self.clock.mark(name)

    def close(self) -> None:
        self.clock.close()
