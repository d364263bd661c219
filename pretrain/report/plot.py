"""report.png: a run's curves in one picture (matplotlib, drawn off-screen).

    top row     loss, masked-LM accuracy, throughput      against samples seen
    bottom row  loss, masked-LM accuracy, MFU             against the run's wall-clock

Resumes (a new process, from run_clock.json) are dashed vertical lines, the phase-2 start a dotted one,
the quality targets grey horizontal lines on the accuracy panels. A run without wall-clock on its rows
(written before the clock existed) gets a note in the wall-clock panels instead of curves.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from pretrain.report.records import RunFacts, row_samples, row_wall_s
from pretrain.report.trust import write_file


def _series(rows: list[dict[str, Any]], key: str, x_of: Any) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        x, y = x_of(row), row.get(key)
        if x is not None and isinstance(y, int | float):
            xs.append(x)
            ys.append(float(y))
    return xs, ys


def _markers(facts: RunFacts, x_of: Any) -> tuple[list[float], list[float]]:
    """x positions of resumes and of the phase-2 start, on an axis given by `x_of(row)`."""
    def x_at_step(step: int) -> float | None:
        row = next((r for r in facts.rows if r["step"] >= step), None)
        return x_of(row) if row is not None else None

    resumes = [x_at_step(p["first_step"]) for p in facts.processes[1:] if p.get("first_step") is not None]
    phase2 = []
    if "phase2" in facts.config.get("run", {}).get("phases", []) and "phase1" in facts.config.get("run", {}).get("phases", []):
        phase2 = [x_at_step(int(facts.config.get("phase1", {}).get("steps", 0)) + 1)]
    return [x for x in resumes if x is not None], [x for x in phase2 if x is not None]


def draw_report(facts: RunFacts, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    wall = [row_wall_s(r) for r in facts.rows if row_wall_s(r) is not None]
    hours = bool(wall) and max(wall) >= 2 * 3600
    scale, unit = (3600.0, "h") if hours else (60.0, "min")

    def by_samples(row: dict[str, Any]) -> float | None:
        return row_samples(row, facts.config)

    def by_wall(row: dict[str, Any]) -> float | None:
        seconds = row_wall_s(row)
        return seconds / scale if seconds is not None else None

    figure, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    training, validations = facts.training, facts.validations
    marks = [target.mark for target in facts.targets]
    for line, (x_of, label) in enumerate(((by_samples, "samples seen"), (by_wall, f"wall-clock ({unit})"))):
        loss_ax, acc_ax, rate_ax = axes[line]
        if line == 1 and not wall:
            for ax in axes[1]:
                ax.text(0.5, 0.5, "no wall-clock on these rows\n(written before the run clock)", ha="center",
                        va="center", transform=ax.transAxes)
            continue
        loss_ax.plot(*_series(training, "loss/mlm", x_of), label="train loss/mlm", lw=1)
        loss_ax.plot(*_series(validations, "val/mlm_loss", x_of), "o-", label="val/mlm_loss", ms=3)
        loss_ax.set_ylabel("masked-LM loss")
        acc_ax.plot(*_series(training, "acc/mlm", x_of), label="train acc/mlm", lw=1)
        acc_ax.plot(*_series(validations, "val/mlm_acc", x_of), "o-", label="val/mlm_acc", ms=3)
        for mark in marks:
            acc_ax.axhline(mark, color="grey", lw=0.7, alpha=0.6)
        acc_ax.set_ylabel("masked-LM accuracy")
        if line == 0:
            rate_ax.plot(*_series(training, "perf/seq_per_s", x_of), lw=1, label="perf/seq_per_s")
            rate_ax.set_ylabel("sequences / s (all ranks)")
        else:
            xs, ys = _series(training, "perf/mfu", x_of)
            if xs:
                rate_ax.plot(xs, ys, lw=1, label="perf/mfu")
            else:
                rate_ax.text(0.5, 0.5, "no MFU: no peak FLOP/s known\n(a CPU run, or set logging.peak_tflops)",
                             ha="center", va="center", transform=rate_ax.transAxes)
            rate_ax.set_ylabel("MFU")
        resumes, phase2 = _markers(facts, x_of)
        for ax in (loss_ax, acc_ax, rate_ax):
            for x in resumes:
                ax.axvline(x, color="red", ls="--", lw=0.8)
            for x in phase2:
                ax.axvline(x, color="black", ls=":", lw=0.8)
            ax.set_xlabel(label)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    figure.suptitle(f"{facts.run_dir.resolve().name}: red dashed = resume, black dotted = phase 2 starts")
    picture = io.BytesIO()
    figure.savefig(picture, format="png", dpi=90)
    plt.close(figure)
    write_file(path, picture.getvalue())  # renamed over the name: a link standing there is replaced, not followed
