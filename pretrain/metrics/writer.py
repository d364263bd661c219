"""TensorBoard on rank 0 (a no-op writer elsewhere) and one JSON line per step in metrics.jsonl, with the run's
clock and quality marks (pretrain/metrics/quality.py). What a step's numbers are is pretrain/metrics/throughput.py
(rates, FLOPs, MFU) and pretrain/trainer.py (losses); this module only writes them, once per optimizer step.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpointing.cadence import SAVE_SECONDS_TAG
from pretrain.metrics.quality import QualityPlan, TimeToQuality
from pretrain.run_folder import METRICS_FILE


class MetricsWriter:
    """Scalars/histograms to TensorBoard and one JSON line per step to metrics.jsonl; rank 0 only.

    Each step is kept once across a stop and resume: the files are opened at the first step this process
    writes, S, and what an earlier process logged from S on (the steps after its last checkpoint, which the
    resumed run repeats) is dropped: rows of metrics.jsonl with step >= S, and TensorBoard's events through
    SummaryWriter(purge_step=S).

    A write that fails (a full disk, EIO) does not end training: one warning line, then no more rows from this
    process (TensorBoard's writer thread, whose failure the next write reports, is kept quiet meanwhile).
    Metrics are not needed to resume; a checkpoint save is what a full disk must not cost (docs/faults.md).

    With `quality` (the driver passes it), the run's clock is kept too (pretrain/metrics/quality.py): every
    row of metrics.jsonl gets "wall_s" (seconds the run has run, over its processes), and a row with
    val/mlm_acc the time/* numbers and any quality target it reaches first; run_clock.json is written with
    every checkpoint's row (checkpoint/save_s). Host arithmetic only.
    """

    def __init__(self, log_dir: Path | None, enabled: bool, quality: QualityPlan | None = None) -> None:
        self.enabled = enabled and log_dir is not None
        self.log_dir = log_dir
        self._tb = None
        self._jsonl = None
        self._thread_hook: Callable[[threading.ExceptHookArgs], Any] | None = None  # threading's, while quieted
        # rank 0's share of the run's clock, counted from this process's start (the driver builds the writer
        # after its checks and the run folder's lock)
        self.quality = TimeToQuality(quality) if quality is not None and self.enabled else None

    def _open(self, step: int) -> None:
        if self._tb is not None:
            return
        assert self.log_dir is not None
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: rank 0 only

        self._thread_hook = threading.excepthook
        threading.excepthook = quiet_writer_thread(self._thread_hook)  # restored by close() / _give_up()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / METRICS_FILE
        drop_rows_from(path, step)
        self._tb = SummaryWriter(log_dir=str(self.log_dir), purge_step=step)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if self.quality is not None:
            self.quality.begin(step)  # targets reached in the steps this resume repeats are dropped too

    def scalars(self, step: int, values: dict[str, float], extra: dict[str, Any] | None = None) -> None:
        if self.enabled:
            try:
                self._scalars(step, values, extra)
            except OSError as err:
                self._give_up(err)

    def _scalars(self, step: int, values: dict[str, float], extra: dict[str, Any] | None) -> None:
        self._open(step)
        extra = dict(extra or {})
        if self.quality is not None:
            values = {**values, **self.quality.observe(step, values, extra.get("samples"))}
            extra["wall_s"] = round(self.quality.wall_seconds(), 3)
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)
        self._jsonl.write(json.dumps({"step": step, **extra, **values}) + "\n")
        self._jsonl.flush()
        if self.quality is not None and SAVE_SECONDS_TAG in values:
            # a checkpoint was just saved (the trainer logs every save's cost as it returns): the clock is written
            # with it, so every step a checkpoint keeps is on the clock even when the process is killed before its
            # next write (pretrain/metrics/goodput.py counts them as productive)
            self.quality.clock.save()

    def mark(self, name: str) -> None:
        """A start-up mark of this process (pretrain/metrics/clock.py STARTUP_MARKS) on the run's clock; rank 0."""
        if self.quality is not None:
            self.quality.mark(name)

    def launched(self, job: str | None, restart: int) -> None:
        """Which launch of the elastic agent (its run id) and which restart of it started this process: the run
        clock matches the launch's fault records by them (pretrain/metrics/goodput.py)."""
        if self.quality is not None:
            self.quality.clock.launched(job, restart)

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        if self.enabled and values.numel():
            try:
                self._open(step)
                self._tb.add_histogram(tag, values.detach().float().cpu(), step)
            except OSError as err:
                self._give_up(err)

    def flush(self) -> None:
        if self.enabled and self._tb is not None:
            try:
                self._tb.flush()
            except OSError as err:
                self._give_up(err)

    def _give_up(self, err: OSError) -> None:
        """The one warning of a failed metrics write; this process writes no more rows (class docstring)."""
        print(f"warning: metrics: cannot write to {self.log_dir} ({err}); training goes on without metrics.jsonl "
              "and TensorBoard rows for the rest of this process", flush=True)
        self._close_files()
        self.enabled = False

    def _close_files(self) -> None:
        for handle in (self._tb, self._jsonl):
            try:
                if handle is not None:
                    handle.close()
            except OSError:
                pass  # the write that failed was reported once; a close that fails too adds nothing
        if self._thread_hook is not None:
            threading.excepthook, self._thread_hook = self._thread_hook, None
        self._tb = self._jsonl = None

    def close(self) -> None:
        if self.enabled:
            self._close_files()
        if self.quality is not None:
            try:
                self.quality.close()  # this process's seconds, also after an error (the driver closes in `finally`)
            except OSError as err:
                print(f"warning: metrics: cannot write the run clock in {self.log_dir} ({err})", flush=True)
            self.quality = None
        self.enabled = False


def quiet_writer_thread(previous: Callable[[threading.ExceptHookArgs], Any]) -> Callable[..., Any]:
    """A threading.excepthook that keeps TensorBoard's event writer thread from printing a traceback for a
    failed write: the writer raises the same error at the next call, which `MetricsWriter` reports once."""
    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    return hook


def drop_rows_from(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without its rows of `step` and later (atomically; a torn last line goes too)."""
    if not path.is_file():
        return
    kept, dropped = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped = True
            continue
        if row_step >= step:
            dropped = True
        else:
            kept.append(line + "\n")
    if dropped:
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept), encoding="utf-8")
        os.replace(partial, path)
