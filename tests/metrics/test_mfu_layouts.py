"""Honest MFU (pretrain/metrics/throughput.py): perf/tflops and perf/mfu count the model's FLOPs on real
tokens, so the same instances give the same figure on the padded, packed and unpadded paths;
perf/device_tflops counts what the device computed, padding included. The counts are those the trainer sums:
each micro-batch collated by the project's Collator and counted by pretrain/step_stats.py `host_counts` (what
StepSums.add adds), read by `StepTotals.counts`. BERT-Large at seq 512, lengths uniform in [128, 512]: where
padding costs most."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pretrain.data.batches import Collator, PhaseData, open_phase_data
from pretrain.metrics.throughput import Throughput, ThroughputSettings
from pretrain.model.presets import PRESETS, flop_parameter_counts
from pretrain.step_stats import HOST_COUNTS, StepCounts, StepTotals, host_counts
from tests.support.model_fixtures import rows_of
from tests.support.pretrain_fixtures import build_shards

SEQ, LAYERS, HIDDEN, PEAK = 512, 24, 1024, 989.0
LAYOUTS = {"padded": {}, "packed": {"packing": True}, "unpadded": {"unpadded": True}}
# one optimizer step: 2 micro-batches of 16 instances, lengths uniform in [128, 512]
MICRO_BATCHES = np.random.default_rng(0).integers(128, SEQ + 1, (2, 16)).tolist()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> PhaseData:
    shards = build_shards(Path(tmp_path_factory.mktemp("shards")), seq_lens=(SEQ,), train=4, val=2)
    return open_phase_data(shards, SEQ, None, "data.shards")


def settings(data: PhaseData) -> ThroughputSettings:
    encoder, head = flop_parameter_counts({**PRESETS["bert-large"], "vocab_size": 30522})
    return ThroughputSettings(encoder, head, LAYERS, HIDDEN, SEQ, data.max_predictions, peak_tflops=PEAK)


def step_counts(data: PhaseData, layout: str) -> StepCounts:
    """The StepCounts of one step of MICRO_BATCHES in `layout`, counted as the trainer counts them. Each
    instance is masked by its own generator: each layout carries the same masks (pretrain/data/batches.py)."""
    sums = dict.fromkeys(HOST_COUNTS, 0.0)
    collate = Collator(data, **LAYOUTS[layout])
    for micro, lengths in enumerate(MICRO_BATCHES):
        rows = rows_of(data, lengths, seed=micro)
        batch = collate(rows, [np.random.default_rng([micro, i]) for i in range(len(rows))])
        for name, value in host_counts(batch).items():
            sums[name] += value
    return StepTotals(sums=sums, extras={}).counts()


def test_mfu_per_real_token_is_the_same_on_every_layout(data: PhaseData) -> None:
    """Equal step time, the same instances: perf/tflops per real token (and perf/mfu) agree within 2 % across
    the layouts. The old count (its linear term on rows x seq_len, padding included) put the padded path 50 %
    above the unpadded one here (checked against the old pretrain/metrics/throughput.py)."""
    meter = Throughput.of(settings(data), world_size=1)
    counts = {layout: step_counts(data, layout) for layout in LAYOUTS}
    assert len({c.real_tokens for c in counts.values()}) == 1
    assert len({c.labelled for c in counts.values()}) == 1
    assert counts["padded"].rows == 32 and counts["packed"].rows < 32 and counts["unpadded"].rows < 32
    stats = {layout: meter.rates(c, seconds=1.0) for layout, c in counts.items()}
    per_real_token = {layout: s["perf/tflops"] / counts[layout].real_tokens for layout, s in stats.items()}
    for layout in ("padded", "packed"):
        assert per_real_token[layout] == pytest.approx(per_real_token["unpadded"], rel=0.02), layout
        assert stats[layout]["perf/mfu"] == pytest.approx(stats["unpadded"]["perf/mfu"], rel=0.02), layout
    assert stats["unpadded"]["perf/mfu"] == pytest.approx(stats["unpadded"]["perf/tflops"] / PEAK, rel=1e-12)


def test_device_flops_exceed_the_model_flops_by_the_padding(data: PhaseData) -> None:
    """perf/device_tflops - perf/tflops is the padding's work, by hand: 6 N_enc per padding token (the share
    data/padding_fraction of the rows' tokens), 12 L d per query-key pair the device computed beyond the
    instances' (padded: a full row's seq_len^2 each; unpadded: the bucket tail's segment), 6 N_head per empty
    head slot."""
    flop_model = settings(data)
    meter = Throughput.of(flop_model, world_size=1)
    per_token, per_slot = 6.0 * flop_model.encoder_params, 6.0 * flop_model.head_params
    per_pair = 12.0 * LAYERS * HIDDEN
    padded, unpadded = step_counts(data, "padded"), step_counts(data, "unpadded")
    pairs = sum(n * n for lengths in MICRO_BATCHES for n in lengths)
    assert padded.attention_pairs == unpadded.attention_pairs == pairs
    tails = [-(-sum(lengths) // 64) * 64 - sum(lengths) for lengths in MICRO_BATCHES]  # T_b - T per micro
    empty_slots = padded.predictions - padded.labelled
    assert padded.predictions == unpadded.predictions == 32 * data.max_predictions and empty_slots > 0
    cases = (
        (padded, SEQ * SEQ * 32 - pairs),  # every padded row: seq_len^2 pairs
        (unpadded, sum(t * t for t in tails)),  # the tail attends within itself
    )
    for counts, padding_pairs in cases:
        stats = meter.rates(counts, seconds=1.0)
        padding_tokens = counts.rows * SEQ * counts.data_stats(SEQ)["data/padding_fraction"]
        by_hand = per_token * padding_tokens + per_pair * padding_pairs + per_slot * empty_slots
        extra = (stats["perf/device_tflops"] - stats["perf/tflops"]) * 1e12
        assert extra == pytest.approx(by_hand, rel=1e-9)
        assert stats["perf/device_mfu"] == pytest.approx(stats["perf/device_tflops"] / PEAK, rel=1e-12)
    padded_stats = meter.rates(padded, seconds=1.0)
    padding_share = 1.0 - padded_stats["perf/tflops"] / padded_stats["perf/device_tflops"]
    assert 0.3 < padding_share < 0.45  # 37 % of what the device computed on padded rows is padding
    assert padded_stats["perf/tokens_per_s"] == 32 * SEQ  # the device's rates are unchanged
