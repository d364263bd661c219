"""Weights between the two objectives: an MLM-only model takes a BERT's weights without their pooler and NSP head,
an MLM + NSP one refuses weights that never had them; an MLM-only export is a verified BertForMaskedLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.export import export_state_dict, load_weights
from pretrain.model.bert import bert_config, build_model
from pretrain.report.model_card import ExportCard
from tests.support.pretrain_fixtures import write_vocab


def test_weights_cross_from_mlm_nsp_to_mlm_alone_but_not_back() -> None:
    torch.manual_seed(0)
    pairs = build_model(bert_config("tiny", 48, 64))
    alone = build_model(bert_config("tiny", 48, 64, next_sentence_prediction=False))
    load_weights(alone, pairs.state_dict(), "phase1.init_from")  # the pooler and NSP head are left behind
    assert torch.equal(alone.bert.encoder.layer[0].output.dense.weight, pairs.bert.encoder.layer[0].output.dense.weight)
    with pytest.raises(ValueError, match=r"^phase2.init_from: weights do not fit BertForPreTraining \(MLM \+ NSP\): "
                                         r"missing .*bert.pooler.dense.weight.*; they were trained without NSP"):
        load_weights(build_model(bert_config("tiny", 48, 64)), alone.state_dict(), "phase2.init_from")


def test_an_mlm_only_export_is_a_verified_masked_lm(tmp_path: Path) -> None:
    write_vocab(tmp_path / "vocab.txt")
    config = bert_config("tiny", 48, 64, next_sentence_prediction=False)
    torch.manual_seed(1)
    model = build_model(config)
    resolved = {"model_config": config.to_dict(), "vocab_file": str(tmp_path / "vocab.txt"), "objective": "mlm",
                "segments": "doc-sentences", "mask_probability": {"phase1": 0.3}}
    info = export_state_dict(model.state_dict(), resolved, tmp_path / "export", source="test", write_card=ExportCard())
    assert info["max_abs_logit_difference"] <= 1e-4
    saved = json.loads((tmp_path / "export" / "config.json").read_text())
    assert saved["architectures"] == ["BertForMaskedLM"] and saved["next_sentence_prediction"] is False
    card = (tmp_path / "export" / "README.md").read_text()
    assert "masked-LM alone, no next-sentence prediction, on doc-sentences inputs at 30% masking" in card
