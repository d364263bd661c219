"""Throughput, the FLOP model and MFU of each optimizer step (pretrain/metrics/writer.py writes them).

FLOP model (training = forward + backward = 3 x forward, 2 FLOPs per multiply-add), per step:

    6 * N_enc * tokens       every encoder weight (and the pooler) touches every token the device ran
  + 12 * L * d * sum(n_i^2)  attention scores QK^T and the weighted sum AV, per layer, per instance i of n_i
                             tokens: the pairs attention needs, the same on every layout
  + 6 * N_head * m           MLM head (transform + tied decoder) on the m prediction slots it ran on

N_enc = encoder parameters, L layers, d hidden size, N_head = MLM head parameters including the vocab x d
decoder. tokens = rows x seq_len: padded and packed rows with their padding, the unpadded path's T_b (its real
tokens and the bucket tail). sum(n_i^2) is counted on the host from each collated micro-batch
(pretrain/data/unpadded.py `attention_pairs`): the unpadded path's segments (its tail excluded), the padded
rows' instances, the packed rows' instances. Before it was counted, the attention term was rows x seq_len^2:
right for full padded rows, an overstatement of every short instance (padded SDPA computes the masked pairs
too, but they are not the model's work) and of the unpadded path's T_b x seq_len. Embedding lookups and the
NSP head are negligible and not counted. MFU = achieved model FLOP/s / (devices x peak FLOP/s of one device at
the training precision).

What is counted (`StepCounts`, summed over the model's ranks by the trainer's one all-reduce per step):
device work counts ROWS of seq_len tokens, padding included (perf/seq_per_s, perf/tokens_per_s, and the
linear term of perf/tflops / perf/mfu), useful work counts INSTANCES and REAL (non-padding) tokens
(perf/instances_per_s, perf/real_tokens_per_s). Unpacked, rows == instances; a packed row holds several.
"""

from __future__ import annotations

import resource
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


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/max_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    # ru_maxrss is in KiB on Linux: the peak resident memory of this rank's process.
    return {"memory/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


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


class Throughput:
    """Wall time between optimizer steps -> rows/s, tokens/s, TFLOP/s, MFU, instances/s (whole job).

    `flops_per_seq` is `flops_per_sequence` of a full row with `predictions_per_seq` MLM predictions.
    The head's FLOPs follow the predictions actually computed: a packed step runs the head on
    instances x max_predictions rows, not rows x max_predictions, so with `head_flops_per_prediction`
    (6 x N_head) the difference is added; left at 0, every row is counted as one full unpacked row.
    The attention term follows the pairs counted (`StepCounts.attention_pairs`): with `attention_flops_per_pair`
    (12 x L x d) a full row's seq_len^2 pairs are replaced by them; left at 0 (or uncounted), a full row's.
    """

    def __init__(
        self, flops_per_seq: float, seq_len: int, world_size: int, peak_tflops_per_device: float | None,
        head_flops_per_prediction: float = 0.0, predictions_per_seq: int = 0, attention_flops_per_pair: float = 0.0,
    ) -> None:
        self.flops_per_seq, self.seq_len, self.world_size = flops_per_seq, seq_len, world_size
        self.peak = peak_tflops_per_device
        if head_flops_per_prediction and predictions_per_seq <= 0:
            raise ValueError(f"Throughput: head_flops_per_prediction={head_flops_per_prediction} needs the "
                             f"predictions_per_seq that flops_per_seq includes, got {predictions_per_seq}")
        self.head_flops_per_prediction = head_flops_per_prediction
        self.predictions_per_seq = predictions_per_seq
        self.attention_flops_per_pair = attention_flops_per_pair
        self._last = time.perf_counter()

    @classmethod
    def of(cls, settings: ThroughputSettings, world_size: int) -> Throughput:
        """A phase's meter, from its plan's settings, for `world_size` devices."""
        return cls(settings.flops_per_sequence, settings.seq_len, world_size, settings.peak_tflops,
                   head_flops_per_prediction=6.0 * settings.head_params, predictions_per_seq=settings.predictions,
                   attention_flops_per_pair=settings.attention_flops_per_pair)

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
        if counts.attention_pairs is not None:  # the pairs the instances need, for a full row's seq_len^2 each
            flops += (counts.attention_pairs - counts.rows * self.seq_len**2) * self.attention_flops_per_pair
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
