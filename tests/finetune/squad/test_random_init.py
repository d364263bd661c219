"""`squad finetune --random-init`: the demo's no-pretraining baseline is the same fine-tune with the
model's architecture and tokenizer but fresh weights (reproducible from --seed), not its trained ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pretrain.finetune.squad.__main__ import main
from tests.support import squad_fixtures
from tests.support.launching import REPO_ROOT
from tests.support.squad_fixtures import SHORT_WINDOWS

TINY_CPU = str(REPO_ROOT / "ds_configs" / "deepspeed" / "squad_adamw_zero1.json")


def finetune(work: Path, out: str, *extra: str) -> dict[str, torch.Tensor]:
    """One optimizer step at lr 1e-9 (the weights stay where they started) and the saved weights. In this
    process, as the GLUE tests run theirs: the command line is the same, without a process start each."""
    code = main(["finetune", "--model", str(work / "qa"), "--train", str(work / "train.json"), "--dev",
                 str(work / "dev.json"), "--out", str(work / out), "--ds-config", TINY_CPU, "--batch-size", "4",
                 "--max-steps", "1", "--lr", "1e-9", "--save-model", *SHORT_WINDOWS, *extra])
    assert code == 0
    return load_file(str(work / out / "model" / "model.safetensors"))


def test_random_init_keeps_the_architecture_not_the_weights(tmp_path: Path) -> None:
    squad_fixtures.build_tiny_bert(tmp_path / "qa", head="qa", seed=2)
    squad_fixtures.write_squad(tmp_path / "train.json")
    squad_fixtures.write_squad(tmp_path / "dev.json")
    source = load_file(str(tmp_path / "qa" / "model.safetensors"))
    loaded = finetune(tmp_path, "loaded")
    fresh = finetune(tmp_path, "fresh", "--random-init")
    again = finetune(tmp_path, "fresh_again", "--random-init")
    name = "bert.embeddings.word_embeddings.weight"
    assert set(fresh) == set(source) and fresh[name].shape == source[name].shape
    torch.testing.assert_close(loaded[name], source[name], atol=1e-6, rtol=0)  # the model's weights
    assert (fresh[name] - source[name]).abs().max() > 1e-2, "--random-init must not load the weights"
    torch.testing.assert_close(fresh[name], again[name], atol=1e-6, rtol=0)  # reproducible from --seed
    assert 0.01 < float(fresh[name].std()) < 0.03  # BERT's own init, normal with std initializer_range 0.02
    results = json.loads((tmp_path / "fresh" / "results.json").read_text(encoding="utf-8"))
    assert results["init"] == "random" and "f1" in results["scores"]
    assert json.loads((tmp_path / "loaded" / "results.json").read_text(encoding="utf-8"))["init"] == "model"
    tokenizer = json.loads((tmp_path / "fresh" / "model" / "tokenizer.json").read_text(encoding="utf-8"))
    assert tokenizer == json.loads((tmp_path / "qa" / "tokenizer.json").read_text(encoding="utf-8"))

