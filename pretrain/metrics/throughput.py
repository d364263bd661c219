"""Throughput, the FLOP model and MFU of each optimizer step (pretrain/metrics/writer.py writes them).

Two FLOP counts per step, each training = forward + backward = 3 x forward, 2 FLOPs per multiply-add.
The MODEL's work, on real tokens only: the same for the same instances on every layout (padded, packed,
unpadded), so that MFU compares layouts and runs honestly (perf/tflops, perf/mfu):

    6 * N_enc * real_tokens    every encoder weight (and the pooler) touches every non-padding token
  + 12 * L * d * sum(n_i^2)    attention scores QK^T and the weighted sum AV, per layer, per instance i
                               of n_i tokens: the pairs attention needs
  + 6 * N_head * labelled      MLM head (transform + tied decoder) on the predictions that have a label

and the DEVICE's work, what the hardware computed, padding included (perf/device_tflops, perf/device_mfu):

    6 * N_enc * rows * seq_len   every token the device ran: padded and packed rows with their padding,
                                 the unpadded path's T_b (its real tokens and the bucket tail)
  + 12 * L * d * device_pairs    padded and packed rows: rows x seq_len^2 (dense SDPA computes the
                                 masked pairs too); unpadded: each segment's n^2, the bucket tail's too
  + 6 * N_head * slots           the head runs on every prediction slot, labelled or not

N_enc = encoder parameters, L layers, d hidden size, N_head = MLM head parameters including the vocab x d
decoder. Every count is taken on the host from each collated micro-batch (pretrain/step_stats.py
`host_counts`): no device work. The model's head term counts the labelled predictions, not the slots: a
short instance has fewer masks than max_predictions, and its empty slots are the head's padding; where a
caller did not count them (`StepCounts.labelled` None) it counts the slots. The padded path's padding costs
6 N_enc per padding token, seq_len^2 - n^2 pairs per row and its empty head slots: BERT-Large at seq 512 with
lengths uniform in [128, 512] spends 37 % of what its device computes on padding
(tests/metrics/test_mfu_layouts.py). Embedding lookups and the NSP head are negligible and not counted.
MFU = FLOP/s / (devices x peak FLOP/s of one device at the training precision).

What is counted (`StepCounts`, summed over the model's ranks by the trainer's one all-reduce per step):
device work counts ROWS of seq_len tokens, padding included (perf/seq_per_s, perf/tokens_per_s,
perf/device_tflops), useful work counts INSTANCES and REAL (non-padding) tokens (perf/instances_per_s,
perf/real_tokens_per_s, perf/tflops). Unpacked, rows == instances; a packed row holds several.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pretrain.step_stats import StepCounts

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
    """A full row of seq_len tokens, one instance, `predictions` head slots (the FLOP model above)."""
    return 6.0 * encoder_params * seq_len + attention_flops_per_pair(layers, hidden) * seq_len**2 + \
        6.0 * head_params * predictions


def attention_flops_per_pair(layers: int, hidden: int) -> float:
    """Training FLOPs of one query-key pair over all layers: QK^T and AV, 2 FLOPs per multiply-add each, x 3."""
    return 12.0 * layers * hidden


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


@dataclass(frozen=True)
class ThroughputSettings:
    """The FLOP model's inputs for one phase and the device's peak, built by the run plan before any model exists
    (the parameter counts from the model config: pretrain/model/presets.py `flop_parameter_counts`)."""

    encoder_params: int  # N_enc: encoder layers and pooler
    head_params: int  # N_head: the MLM head with its vocab x d decoder
    layers: int
    hidden: int
    seq_len: int
    predictions: int  # MLM prediction slots per sequence
    peak_tflops: float | None  # of one device at the phase's precision (None: no MFU)

    @property
    def flops_per_sequence(self) -> float:
        return flops_per_sequence(self.encoder_params, self.head_params, self.layers, self.hidden, self.seq_len,
                                  self.predictions)

    @property
    def attention_flops_per_pair(self) -> float:
        return attention_flops_per_pair(self.layers, self.hidden)


@dataclass(frozen=True)
class StepFlops:
    """A step's FLOPs twice: the model's on real tokens, the device's with its padding (above)."""

    model: float
    device: float


def step_flops(settings: ThroughputSettings, counts: StepCounts) -> StepFlops:
    """The FLOP model of the module docstring applied to a step's `counts`. An optional count left uncounted
    (None) falls back to what full unpacked rows imply: rows x seq_len^2 pairs, the head's slots."""
    full_rows_pairs = counts.rows * settings.seq_len**2
    model_pairs = full_rows_pairs if counts.attention_pairs is None else counts.attention_pairs
    device_pairs = full_rows_pairs if counts.device_pairs is None else counts.device_pairs
    predictions = counts.predictions if counts.labelled is None else counts.labelled
    per_token, per_prediction = 6.0 * settings.encoder_params, 6.0 * settings.head_params
    per_pair = settings.attention_flops_per_pair
    return StepFlops(
        model=per_token * counts.real_tokens + per_pair * model_pairs + per_prediction * predictions,
        device=(per_token * counts.rows * settings.seq_len + per_pair * device_pairs
                + per_prediction * counts.predictions),
    )


class Throughput:
    """Wall time between optimizer steps -> rows/s, tokens/s, instances/s, model and device TFLOP/s and MFU
    (whole job), from a phase's FLOP model (`ThroughputSettings`) and a step's `StepCounts`."""

    def __init__(self, settings: ThroughputSettings, world_size: int) -> None:
        self.settings, self.world_size = settings, world_size
        self.seq_len = settings.seq_len
        self._last = time.perf_counter()

    @classmethod
    def of(cls, settings: ThroughputSettings, world_size: int) -> Throughput:
        """A phase's meter, from its plan's settings, for `world_size` devices."""
        return cls(settings, world_size)

    def restart(self) -> None:
        self._last = time.perf_counter()

    def step(self, counts: StepCounts) -> dict[str, float]:
        """Rates of the step that ended now (since the previous call or `restart`)."""
        now = time.perf_counter()
        seconds, self._last = max(now - self._last, 1e-9), now
        return self.rates(counts, seconds)

    def rates(self, counts: StepCounts, seconds: float) -> dict[str, float]:
        """perf/* of a step of `seconds` that processed `counts` (all ranks)."""
        flops = step_flops(self.settings, counts)
        tflops, device_tflops = flops.model / seconds / 1e12, flops.device / seconds / 1e12
        stats = {
            "perf/seq_per_s": counts.rows / seconds,
            "perf/tokens_per_s": counts.rows * self.seq_len / seconds,
            "perf/tflops": tflops,
            "perf/device_tflops": device_tflops,
            "perf/step_s": seconds,
            "perf/instances_per_s": counts.instances / seconds,
            "perf/real_tokens_per_s": counts.real_tokens / seconds,
        }
        peak = self.settings.peak_tflops
        if peak:
            stats["perf/mfu"] = tflops / (peak * self.world_size)
            stats["perf/device_mfu"] = device_tflops / (peak * self.world_size)
        return stats
