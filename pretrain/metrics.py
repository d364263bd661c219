"""TensorBoard on rank 0 (a no-op writer elsewhere), throughput, the FLOP model and MFU.

FLOP model (training = forward + backward = 3 x forward, 2 FLOPs per multiply-add), per sequence:

    6 * N_enc * s            every encoder weight (and the pooler) touches every token
  + 12 * L * d * s^2         attention scores QK^T and the weighted sum AV, per layer
  + 6 * N_head * m           MLM head (transform + tied decoder) on the m masked positions only

N_enc = encoder parameters, L layers, d hidden size, s sequence length, N_head = MLM head parameters
including the vocab x d decoder. Embedding lookups and the NSP head are negligible and not counted.
MFU = achieved model FLOP/s / (devices x peak FLOP/s of one device at the training precision).

What is counted (`StepCounts`, summed over the model's ranks by the trainer's one all-reduce per step):
device work counts ROWS of seq_len tokens, padding included (perf/seq_per_s, perf/tokens_per_s, and
perf/tflops / perf/mfu from rows x the FLOPs of a full row, the MLM head at the predictions actually
computed); useful work counts INSTANCES and REAL (non-padding) tokens (perf/instances_per_s,
perf/real_tokens_per_s). Unpacked, rows == instances; a packed row holds several instances.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.report.quality import QualitySettings, TimeToQuality
from pretrain.run_folder import METRICS_FILE

# Dense peak TFLOP/s per device (no sparsity), by precision. Matched by substring of the device name.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}


def flops_per_sequence(
    encoder_params: int, head_params: int, layers: int, hidden: int, seq_len: int, predictions: int
) -> float:
    return 6.0 * encoder_params * seq_len + 12.0 * layers * hidden * seq_len**2 + 6.0 * head_params * predictions


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Peak TFLOP/s of one device: the flag when given, else the table; None (no MFU) when unknown."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(precision) or None
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/max_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    # ru_maxrss is in KiB on Linux: the peak resident memory of this rank's process.
    return {"memory/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class MetricsWriter:
    """Scalars/histograms to TensorBoard and one JSON line per step to metrics.jsonl; rank 0 only.

    Each step is kept once across a stop and resume: the files are opened at the first step this process
    writes, S, and what an earlier process logged from S on (the steps after its last checkpoint, which the
    resumed run repeats) is dropped: rows of metrics.jsonl with step >= S, and TensorBoard's events through
    SummaryWriter(purge_step=S).

    With `quality` (the driver passes it), the run's clock is kept too (pretrain/report/quality.py): every
    row of metrics.jsonl gets "wall_s" (seconds the run has run, over its processes), and a row with
    val/mlm_acc the time/* numbers and any quality target it reaches first. Host arithmetic only.
    """

    def __init__(self, log_dir: Path | None, enabled: bool, quality: QualitySettings | None = None) -> None:
        self.enabled = enabled and log_dir is not None
        self.log_dir = log_dir
        self._tb = None
        self._jsonl = None
        # rank 0's share of the run's clock, counted from this process's start (the driver builds the writer
        # after its checks and the run folder's lock)
        self.quality = TimeToQuality(quality) if quality is not None and self.enabled else None

    def _open(self, step: int) -> None:
        if self._tb is not None:
            return
        assert self.log_dir is not None
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: rank 0 only

        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / METRICS_FILE
        drop_rows_from(path, step)
        self._tb = SummaryWriter(log_dir=str(self.log_dir), purge_step=step)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if self.quality is not None:
            self.quality.begin(step)  # targets reached in the steps this resume repeats are dropped too

    def scalars(self, step: int, values: dict[str, float], extra: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        self._open(step)
        extra = dict(extra or {})
        if self.quality is not None:
            values = {**values, **self.quality.observe(step, values, extra.get("samples"))}
            extra["wall_s"] = round(self.quality.wall_seconds(), 3)
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)
        self._jsonl.write(json.dumps({"step": step, **extra, **values}) + "\n")
        self._jsonl.flush()

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        if self.enabled and values.numel():
            self._open(step)
            self._tb.add_histogram(tag, values.detach().float().cpu(), step)

    def flush(self) -> None:
        if self.enabled and self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self.enabled and self._tb is not None:
            self._tb.close()
            self._jsonl.close()
        if self.quality is not None:
            self.quality.close()  # this process's seconds, also after an error (the driver closes in `finally`)
            self.quality = None
        self.enabled = False


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


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step processed, summed over micro-batches and the model's ranks."""

    rows: float  # rows of seq_len tokens the devices ran (padding included)
    instances: float  # training instances (== rows unpacked; several per packed row)
    real_tokens: float  # non-padding tokens
    predictions: float  # MLM head rows computed (slots of masked_positions, labelled or not)

    def data_stats(self, seq_len: int) -> dict[str, float]:
        """Instances per row and padding share of the step's rows (all ranks), logged as data/*."""
        if not self.rows:
            return {}
        return {
            "data/packing_factor": self.instances / self.rows,
            "data/padding_fraction": 1.0 - self.real_tokens / (self.rows * seq_len),
        }


class Throughput:
    """Wall time between optimizer steps -> rows/s, tokens/s, TFLOP/s, MFU, instances/s (whole job).

    `flops_per_seq` is `flops_per_sequence` of a full row with `predictions_per_seq` MLM predictions.
    The head's FLOPs follow the predictions actually computed: a packed step runs the head on
    instances x max_predictions rows, not rows x max_predictions, so with `head_flops_per_prediction`
    (6 x N_head) the difference is added; left at 0, every row is counted as one full unpacked row.
    """

    def __init__(
        self, flops_per_seq: float, seq_len: int, world_size: int, peak_tflops_per_device: float | None,
        head_flops_per_prediction: float = 0.0, predictions_per_seq: int = 0,
    ) -> None:
        self.flops_per_seq, self.seq_len, self.world_size = flops_per_seq, seq_len, world_size
        self.peak = peak_tflops_per_device
        if head_flops_per_prediction and predictions_per_seq <= 0:
            raise ValueError(f"Throughput: head_flops_per_prediction={head_flops_per_prediction} needs the "
                             f"predictions_per_seq that flops_per_seq includes, got {predictions_per_seq}")
        self.head_flops_per_prediction = head_flops_per_prediction
        self.predictions_per_seq = predictions_per_seq
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def step(self, counts: StepCounts) -> dict[str, float]:
        """Rates of the step that ended now (since the previous call or `restart`)."""
        now = time.perf_counter()
        seconds, self._last = max(now - self._last, 1e-9), now
        return self.rates(counts, seconds)

    def rates(self, counts: StepCounts, seconds: float) -> dict[str, float]:
        """perf/* of a step of `seconds` that processed `counts` (all ranks)."""
        extra_predictions = counts.predictions - counts.rows * self.predictions_per_seq
        flops = counts.rows * self.flops_per_seq + extra_predictions * self.head_flops_per_prediction
        tflops = flops / seconds / 1e12
        stats = {
            "perf/seq_per_s": counts.rows / seconds,
            "perf/tokens_per_s": counts.rows * self.seq_len / seconds,
            "perf/tflops": tflops,
            "perf/step_s": seconds,
            "perf/instances_per_s": counts.instances / seconds,
            "perf/real_tokens_per_s": counts.real_tokens / seconds,
        }
        if self.peak:
            stats["perf/mfu"] = tflops / (self.peak * self.world_size)
        return stats
