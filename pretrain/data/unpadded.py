"""The unpadded micro-batch, laid out on the host (in the DataLoader workers), never on the device.

Every instance's real tokens, one after the other, as one flat sequence of T tokens; nothing of
`seq_len` survives but the bound `max_seqlen`. The device then needs no `nonzero` (a data-dependent
shape, i.e. a device -> host sync) to find the tokens: the collator knows them.

    input_ids, token_type_ids, position_ids   [T_b]   the flat tokens; positions restart at 0 per instance
    cu_seqlens          [instances + 2] int32  0, end of instance 1, ..., end of the last instance (= T), T_b:
                                               instance i is tokens cu_seqlens[i] .. cu_seqlens[i+1]-1
    max_seqlen          int                    the phase's seq_len: an upper bound of every segment's length
    masked_positions / masked_labels [instances, max_predictions]  MLM targets as flat indices into the
                                               T_b tokens (empty slots: the instance's [CLS], IGNORE_INDEX)
    next_sentence_label [instances]

T_b is T rounded up to a multiple of `BUCKET_TOKENS` (at most seq_len): the tail T .. T_b-1 is padding
and one segment of its own in `cu_seqlens` (possibly empty), so attention stays confined and no real
token reads it. The instance count of a micro-batch is fixed; rounding T makes the token count take
few distinct values, so a compiled layer sees few shapes (pretrain/model/compiled.py marks the
token dimension dynamic besides).

The instances, their masks and their order are those of the padded collate (pretrain/data/batches.py masks
them first, the same way for every layout); the MLM labels come out in the padded order too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pretrain.model.bert import IGNORE_INDEX

BUCKET_TOKENS = 64  # T_b is a multiple of this (capped at seq_len): few distinct shapes, little padding
UNPADDED_KEYS = ("cu_seqlens", "max_seqlen")


def bucketed(tokens: int, seq_len: int, bucket: int = BUCKET_TOKENS) -> int:
    """`tokens` rounded up to a multiple of min(bucket, seq_len): the tail stays shorter than seq_len."""
    step = max(1, min(bucket, seq_len))
    return -(-tokens // step) * step


def unpad_masked_instances(
    instances: list[dict[str, Any]], seq_len: int, max_predictions: int, pad_id: int,
    bucket: int = BUCKET_TOKENS,
) -> dict[str, Any]:
    """Already-masked instances (ids, a_len, positions, labels, nsp) -> the unpadded tensors above."""
    lengths = [len(inst["ids"]) for inst in instances]
    if any(length > seq_len for length in lengths):
        raise ValueError(f"an instance has {max(lengths)} tokens, more than seq_len {seq_len}")
    total = int(sum(lengths))
    padded_total = bucketed(total, seq_len, bucket)
    input_ids = np.full(padded_total, pad_id, dtype=np.int64)
    token_types = np.zeros(padded_total, dtype=np.int64)
    position_ids = np.zeros(padded_total, dtype=np.int64)
    cu_seqlens = np.zeros(len(instances) + 2, dtype=np.int32)
    masked_positions = np.zeros((len(instances), max_predictions), dtype=np.int64)
    masked_labels = np.full((len(instances), max_predictions), IGNORE_INDEX, dtype=np.int64)
    nsp = np.zeros(len(instances), dtype=np.int64)
    start = 0
    for i, inst in enumerate(instances):
        n = lengths[i]
        input_ids[start : start + n] = inst["ids"]
        token_types[start + int(inst["a_len"]) : start + n] = 1
        position_ids[start : start + n] = np.arange(n)
        pos = np.asarray(inst["positions"], dtype=np.int64)[:max_predictions]  # static shards: uint16
        if len(pos) and int(pos.max()) >= n:  # it would label another instance's token
            raise ValueError(f"masked position {int(pos.max())} outside its instance of {n} tokens")
        lab = np.asarray(inst["labels"])[:max_predictions]
        masked_positions[i] = start  # empty slots: the instance's [CLS], as padded
        masked_positions[i, : len(pos)] = pos + start
        masked_labels[i, : len(lab)] = lab
        nsp[i] = int(inst["nsp"])
        start += n
        cu_seqlens[i + 1] = start
    tail = padded_total - total
    position_ids[total:] = np.arange(tail)  # the tail is a segment of its own, shorter than seq_len
    cu_seqlens[-1] = padded_total
    return {
        "input_ids": torch.from_numpy(input_ids),
        "token_type_ids": torch.from_numpy(token_types),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "max_seqlen": int(seq_len),
        "masked_positions": torch.from_numpy(masked_positions),
        "masked_labels": torch.from_numpy(masked_labels),
        "next_sentence_label": torch.from_numpy(nsp),
    }


def is_unpadded(batch: dict[str, Any]) -> bool:
    return "cu_seqlens" in batch


def real_tokens(host_batch: dict[str, Any]) -> int:
    """Non-padding tokens of a collated micro-batch of any layout (host copy: no device work)."""
    if is_unpadded(host_batch):
        return int(host_batch["cu_seqlens"][-2])
    return int(host_batch["attention_mask"].sum())


def device_rows(host_batch: dict[str, Any]) -> float:
    """Rows of seq_len the device runs: padded/packed rows, or the unpadded tokens T_b / seq_len (a
    fraction): what throughput, FLOPs and the padding share count (pretrain/metrics/writer.py)."""
    if is_unpadded(host_batch):
        return host_batch["input_ids"].numel() / host_batch["max_seqlen"]
    return float(host_batch["input_ids"].size(0))


def attention_pairs(host_batch: dict[str, Any]) -> int:
    """The query-key pairs attention needs in a collated micro-batch of any layout: the sum over its instances of
    length squared (each instance attends within itself; the unpadded bucket tail and padding are not model work).
    Counted on the host copy, no device work: the attention term of the FLOP model (pretrain/metrics/throughput.py)."""
    if is_unpadded(host_batch):
        lengths = host_batch["cu_seqlens"][:-1].diff()  # the instances' segments, not the tail
    elif "segment_ids" in host_batch:  # packed rows: ids 1..k per instance of a row, 0 = padding
        segments = host_batch["segment_ids"].long()
        slots = int(segments.max()) + 1
        row = torch.arange(segments.size(0))[:, None] * slots
        lengths = torch.bincount((segments + row).flatten(), minlength=segments.size(0) * slots)
        lengths = lengths.view(-1, slots)[:, 1:]
    else:
        lengths = host_batch["attention_mask"].sum(1)
    return int((lengths.long() ** 2).sum())
