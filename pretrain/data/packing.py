"""Sequence packing: several short instances share one row, attention stays inside each instance.

At seq 512 about half of an unpacked batch is padding. With `phaseN.packing=true` a micro-batch is
still `train_micro_batch_size_per_gpu` *instances* (so data order, resume positions, batch sizes
and LR schedules mean exactly what they mean unpacked), but they are laid out first-fit-decreasing
into as few rows of `seq_len` as fit, at most MAX_INSTANCES_PER_ROW per row. The row count varies
from batch to batch; the model computes the same losses it would unpacked:

    segment_ids      [rows, seq]   1..k = which instance of the row a token belongs to, 0 = padding;
                                    the model turns it into a block-diagonal attention mask
    position_ids     [rows, seq]   restart at 0 for every instance
    token_type_ids   [rows, seq]   per instance (A = 0, B = 1), as unpacked
    cls_positions    [rows, K]     where each instance's [CLS] sits (NSP pools there); K = MAX_INSTANCES_PER_ROW
    next_sentence_label [rows*K]   one label per slot, IGNORE_INDEX for empty slots
    masked_positions / masked_labels [instances, max_predictions]  MLM targets of instance i (input
                                    order) in row i, as flat indices row*seq + offset + position into
                                    the rows*seq tokens; empty slots: the instance's [CLS]
                                    (its position 0, as unpacked), IGNORE_INDEX

The MLM targets are per instance, not per row, because the head runs on every slot (a fixed-size
gather, no host sync: pretrain/model/bert.py): per-row slots would be K*max_predictions per row, mostly
empty, i.e. up to K times the head rows of the unpacked layout. Per instance, the head runs on exactly
instances*max_predictions rows in both layouts, and the labels come out in the unpacked order.

MLM loss is the mean over all labelled tokens and NSP loss the mean over all instances of the
micro-batch, in both layouts; tests/data/test_packing.py checks packed == unpacked within fp32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pretrain.model.bert import IGNORE_INDEX, block_diagonal_mask

__all__ = ["MAX_INSTANCES_PER_ROW", "PackingMeter", "block_diagonal_mask", "first_fit_decreasing",
           "pack_masked_instances"]

MAX_INSTANCES_PER_ROW = 4  # bounds the NSP/MLM slot arrays; MLPerf's packed BERT data uses up to 3


def first_fit_decreasing(lengths: list[int], capacity: int, max_per_row: int = MAX_INSTANCES_PER_ROW) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of total length <= capacity, longest first.

    Deterministic: ties keep input order, and rows list their instances in placement order.
    """
    if max_per_row < 1:
        raise ValueError(f"max_per_row must be >= 1, got {max_per_row}")
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"instance {index} has {length} tokens, more than the row capacity {capacity}")
        for row, space in enumerate(free):
            if length <= space and len(rows[row]) < max_per_row:
                rows[row].append(index)
                free[row] -= length
                break
        else:
            rows.append([index])
            free.append(capacity - length)
    return rows


def pack_masked_instances(
    instances: list[dict[str, np.ndarray | int]], seq_len: int, max_predictions: int, pad_id: int,
    max_per_row: int = MAX_INSTANCES_PER_ROW,
) -> dict[str, torch.Tensor]:
    """Already-masked instances (ids, a_len, positions, labels, nsp) -> the packed tensors above."""
    rows = first_fit_decreasing([len(inst["ids"]) for inst in instances], seq_len, max_per_row)
    count = len(rows)
    input_ids = np.full((count, seq_len), pad_id, dtype=np.int64)
    token_types = np.zeros((count, seq_len), dtype=np.int64)
    segments = np.zeros((count, seq_len), dtype=np.int64)
    positions_ids = np.zeros((count, seq_len), dtype=np.int64)
    cls_positions = np.zeros((count, max_per_row), dtype=np.int64)
    nsp = np.full((count, max_per_row), IGNORE_INDEX, dtype=np.int64)
    masked_positions = np.zeros((len(instances), max_predictions), dtype=np.int64)
    masked_labels = np.full((len(instances), max_predictions), IGNORE_INDEX, dtype=np.int64)
    for r, members in enumerate(rows):
        offset = 0
        for k, index in enumerate(members):
            inst = instances[index]
            ids = np.asarray(inst["ids"])
            n = len(ids)
            input_ids[r, offset : offset + n] = ids
            token_types[r, offset + int(inst["a_len"]) : offset + n] = 1
            segments[r, offset : offset + n] = k + 1
            positions_ids[r, offset : offset + n] = np.arange(n)
            cls_positions[r, k] = offset
            nsp[r, k] = int(inst["nsp"])
            pos = np.asarray(inst["positions"], dtype=np.int64)[:max_predictions]  # static shards: uint16
            masked_positions[index] = r * seq_len + offset  # empty slots: the instance's [CLS], as unpacked
            lab = np.asarray(inst["labels"])[:max_predictions]
            masked_positions[index, : len(pos)] = pos + r * seq_len + offset
            masked_labels[index, : len(lab)] = lab
            offset += n
    return {
        "input_ids": torch.from_numpy(input_ids),
        "token_type_ids": torch.from_numpy(token_types),
        "attention_mask": torch.from_numpy((segments > 0).astype(np.int64)),
        "segment_ids": torch.from_numpy(segments),
        "position_ids": torch.from_numpy(positions_ids),
        "cls_positions": torch.from_numpy(cls_positions),
        "masked_positions": torch.from_numpy(masked_positions),
        "masked_labels": torch.from_numpy(masked_labels),
        "next_sentence_label": torch.from_numpy(nsp.reshape(-1)),
    }


class PackingMeter:
    """Instances per row and padding share of the micro-batches since the last `take()` (either layout)."""

    def __init__(self) -> None:
        self.rows = self.instances = self.tokens = self.slots = 0

    def observe(self, batch: dict[str, Any]) -> None:
        self.rows += int(batch["input_ids"].size(0))
        self.instances += int((batch["next_sentence_label"] != IGNORE_INDEX).sum())
        self.tokens += int(batch["attention_mask"].sum())
        self.slots += int(batch["attention_mask"].numel())

    def take(self) -> dict[str, float]:
        if not self.rows:
            return {}
        values = {
            "data/packing_factor": self.instances / self.rows,
            "data/padding_fraction": 1.0 - self.tokens / max(self.slots, 1),
        }
        self.__init__()
        return values
