"""An export of an MLM-only run (BertForMaskedLM: no pooler, no NSP head) fine-tunes like a BertForPreTraining
one: SQuAD takes its encoder as it is, GLUE too, with the pooler its classifier needs starting from random
weights (as a RoBERTa-style model's does)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pretrain.finetune.glue.__main__ import main as glue_main
from pretrain.finetune.squad.__main__ import main as squad_main
from tests.finetune.glue.glue_files import write_task
from tests.support import squad_fixtures
from tests.support.squad_fixtures import SHORT_WINDOWS


def test_squad_and_glue_fine_tune_an_mlm_only_export(tmp_path: Path) -> None:
    export = squad_fixtures.build_tiny_bert(tmp_path / "mlm_export", head="masked_lm", seed=3)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    squad_fixtures.write_squad(tmp_path / "train.json")
    squad_fixtures.write_squad(tmp_path / "dev.json")
    code = squad_main(["finetune", "--model", str(export), "--train", str(tmp_path / "train.json"), "--dev",
                       str(tmp_path / "dev.json"), "--out", str(tmp_path / "squad"), "--batch-size", "4",
                       "--max-steps", "1", "--lr", "1e-9", "--save-model", *SHORT_WINDOWS])
    assert code == 0
    assert "f1" in json.loads((tmp_path / "squad" / "results.json").read_text())["scores"]
    source, tuned = load_file(export / "model.safetensors"), load_file(tmp_path / "squad" / "model" / "model.safetensors")
    encoder = [key for key in source if key.startswith("bert.")]
    assert encoder and all(key in tuned for key in encoder)
    for key in encoder:  # one step at lr 1e-9: the encoder the fine-tune started from is the export's
        torch.testing.assert_close(tuned[key], source[key], atol=1e-6, rtol=0, msg=key)

    data = write_task(tmp_path / "MRPC", "MRPC")
    assert glue_main(["finetune", "--task", "mrpc", "--model", str(export), "--data", str(data), "--out",
                      str(tmp_path / "glue"), "--seeds", "1", "--max-steps", "2", "--batch-size", "4",
                      "--max-seq-length", "32"]) == 0
    results = json.loads((tmp_path / "glue" / "results.json").read_text())
    assert results["task"] == "MRPC" and results["train_steps"] == 2 and "dev" in results["median"]
