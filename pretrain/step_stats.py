"""The statistics of one optimizer step, by name, and the one all-reduce that sums them over the model's ranks;
what a step processed (StepCounts) and what it gave the loop (StepResult): every Step* type of the trainer.

What a micro-batch adds falls in two kinds. Numbers only the device knows (loss sums, correct predictions,
whether the loss was finite) stay device tensors: reading them on the host would stall the GPU queue
once per micro-batch. Numbers the host already holds (rows, real tokens, labelled slots, instances: all
counted from the host copy of the collated batch) are summed as Python numbers: no device work at all.
At the end of the step both go into one float64 tensor, all-reduced once and read once: the step's single
host sync, which also carries this rank's stop and checkpoint requests so that the ranks agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pretrain.data.unpadded import attention_pairs, device_rows, is_unpadded, real_tokens
from pretrain.model.bert import IGNORE_INDEX, PretrainingOutput

# summed on the device, one slot each
DEVICE_SUMS = ("mlm_loss_sum", "nsp_loss_sum", "mlm_correct", "nsp_correct", "nonfinite")
# summed on the host: labelled MLM slots, instances (labelled NSP slots: packed rows pad theirs), rows of
# seq_len the device ran, non-padding tokens, MLM head rows, attention's query-key pairs (sum of instance
# length squared), the pairs the device's attention computed (padding included); then this rank's stop /
# checkpoint requests
HOST_COUNTS = ("mlm_labelled", "instances", "rows", "real_tokens", "head_rows", "attention_pairs",
               "device_pairs", "stop", "save_due")


def host_values_to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Python numbers as a float64 tensor on `device`, without a host sync.

    `torch.tensor(values, device="cuda")` copies from pageable memory, which waits for the stream: a sync
    per call. A pinned host tensor copied with `non_blocking` is queued like a kernel instead."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def labelled_slots(host_batch: dict[str, torch.Tensor]) -> int:
    """Labelled MLM slots of a collated micro-batch, counted on its host copy."""
    return int((host_batch["masked_labels"] != IGNORE_INDEX).sum())


def device_attention_pairs(host_batch: dict[str, Any]) -> int:
    """The query-key pairs the device's attention computes in a collated micro-batch, padding included: the
    device's twin of `attention_pairs` (the model's), for perf/device_tflops. Padded and packed rows run
    dense SDPA over every row, seq_len^2 pairs each (the masked ones are computed too); the unpadded varlen
    kernel runs each segment, its bucket tail included (pretrain/data/unpadded.py)."""
    if is_unpadded(host_batch):
        return int((host_batch["cu_seqlens"].diff().long() ** 2).sum())
    rows, row_len = host_batch["input_ids"].shape
    return int(rows) * int(row_len) ** 2


def host_counts(host_batch: dict[str, Any]) -> dict[str, float]:
    """What one collated micro-batch adds to the step's HOST_COUNTS, from its host copy (no device work). One
    function so that the trainer's sums and a test's are counted by the same code."""
    return {
        "mlm_labelled": labelled_slots(host_batch),
        "instances": int((host_batch["next_sentence_label"] != IGNORE_INDEX).sum()),
        "rows": device_rows(host_batch),  # unpadded: its tokens / seq_len
        "real_tokens": real_tokens(host_batch),
        "head_rows": host_batch["masked_labels"].numel(),
        "attention_pairs": attention_pairs(host_batch),
        "device_pairs": device_attention_pairs(host_batch),
    }


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step processed, summed over micro-batches and the model's ranks."""

    rows: float  # rows of seq_len tokens the devices ran (padding included)
    instances: float  # training instances (== rows unpacked; several per packed row)
    real_tokens: float  # non-padding tokens
    predictions: float  # MLM head rows computed (slots of masked_positions, labelled or not)
    attention_pairs: float | None = None  # sum over instances of length squared (None: not counted, full rows)
    labelled: float | None = None  # MLM predictions with a label: the head's model work (None: not counted)
    device_pairs: float | None = None  # query-key pairs the device computed, with padding (None: full rows)

    def __add__(self, other: StepCounts) -> StepCounts:
        """Two steps' counts summed (a benchmark's steps); an optional count stays if both have it."""
        def both(mine: float | None, theirs: float | None) -> float | None:
            return None if mine is None or theirs is None else mine + theirs

        return StepCounts(self.rows + other.rows, self.instances + other.instances,
                          self.real_tokens + other.real_tokens, self.predictions + other.predictions,
                          both(self.attention_pairs, other.attention_pairs),
                          both(self.labelled, other.labelled), both(self.device_pairs, other.device_pairs))

    def data_stats(self, seq_len: int) -> dict[str, float]:
        """Instances per row and padding share of the step's rows (all ranks), logged as data/*."""
        if not self.rows:
            return {}
        return {
            "data/packing_factor": self.instances / self.rows,
            "data/padding_fraction": 1.0 - self.real_tokens / (self.rows * seq_len),
        }


@dataclass
class StepTotals:
    """A step's statistics summed over the model's ranks: every name of DEVICE_SUMS and HOST_COUNTS, and the
    extra loss terms' numbers (summed over micro-batches and ranks; the trainer takes their mean)."""

    sums: dict[str, float]
    extras: dict[str, float]
    counted: dict[str, float] = field(default_factory=dict)  # the step monitors' host counts (StepSums.counted)

    def __getitem__(self, name: str) -> float:
        return self.sums[name]

    def counts(self) -> StepCounts:
        """What the step processed, every count the FLOP model reads (pretrain/metrics/throughput.py)."""
        sums = self.sums
        return StepCounts(rows=sums["rows"], instances=sums["instances"], real_tokens=sums["real_tokens"],
                          predictions=sums["head_rows"], attention_pairs=sums["attention_pairs"],
                          labelled=sums["mlm_labelled"], device_pairs=sums["device_pairs"])


@dataclass
class StepSums:
    """Accumulates the micro-batches of one step on this rank."""

    device: torch.device
    counted_names: tuple[str, ...] = ()  # what the step monitors count on the host (every rank: the same names)
    on_device: torch.Tensor = field(init=False)
    on_host: dict[str, float] = field(init=False)
    counted: dict[str, float] = field(init=False)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.on_device = torch.zeros(len(DEVICE_SUMS), dtype=torch.float64, device=self.device)
        self.on_host = dict.fromkeys(HOST_COUNTS, 0.0)
        self.counted = dict.fromkeys(self.counted_names, 0.0)

    def count(self, numbers: dict[str, float]) -> None:
        """A step monitor's host counts of one micro-batch (names it declared: they ride the step's one reduce)."""
        for name, value in numbers.items():
            if name not in self.counted:
                raise KeyError(f"a step monitor counted {name!r} without declaring it (StepMonitor.counts)")
            self.counted[name] += float(value)

    @torch.no_grad()
    def add(self, output: PretrainingOutput, batch: dict[str, torch.Tensor], host_batch: dict[str, torch.Tensor],
            loss: torch.Tensor, extra: dict[str, Any]) -> None:
        """One micro-batch: `batch` is its device copy (what the model ran on), `host_batch` the collated one.
        A non-finite loss adds its micro-batch to `nonfinite` and nothing to the loss sums."""
        finite = torch.isfinite(loss.detach()).double()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        mlm_correct, _ = output.mlm_counts()  # the head ran on every slot; empty ones are excluded
        self.on_device += torch.stack([
            torch.where(finite > 0, output.mlm_loss_sum.detach().double(), zero),
            torch.where(finite > 0, output.nsp_loss.detach().double(), zero),
            mlm_correct.double(),
            zero if output.nsp_logits is None else (output.nsp_logits.argmax(-1) == batch["next_sentence_label"]).sum().double(),
            1.0 - finite,
        ])
        for name, value in host_counts(host_batch).items():
            self.on_host[name] += value
        for key, value in extra.items():
            value = torch.as_tensor(value, dtype=torch.float64).to(self.device, non_blocking=True)
            self.extras[key] = self.extras.get(key, zero) + value

    def reduce(self, stop: bool, save_due: bool, group: Any, world_size: int) -> StepTotals:
        """Sum over the ranks of `group` (one all-reduce) and read on the host (the step's one sync)."""
        self.on_host["stop"] = float(stop)
        self.on_host["save_due"] = float(save_due)
        host = host_values_to_device([self.on_host[name] for name in HOST_COUNTS]
                                     + [self.counted[name] for name in self.counted_names], self.device)
        packed = torch.cat([self.on_device, host, *(value.reshape(1) for value in self.extras.values())])
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(packed, group=group)
        reduced = packed.tolist()
        names = DEVICE_SUMS + HOST_COUNTS
        counted_end = len(names) + len(self.counted_names)
        return StepTotals(sums=dict(zip(names, reduced, strict=False)),
                          extras=dict(zip(self.extras, reduced[counted_end:], strict=True)),
                          counted=dict(zip(self.counted_names, reduced[len(names):counted_end], strict=True)))


@dataclass
class StepResult:
    applied: bool
    nonfinite: bool
    values: dict[str, float]
    counts: StepCounts  # rows, instances, real tokens, MLM predictions of the step over the model's ranks
    stop_requested: bool = False  # some rank received a stop signal before this step's all-reduce
    save_due: bool = False  # some rank's clock says checkpoint.every_minutes have passed (agreed over the job)
    abort_elsewhere: str | None = None  # why another part of the job aborts at this step (plugin.agree_on_step)
    counted: dict[str, float] = field(default_factory=dict)  # the step monitors' host counts over the model's ranks
