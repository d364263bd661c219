"""The padded and packed paths' masks match the attention implementation the model runs (pretrain/model/bert.py).

transformers hands a prepared 4D mask to the attention function unchanged; eager attention adds it to the scores,
so a bool mask there would add 0/1 and leave padding unmasked. The model builds the mask for the implementation
its config names at each forward, and refuses one it builds no mask for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pretrain.data.batches import Collator, PhaseData
from pretrain.model.bert import SparseBertForPreTraining, bert_config, build_model, key_padding_mask
from tests.support.model_fixtures import both_layouts, forward_and_grads, no_dropout_model, rows_of

LENGTHS = [32, 7, 19, 3, 31, 12]


def packed_batch(data: PhaseData) -> dict[str, Any]:
    rows = rows_of(data, LENGTHS)
    return Collator(data, packing=True)(rows, [np.random.default_rng([3, i]) for i in range(len(rows))])


def test_eager_attention_gets_an_additive_mask_and_trains_like_sdpa(data: PhaseData) -> None:
    padded, _ = both_layouts(data, LENGTHS)
    packed = packed_batch(data)
    assert packed["input_ids"].size(0) < len(LENGTHS)  # several instances in a row: the block-diagonal mask
    model = no_dropout_model(data.vocab.size)
    assert model.config._attn_implementation == "sdpa"
    want = [forward_and_grads(model, batch) for batch in (padded, packed)]
    # the trap of the review: another model made from this config asks for eager, and flips this one
    SparseBertForPreTraining._from_config(model.config, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    for batch, (outputs, grads) in zip((padded, packed), want, strict=True):
        got, got_grads = forward_and_grads(model, batch)
        torch.testing.assert_close(got["loss"], outputs["loss"], rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # what the conversion prevents: the bool mask added as 0/1 by eager attention leaves the padding unmasked
    mask = key_padding_mask(padded["attention_mask"])
    unconverted = model.bert(input_ids=padded["input_ids"], attention_mask=mask,
                             token_type_ids=padded["token_type_ids"])[0]
    converted = model.bert(input_ids=padded["input_ids"], attention_mask=model.attention_mask(mask),
                           token_type_ids=padded["token_type_ids"])[0]
    assert (unconverted - converted).abs().max() > 1e-3


def test_an_implementation_the_mask_is_not_built_for_is_refused(data: PhaseData) -> None:
    padded, unpadded = both_layouts(data, LENGTHS)
    model = no_dropout_model(data.vocab.size)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="^the padded path builds its attention masks for sdpa or eager attention; "
                                         "this model's attn_implementation is 'flash_attention_2'$"):
        model(**padded)
    model(**unpadded)  # the unpadded path builds no mask: its varlen kernel is its own


def test_build_model_leaves_the_callers_config_alone(data: PhaseData) -> None:
    config = bert_config("tiny", data.vocab.size, 64)
    config._attn_implementation = "eager"
    model = build_model(config)
    assert model.config._attn_implementation == "sdpa" and config._attn_implementation == "eager"
    assert model.config is not config
