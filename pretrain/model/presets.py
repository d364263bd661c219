"""The architecture presets `model.preset` names, without torch or transformers.

bert.py builds a `BertConfig` from them; the launch-time check (pretrain/launch/preflight.py) reads them
to size a run's checkpoints (pretrain/checkpointing/footprint.py) in a process that must not import torch.
"""

from __future__ import annotations

from typing import Any

# bert-base / bert-large are the published shapes; the tiny ones exist for CPU tests.
PRESETS: dict[str, dict[str, Any]] = {
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128),
}
TYPE_VOCAB_SIZE = 2  # transformers' BertConfig default (segments A and B); a field model.overrides may change


def unknown_preset(preset: str) -> str:
    """The error text for a preset name that is not in PRESETS (one wording for every caller)."""
    return f"model.preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}"


def bert_parameter_count(fields: dict[str, Any]) -> int:
    """Distinct parameters of `BertForPreTraining` with these BertConfig fields (hidden_size,
    num_hidden_layers, intermediate_size, vocab_size, max_position_embeddings; type_vocab_size optional).

    Counted once each, as the optimizer and a checkpoint hold them: the MLM decoder's weight is the word
    embedding matrix and its bias is `cls.predictions.bias` (tied). tests/checkpointing/test_footprint.py
    compares this with a built model.
    """
    d, layers, inner = fields["hidden_size"], fields["num_hidden_layers"], fields["intermediate_size"]
    vocab, positions = fields["vocab_size"], fields["max_position_embeddings"]
    types = fields.get("type_vocab_size", TYPE_VOCAB_SIZE)
    embeddings = (vocab + positions + types) * d + 2 * d  # three tables + LayerNorm
    layer = 4 * (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d) + 2 * d  # attention, LN, FFN, LN
    pooler = d * d + d
    head = (d * d + d) + 2 * d + vocab + (2 * d + 2)  # transform + LN + decoder bias; NSP classifier
    return embeddings + layers * layer + pooler + head


def flop_parameter_counts(fields: dict[str, Any]) -> tuple[int, int]:
    """(N_enc, N_head) of the FLOP model (pretrain/metrics/throughput.py) with these BertConfig fields: the encoder
    layers and pooler, and the MLM head with its vocab x d decoder counted (it computes, tied or not). The run plan
    sizes throughput from them before any model exists; tests/metrics/ compares them with a built model's
    `count_parameters`."""
    d, layers, inner, vocab = (fields["hidden_size"], fields["num_hidden_layers"], fields["intermediate_size"],
                               fields["vocab_size"])
    layer = 4 * (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d) + 2 * d
    encoder = layers * layer + d * d + d  # + pooler
    head = (d * d + d) + 2 * d + vocab * d + vocab  # transform, LayerNorm, decoder weight and bias
    return encoder, head
