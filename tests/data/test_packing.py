"""Sequence packing: the packer, packed == unpacked losses and gradients, and a packed training run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain.data.batches import Collator, RankBatches, open_phase_data
from pretrain.data.packing import MAX_INSTANCES_PER_ROW, PackingMeter, first_fit_decreasing
from pretrain.model.bert import (
    IGNORE_INDEX,
    PretrainingOutput,
    SparseBertForPreTraining,
    bert_config,
    build_model,
)
from tests.support.pretrain_fixtures import build_shards, short_instances_at_64, tiny_run_config


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tmp_path_factory.mktemp("packing") / "data", seq_lens=(32,), train=48, val=8)


@pytest.mark.parametrize(
    "lengths, capacity, max_per_row, expected",
    [
        ([5, 3, 4, 2], 8, 4, [[0, 1], [2, 3]]),  # 5+3, 4+2: longest first, first row that fits
        ([8, 8], 8, 4, [[0], [1]]),  # full rows stay alone
        ([1, 1, 1, 1, 1], 8, 2, [[0, 1], [2, 3], [4]]),  # the per-row instance cap
        ([2, 6, 6, 2], 8, 4, [[1, 0], [2, 3]]),  # ties keep input order
    ],
)
def test_first_fit_decreasing(lengths: list[int], capacity: int, max_per_row: int, expected: list[list[int]]) -> None:
    assert first_fit_decreasing(lengths, capacity, max_per_row) == expected


def test_first_fit_rejects_an_instance_longer_than_a_row() -> None:
    with pytest.raises(ValueError, match="instance 1 has 9 tokens"):
        first_fit_decreasing([3, 9], 8)


def test_packed_layout_keeps_every_instance(shards: Path) -> None:
    reader_data = open_phase_data(shards, 32, None, "data.shards")
    data = dataclasses.replace(reader_data, seq_len=128)  # rows of 128 hold ~3 instances of 16..32 tokens
    reader = RankBatches(reader_data, "train", 1, 0, 1, 8).reader
    rows = [reader[i] for i in range(10)]
    packed = Collator(data, packing=True)(rows, np.random.default_rng(0))
    plain = Collator(data, packing=False)(rows, np.random.default_rng(0))
    count = packed["input_ids"].size(0)
    assert count < 10 and packed["next_sentence_label"].shape == (count * 4,)
    assert int((packed["next_sentence_label"] != IGNORE_INDEX).sum()) == 10
    assert int(packed["attention_mask"].sum()) == int(plain["attention_mask"].sum())  # same tokens, less padding
    # every instance's tokens appear contiguously with positions 0.. and its [CLS] where cls_positions says
    for r in range(count):
        segments = packed["segment_ids"][r]
        for k in range(1, int(segments.max()) + 1):
            where = (segments == k).nonzero().flatten()
            assert torch.equal(where, torch.arange(int(where[0]), int(where[-1]) + 1))
            assert torch.equal(packed["position_ids"][r, where], torch.arange(len(where)))
            assert int(packed["cls_positions"][r, k - 1]) == int(where[0])
            assert int(packed["input_ids"][r, where[0]]) == data.vocab.cls_id
    # MLM targets per instance, in input order (masking drew from the rng in the same instance order): the head
    # runs on as many slots as unpacked, and each flat position points at the same token as unpacked
    assert packed["masked_positions"].shape == plain["masked_positions"].shape == (10, data.max_predictions)
    assert torch.equal(packed["masked_labels"], plain["masked_labels"])
    labelled = plain["masked_labels"] != IGNORE_INDEX
    rows_of_instances = torch.arange(10).unsqueeze(1).expand_as(labelled)
    assert torch.equal(packed["input_ids"].reshape(-1)[packed["masked_positions"][labelled]],
                       plain["input_ids"][rows_of_instances[labelled], plain["masked_positions"][labelled]])
    meter = PackingMeter()
    meter.observe(packed)
    stats = meter.take()
    assert stats["data/packing_factor"] == pytest.approx(10 / count) and stats["data/packing_factor"] > 2
    assert meter.take() == {}


def test_packed_losses_and_gradients_equal_unpacked(shards: Path) -> None:
    """Same 12 instances, same masks: one row each (padded to 128) vs packed ~3 per row."""
    reader_data = open_phase_data(shards, 32, None, "data.shards")
    rows = [RankBatches(reader_data, "train", 2, 0, 1, 12).reader[i] for i in range(12)]
    data = dataclasses.replace(reader_data, seq_len=128)
    plain = Collator(data, packing=False)(rows, np.random.default_rng(5))
    packed = Collator(data, packing=True)(rows, np.random.default_rng(5))
    assert packed["input_ids"].size(0) <= 5
    config = bert_config("tiny", vocab_size=data.vocab.size, max_position_embeddings=128,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = build_model(config)
    outputs, grads = [], []
    for batch in (plain, packed):
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        outputs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    a, b = outputs
    torch.testing.assert_close(b.mlm_loss, a.mlm_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.nsp_loss, a.nsp_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.mlm_labels, b.mlm_labels) and int(a.mlm_mask.sum()) > 12  # same slots, same order
    torch.testing.assert_close(b.mlm_logits, a.mlm_logits, rtol=1e-5, atol=1e-5)  # empty slots too: each [CLS]
    # NSP logits of the real slots, in packed order, equal the unpacked ones of the same instances
    real = packed["next_sentence_label"] != IGNORE_INDEX
    assert int(real.sum()) == 12
    assert sorted(b.nsp_logits[real][:, 0].tolist()) == pytest.approx(sorted(a.nsp_logits[:, 0].tolist()), abs=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def model_and_encoder_output(
    model: SparseBertForPreTraining, batch: dict[str, torch.Tensor]
) -> tuple[PretrainingOutput, torch.Tensor]:
    """The model's output and the encoder's sequence output of the same forward (a hook, no second pass)."""
    captured: list[torch.Tensor] = []
    handle = model.bert.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        output = model(**batch)
    finally:
        handle.remove()
    return output, captured[0]


def boolean_select_head(
    model: SparseBertForPreTraining, sequence_output: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The previous MLM head, verbatim: gather, keep the labelled slots with a boolean index (a data-dependent
    shape: a host sync on GPU), head on those; mean cross-entropy, correct predictions, labelled count."""
    hidden = sequence_output.size(-1)
    index = positions.long().unsqueeze(-1).expand(-1, -1, hidden)
    gathered = torch.gather(sequence_output, 1, index)
    valid = labels.reshape(-1) != IGNORE_INDEX
    logits = model.cls.predictions(gathered.reshape(-1, hidden)[valid])
    target = labels.reshape(-1)[valid].long()
    loss = F.cross_entropy(logits.float(), target, reduction="mean")
    return loss, logits, int((logits.argmax(-1) == target).sum()), target.numel()


def previous_packed_layout(batch: dict[str, torch.Tensor], seq_len: int, slots: int) -> tuple[torch.Tensor, ...]:
    """The previous packed MLM layout, rebuilt from the new one: [rows, slots] row-relative positions, the
    targets of a row's instances one after another."""
    rows = batch["input_ids"].size(0)
    positions = torch.zeros(rows, slots, dtype=torch.long)
    labels = torch.full((rows, slots), IGNORE_INDEX, dtype=torch.long)
    filled = [0] * rows
    for flat, label in zip(batch["masked_positions"].reshape(-1).tolist(), batch["masked_labels"].reshape(-1).tolist(),
                           strict=True):
        if label != IGNORE_INDEX:
            row, position = divmod(flat, seq_len)
            positions[row, filled[row]], labels[row, filled[row]] = position, label
            filled[row] += 1
    return positions, labels


def test_fixed_size_head_equals_the_boolean_select_head(shards: Path) -> None:
    """Loss and accuracy counts of the fixed-size head (every slot, IGNORE_INDEX ignored) equal the previous
    boolean-select head on the same hidden states, unpacked and packed, with many empty slots."""
    reader_data = open_phase_data(shards, 32, None, "data.shards")
    rows = [RankBatches(reader_data, "train", 2, 0, 1, 12).reader[i] for i in range(12)]
    # masking draws at most 5 targets per instance here: 8 slots leave 3..6 of them empty
    data = dataclasses.replace(reader_data, seq_len=128, max_predictions=8)
    plain = Collator(data, packing=False)(rows, np.random.default_rng(5))
    packed = Collator(data, packing=True)(rows, np.random.default_rng(5))
    config = bert_config("tiny", vocab_size=data.vocab.size, max_position_embeddings=128,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():  # relabel every other target with the model's own guess: accuracy counts are not 0
        guess = model(**plain).mlm_logits.argmax(-1).reshape(12, 8)
    relabel = (plain["masked_labels"] != IGNORE_INDEX) & (torch.arange(8) % 2 == 0)
    for batch in (plain, packed):
        batch["masked_labels"] = torch.where(relabel, guess, batch["masked_labels"])
    layouts = {"unpacked": (plain, plain["masked_positions"], plain["masked_labels"]),
               "packed": (packed, *previous_packed_layout(packed, 128, MAX_INSTANCES_PER_ROW * 8))}
    for name, (batch, positions, labels) in layouts.items():
        with torch.no_grad():
            output, sequence_output = model_and_encoder_output(model, batch)
            loss, logits, correct, count = boolean_select_head(model, sequence_output, positions, labels)
        assert output.mlm_logits.shape == (12 * 8, config.vocab_size), name  # instances x max_predictions rows
        assert 12 < count < output.mlm_labels.numel(), name  # there were empty slots to ignore
        torch.testing.assert_close(output.mlm_loss, loss, rtol=1e-6, atol=1e-7, msg=name)
        mlm_correct, mlm_count = output.mlm_counts()  # what the trainer's acc/mlm and validation sum
        assert (int(mlm_correct), int(mlm_count)) == (correct, count) and correct > 0, name
        if name == "unpacked":  # same slot order: the logits themselves
            torch.testing.assert_close(output.mlm_logits[output.mlm_mask], logits, rtol=1e-6, atol=1e-6)


def test_packed_bad_inputs_fail_clearly() -> None:
    config = bert_config("tiny", vocab_size=48, max_position_embeddings=64)
    model = build_model(config)
    ids = torch.randint(5, 48, (1, 8))
    with pytest.raises(ValueError, match="packed batches need"):
        model(ids, torch.zeros_like(ids), torch.ones_like(ids), torch.zeros(1, 2, dtype=torch.long),
              torch.full((1, 2), -100), torch.zeros(4, dtype=torch.long), segment_ids=torch.ones_like(ids))


@pytest.mark.multirank
def test_packed_training_run_logs_the_packing_factor(tmp_path: Path, shards: Path) -> None:
    """The driver with phase1.packing=true (one rank, real DeepSpeed engine): trains, logs data/*."""
    data = short_instances_at_64(shards, tmp_path / "data64")
    run_json = tiny_run_config(tmp_path / "run.json", data, tmp_path / "run", phase1=3)
    overrides = ['--run.phases=["phase1"]', "--phase1.packing=true", "--phase1.seq_len=64",
                 "--phase1.micro_batch_size=6", "--logging.val_every_steps=0",
                 "--checkpoint.export_at_phase_end=false"]
    from pretrain.train import main  # in this process: the driver's command line, without a process start

    assert main(["--config", str(run_json), *overrides]) == 0
    found = list((tmp_path / "run").rglob("metrics.jsonl"))
    assert len(found) == 1, found
    lines = [json.loads(x) for x in found[0].read_text().splitlines() if x.strip()]
    steps = [line for line in lines if "data/packing_factor" in line]
    assert len(steps) == 3
    for line in steps:
        assert line["data/packing_factor"] > 1.0 and 0.0 <= line["acc/nsp"] <= 1.0
        assert np.isfinite(line["loss/total"])
        # device work counts rows, useful work instances: 6 x 2 accumulated instances laid into fewer rows
        rows = line["perf/seq_per_s"] * line["perf/step_s"]
        assert line["perf/instances_per_s"] * line["perf/step_s"] == pytest.approx(12)
        assert rows == pytest.approx(round(rows)) and 2 <= round(rows) < 12
        assert line["data/packing_factor"] == pytest.approx(12 / round(rows))
        assert line["perf/tokens_per_s"] == pytest.approx(line["perf/seq_per_s"] * 64)
        # useful work: every packed instance counted, padding slots not
        assert line["perf/instances_per_s"] == pytest.approx(line["perf/seq_per_s"] * line["data/packing_factor"])
        assert line["perf/real_tokens_per_s"] == pytest.approx(
            line["perf/tokens_per_s"] * (1 - line["data/padding_fraction"]))
        assert line["perf/real_tokens_per_s"] < line["perf/tokens_per_s"]
