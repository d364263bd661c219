"""Batches in both layouts from the production collate, and a dropout-free tiny model (tests/model/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.data.batches import Collator, PhaseData, open_phase_data
from pretrain.model.bert import SparseBertForPreTraining, bert_config, build_model
from tests.support.pretrain_fixtures import build_shards

SEQ = 32


def tiny_phase_data(folder: Path) -> PhaseData:
    """The tiny shards' data at seq SEQ (their vocab is what the collate needs)."""
    return open_phase_data(build_shards(folder, seq_lens=(SEQ,), train=16, val=4), SEQ, None, "data.shards")


def rows_of(data: PhaseData, lengths: list[int], seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    vocab = data.vocab
    rows = []
    for n in lengths:
        ids = rng.integers(5, vocab.size, n)
        ids[0] = vocab.cls_id
        ids[-1] = vocab.sep_id
        rows.append({"input_ids": ids, "a_len": max(1, n // 2), "next_sentence_label": int(rng.integers(0, 2))})
    return rows


def both_layouts(data: PhaseData, lengths: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The padded and the unpadded collate of the same rows, masked by the same per-instance generators."""
    rows = rows_of(data, lengths)
    gens = lambda: [np.random.default_rng([3, i]) for i in range(len(rows))]  # noqa: E731 - one per instance
    return Collator(data)(rows, gens()), Collator(data, unpadded=True)(rows, gens())


def no_dropout_model(vocab_size: int, **overrides: float) -> SparseBertForPreTraining:
    torch.manual_seed(0)
    config = bert_config("tiny", vocab_size, 64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         **overrides)
    return build_model(config)


def forward_and_grads(model: SparseBertForPreTraining, batch: dict[str, Any]) -> tuple[dict, dict]:
    """(loss, logits and labels; the gradient of every parameter) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    values = {"loss": out.loss, "mlm_logits": out.mlm_logits, "nsp_logits": out.nsp_logits,
              "mlm_labels": out.mlm_labels}
    return {k: v.detach().clone() for k, v in values.items()}, {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
