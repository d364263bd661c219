"""The model and the throughput numbers: the sparse MLM head against Hugging Face's, a forward with no
data-dependent shape (no host sync on GPU), the FLOP model, MFU, and rows vs instances when packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertForPreTraining

from pretrain.data.packing import pack_masked_instances
from pretrain.metrics.throughput import Throughput, ThroughputSettings, flops_per_sequence
from pretrain.model.bert import bert_config, build_model, count_parameters
from pretrain.step_stats import StepCounts


def test_sparse_head_equals_hf_pretraining_loss_and_names() -> None:
    config = bert_config("tiny", vocab_size=48, max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = build_model(config).eval()
    reference = BertForPreTraining(config).eval()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    reference.load_state_dict(model.state_dict())
    input_ids = torch.randint(5, 48, (3, 20))
    positions = torch.tensor([[1, 4, 7], [2, 3, 0], [5, 0, 0]])
    labels = torch.tensor([[9, 10, 11], [12, 13, -100], [14, -100, -100]])
    nsp = torch.tensor([0, 1, 0])
    token_types, attention = torch.zeros_like(input_ids), torch.ones_like(input_ids)
    out = model(input_ids, token_types, attention, positions, labels, nsp)
    dense_labels = torch.full_like(input_ids, -100)
    for b in range(3):
        for p, lab in zip(positions[b], labels[b], strict=True):
            if lab != -100:
                dense_labels[b, p] = lab
    ref = reference(input_ids=input_ids, token_type_ids=token_types, attention_mask=attention,
                    labels=dense_labels, next_sentence_label=nsp)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert out.mlm_logits.shape == (9, 48) and int(out.mlm_mask.sum()) == 6  # every slot; 6 labelled
    torch.testing.assert_close(out.mlm_logits[out.mlm_mask], ref.prediction_logits[dense_labels != -100],
                               rtol=1e-5, atol=1e-5)


def data_dependent_shapes(fn: object, *args: torch.Tensor) -> list[tuple[str, tuple]]:
    """Nodes of `fn`'s traced graph (torch.compile, whole graph) whose shape depends on tensor values
    (unbacked symbols, e.g. after a boolean index): each one is a device -> host sync on GPU."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found: list[tuple[str, tuple]] = []

    def inspect(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in graph_module.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and free_unbacked_symbols(value.shape):
                found.append((node.name, tuple(value.shape)))
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=inspect)(*args)
    return found


def test_forward_has_no_data_dependent_shape() -> None:
    """The MLM head runs on every slot: batch x max_predictions logits however many labels are valid, and no
    value-dependent shape anywhere in the forward, unpacked or packed (the check does catch a boolean select)."""
    config = bert_config("tiny", vocab_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    model = build_model(config)
    ids = torch.randint(5, 48, (3, 20))
    positions = torch.tensor([[1, 4, 7, 9], [2, 3, 0, 0], [5, 0, 0, 0]])
    for labels in (torch.randint(5, 48, (3, 4)), torch.tensor([[9, 10, 11, -100], [12, -100, -100, -100]] + [[-100] * 4]),
                   torch.full((3, 4), -100)):
        out = model(ids, torch.zeros_like(ids), torch.ones_like(ids), positions, labels, torch.tensor([0, 1, 0]))
        assert out.mlm_logits.shape == (12, 48) and out.mlm_labels.shape == (12,)
        assert torch.isfinite(out.loss)  # no labels at all: mlm loss 0, not 0/0
    assert out.mlm_loss.item() == 0.0

    def forward(*batch: torch.Tensor) -> torch.Tensor:
        return model(*batch).loss

    unpacked = (ids, torch.zeros_like(ids), torch.ones_like(ids), positions, labels, torch.tensor([0, 1, 0]))
    assert data_dependent_shapes(forward, *unpacked) == []
    instances = [{"ids": np.array([2, *range(5, 5 + n), 3]), "a_len": 3, "positions": np.arange(1, 1 + n // 4),
                  "labels": np.full(n // 4, 7), "nsp": n % 2} for n in (12, 20, 6, 9)]
    packed = pack_masked_instances(instances, 32, 4, 0)
    assert packed["masked_positions"].shape == (4, 4) and packed["input_ids"].size(0) < 4

    def packed_forward(*values: torch.Tensor) -> torch.Tensor:
        return model(**dict(zip(packed, values, strict=True))).loss

    assert data_dependent_shapes(packed_forward, *packed.values()) == []

    def boolean_select(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits[labels != -100].sum()

    assert data_dependent_shapes(boolean_select, torch.randn(12, 48), labels.reshape(-1)) != []


def test_flop_model_and_mfu() -> None:
    layers, d, vocab = 24, 1024, 30522
    encoder = layers * (4 * d * d + 4 * d + 2 * d * 4 * d + 4 * d + d + 4 * d) + d * d + d  # + pooler
    tiny = build_model(bert_config("tiny", vocab_size=48, max_position_embeddings=64))
    tiny_counts = count_parameters(tiny)
    h, L = 64, 2
    assert tiny_counts["encoder"] == L * (4 * h * h + 4 * h + 2 * h * 2 * h + 2 * h + h + 4 * h) + h * h + h
    assert tiny_counts["mlm_head"] == h * h + h + 2 * h + 48 * h + 48
    flops = flops_per_sequence(encoder, d * d + 3 * d + vocab * d + vocab, layers, d, 128, 20)
    assert flops == pytest.approx(6 * encoder * 128 + 12 * layers * d * 128**2 + 6 * (d * d + 3 * d + vocab * d + vocab) * 20)
    assert 2.0e11 < flops < 2.6e11  # ~0.23 TFLOP per BERT-Large sequence at 128
    head = d * d + 3 * d + vocab * d + vocab
    meter = Throughput.of(ThroughputSettings(encoder, head, layers, d, 128, 20, peak_tflops=312.0), world_size=8)
    rows = 65536
    stats = meter.step(StepCounts(rows=rows, instances=rows, real_tokens=rows * 128, predictions=rows * 20))
    assert stats["perf/mfu"] == pytest.approx(stats["perf/tflops"] / (312.0 * 8))
    # full rows and no optional counts: the model's work is the device's, a full row's flops_per_sequence each
    assert stats["perf/device_tflops"] == pytest.approx(stats["perf/tflops"], rel=1e-12)
    assert stats["perf/device_mfu"] == pytest.approx(stats["perf/mfu"], rel=1e-12)


def test_throughput_counts_rows_for_device_work_and_instances_for_useful_work() -> None:
    """Known counts of one step over all ranks, 2 s: each rate exactly. Packed: 25 instances in 10 rows of
    128 (1000 real tokens, 40,000 query-key pairs, 400 labelled of 25 x 20 head slots): the model's FLOPs on
    those, the device's on 10 full rows and every slot. Unpacked without the optional counts: full rows, every
    slot."""
    settings = ThroughputSettings(encoder_params=1000, head_params=100, layers=2, hidden=8, seq_len=128,
                                  predictions=20, peak_tflops=0.01)
    per_token, per_pair, per_slot = 6 * 1000, 12 * 2 * 8, 6 * 100
    meter = Throughput.of(settings, world_size=2)
    packed = StepCounts(rows=10, instances=25, real_tokens=1000, predictions=25 * 20, attention_pairs=40_000,
                        labelled=400, device_pairs=10 * 128**2)
    stats = meter.rates(packed, seconds=2.0)
    model = (per_token * 1000 + per_pair * 40_000 + per_slot * 400) / 2.0 / 1e12
    device = (per_token * 10 * 128 + per_pair * 10 * 128**2 + per_slot * 500) / 2.0 / 1e12
    assert stats == pytest.approx({
        "perf/seq_per_s": 5.0, "perf/tokens_per_s": 640.0, "perf/instances_per_s": 12.5,
        "perf/real_tokens_per_s": 500.0, "perf/tflops": model, "perf/mfu": model / 0.02,
        "perf/device_tflops": device, "perf/device_mfu": device / 0.02, "perf/step_s": 2.0,
    }, rel=1e-12)
    assert packed.data_stats(128) == pytest.approx(
        {"data/packing_factor": 2.5, "data/padding_fraction": 1 - 1000 / 1280}, rel=1e-12)
    unpacked = StepCounts(rows=8, instances=8, real_tokens=600, predictions=8 * 20)
    stats = meter.rates(unpacked, seconds=2.0)
    assert stats["perf/seq_per_s"] == stats["perf/instances_per_s"] == 4.0
    full_rows = 8 * settings.flops_per_sequence / 2.0 / 1e12
    assert stats["perf/device_tflops"] == pytest.approx(full_rows, rel=1e-12)
    padding = per_token * (8 * 128 - 600) / 2.0 / 1e12  # uncounted pairs and labels: full rows', every slot
    assert stats["perf/tflops"] == pytest.approx(stats["perf/device_tflops"] - padding, rel=1e-12)
    assert unpacked.data_stats(128)["data/packing_factor"] == 1.0
    assert sum([packed, unpacked], packed) == StepCounts(28, 58, 2600, 1160)  # an uncounted count stays None
    assert (packed + packed).labelled == 800


def test_attention_pairs_are_the_instances_lengths_squared_on_every_layout(tmp_path) -> None:
    """Counted on the host copy of each layout: the same sum over instances of length squared, by hand; the unpadded
    bucket tail and the padding count nothing."""
    from pretrain.data.batches import Collator
    from pretrain.data.unpadded import attention_pairs
    from tests.support.model_fixtures import rows_of, tiny_phase_data

    data = tiny_phase_data(tmp_path / "data")
    lengths = [32, 7, 19, 3, 31, 12]
    by_hand = 32 * 32 + 7 * 7 + 19 * 19 + 3 * 3 + 31 * 31 + 12 * 12  # 2548
    rows = rows_of(data, lengths)
    for layout in ({}, {"packing": True}, {"unpadded": True}):
        batch = Collator(data, **layout)(rows, [np.random.default_rng([3, i]) for i in range(len(rows))])
        assert attention_pairs(batch) == by_hand, layout
    unpadded = Collator(data, unpadded=True)(rows, [np.random.default_rng([3, i]) for i in range(len(rows))])
    assert unpadded["cu_seqlens"][-1] > sum(lengths)  # a non-empty tail, not counted


def test_mfu_counts_the_attention_the_instances_need() -> None:
    """perf/tflops by hand: 6 N_enc per real token + 12 L d per query-key pair of each instance + 6 N_head
    per labelled prediction (here uncounted: per head slot); perf/device_tflops: 6 N_enc per token the device
    ran and the bucket tail's pairs too. And the size of what the old attention count (a full row's seq^2 per
    row) overstated: BERT-Large at seq 512, lengths uniform in [128, 512], unpadded: about 2.4 % of the
    encoder's FLOPs (the review's "+2.5 %")."""
    from pretrain.model.presets import PRESETS, flop_parameter_counts

    fields = {**PRESETS["bert-large"], "vocab_size": 30522}
    encoder, head = flop_parameter_counts(fields)
    layers, d, seq, predictions = 24, 1024, 512, 80
    settings = ThroughputSettings(encoder, head, layers, d, seq, predictions, peak_tflops=989.0)
    meter = Throughput.of(settings, world_size=1)
    lengths = list(range(128, 513))  # one instance of each length: uniform in [128, 512]
    tokens = 64 * -(-sum(lengths) // 64)  # the unpadded micro-batch: T rounded up to the 64-token bucket
    pairs = sum(n * n for n in lengths)
    tail = tokens - sum(lengths)
    counts = StepCounts(rows=tokens / seq, instances=len(lengths), real_tokens=sum(lengths),
                        predictions=len(lengths) * predictions, attention_pairs=pairs,
                        device_pairs=pairs + tail**2)
    stats = meter.rates(counts, seconds=1.0)
    head_flops = 6 * head * len(lengths) * predictions
    by_hand = 6 * encoder * sum(lengths) + 12 * layers * d * pairs + head_flops
    assert stats["perf/tflops"] == pytest.approx(by_hand / 1e12, rel=1e-12)
    assert stats["perf/mfu"] == pytest.approx(by_hand / 1e12 / 989.0, rel=1e-12)
    device = 6 * encoder * tokens + 12 * layers * d * (pairs + tail**2) + head_flops
    assert stats["perf/device_tflops"] == pytest.approx(device / 1e12, rel=1e-12)
    old = meter.rates(StepCounts(counts.rows, counts.instances, counts.real_tokens, counts.predictions), 1.0)
    encoder_flops = 6 * encoder * sum(lengths) + 12 * layers * d * pairs
    overstated = (old["perf/tflops"] - stats["perf/tflops"]) * 1e12 / encoder_flops
    assert overstated == pytest.approx(12 * layers * d * (tokens * seq - pairs) / encoder_flops, rel=1e-9)
    assert 0.022 < overstated < 0.026
    full = StepCounts(rows=4, instances=4, real_tokens=4 * seq, predictions=4 * predictions, attention_pairs=4 * seq**2)
    assert meter.rates(full, 1.0)["perf/tflops"] == pytest.approx(4 * settings.flops_per_sequence / 1e12, rel=1e-12)
