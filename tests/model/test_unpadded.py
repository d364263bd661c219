"""The unpadded path against the padded reference: layout, forward, gradients, dropout, kernels (eager).

Batches come from the production collate (pretrain/data/batches.py `Collator`) over the tiny shards' vocab, in
both layouts from the same rows and the same masking generators, so the instances and masks are the ones
a run trains on. Compiled layers: tests/model/test_compiled.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pretrain.data.batches import PhaseData
from pretrain.data.unpadded import bucketed, device_rows, real_tokens, unpad_masked_instances
from pretrain.model.bert import IGNORE_INDEX, bert_config, build_model
from pretrain.model.kernel_support import DeviceFacts, unpadded_problem
from pretrain.model.varlen_attention import reference_varlen_attention, segment_index
from tests.support.model_fixtures import SEQ, both_layouts, forward_and_grads, no_dropout_model

LENGTHS = {
    "one instance exactly seq_len, the others short": [SEQ, 7, 19, 3, SEQ - 1],
    "many short instances": [3, 4, 5, 6, 3, 9, 4, 5, 3, 8, 3, 4],
    "a single instance": [21],
}


@pytest.mark.parametrize("case", list(LENGTHS))
def test_unpadded_forward_and_gradients_equal_padded(data: PhaseData, case: str) -> None:
    padded, unpadded = both_layouts(data, LENGTHS[case])
    model = no_dropout_model(data.vocab.size)
    want, want_grads = forward_and_grads(model, padded)
    got, got_grads = forward_and_grads(model, unpadded)
    assert torch.equal(got["mlm_labels"], want["mlm_labels"])  # the same targets, in the same order
    for key in ("loss", "mlm_logits", "nsp_logits"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == len(list(model.parameters()))
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_unpadded_layout_holds_the_padded_batchs_tokens(data: PhaseData) -> None:
    lengths = LENGTHS["one instance exactly seq_len, the others short"]
    padded, unpadded = both_layouts(data, lengths)
    total = sum(lengths)
    cu = unpadded["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *np.cumsum(lengths).tolist(), bucketed(total, SEQ)]
    assert unpadded["input_ids"].shape == (bucketed(total, SEQ),) and unpadded["max_seqlen"] == SEQ
    real = padded["attention_mask"].bool()
    for key in ("input_ids", "token_type_ids"):
        assert torch.equal(unpadded[key][:total], padded[key][real])
    assert torch.equal(unpadded["position_ids"][:total], torch.cat([torch.arange(n) for n in lengths]))
    assert torch.equal(unpadded["next_sentence_label"], padded["next_sentence_label"])
    labelled = padded["masked_labels"] != IGNORE_INDEX
    rows = torch.arange(len(lengths))[:, None].expand_as(labelled)
    assert torch.equal(unpadded["input_ids"][unpadded["masked_positions"][labelled]],
                       padded["input_ids"][rows[labelled], padded["masked_positions"][labelled]])
    assert real_tokens(unpadded) == real_tokens(padded) == total
    assert device_rows(unpadded) == bucketed(total, SEQ) / SEQ and device_rows(padded) == len(lengths)


def test_the_token_count_is_bucketed_below_seq_len() -> None:
    assert [bucketed(n, 128) for n in (1, 64, 65, 8000, 8001)] == [64, 64, 128, 8000, 8064]
    assert bucketed(40, 16) == 48  # the tail stays shorter than seq_len
    with pytest.raises(ValueError, match="more than seq_len 8"):
        unpad_masked_instances([{"ids": np.arange(9), "a_len": 2, "positions": [], "labels": [], "nsp": 0}], 8, 2, 0)


def test_reference_kernel_confines_attention_and_survives_an_empty_tail() -> None:
    """Two segments and an empty tail: each token's output depends on its own segment's keys only, and
    nothing is NaN (the empty tail's row is never fully masked)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 10, 10], dtype=torch.int32)
    out = reference_varlen_attention(q, k, v, cu, 8, 0.0, 8**-0.5)
    for lo, hi in ((0, 4), (4, 10)):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1)).transpose(0, 1)
        torch.testing.assert_close(out[lo:hi], alone)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    index, keys = segment_index(cu, 10, 8)
    assert index.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13] and keys.sum(-1).tolist() == [4, 6, 1]


def test_attention_dropout_runs_in_the_unpadded_path(data: PhaseData) -> None:
    """attention_probs_dropout_prob is applied (never silently dropped): with only attention dropout on,
    training forwards differ between seeds; in eval mode they equal the padded path."""
    _, unpadded = both_layouts(data, LENGTHS["many short instances"])
    torch.manual_seed(0)
    model = build_model(bert_config("tiny", data.vocab.size, 64, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.5))
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():  # still training mode: dropout on
            losses.append(float(model(**unpadded).loss))
    assert losses[0] != losses[1]
    model.eval()
    with torch.no_grad():
        assert float(model(**unpadded).loss) == float(model(**unpadded).loss)


def test_activation_checkpointing_recomputes_the_same_gradients(data: PhaseData) -> None:
    _, unpadded = both_layouts(data, LENGTHS["many short instances"])
    plain = no_dropout_model(data.vocab.size)
    checkpointed = no_dropout_model(data.vocab.size)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, want = forward_and_grads(plain, unpadded)
    _, got = forward_and_grads(checkpointed, unpadded)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_cpu_needs_no_cuda_kernel() -> None:
    assert unpadded_problem(DeviceFacts("cpu"), "fp32", 64) is None


def test_a_decoder_bert_is_refused_by_the_unpadded_path(data: PhaseData) -> None:
    _, unpadded = both_layouts(data, [5, 6])
    model = no_dropout_model(data.vocab.size)
    from pretrain.model.unpadded import check_layers_supported

    model.config.is_decoder = True
    with pytest.raises(ValueError, match="model.attention=padded runs it"):
        check_layers_supported(model)
