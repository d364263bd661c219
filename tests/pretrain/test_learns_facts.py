"""The pipeline learns: text -> data prep -> 2-rank pretraining -> export -> `pipeline("fill-mask")` names the facts.

Every other test checks a piece against a reference; this one checks meaning, end to end, the way a user sees it.
A corpus where eight facts ("the capital of france is paris .") repeat among varied sentences and filler
(tests/support/facts_corpus.py) is prepared by the real data prep (a WordPiece vocab trained on it), pretrained by
the real driver on 2 CPU ranks (ZeRO-2, ExactLamb) for each objective, MLM + NSP on sentence pairs and MLM alone on
packed sentences, and exported at the phase end. From the export folder alone, fill-mask must put the capital in
place of [MASK] for most countries, and a random-init export of the same shape, written by the same exporter, must
not. A wrong tokenizer, masking, label, loss, weight layout or head anywhere on the way would leave nothing to name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_prep.__main__ import main as data_prep_main
from pretrain.checkpointing.export import export_state_dict
from pretrain.model.bert import build_model
from pretrain.report.fill_mask import masked_position, read_fill_mask
from pretrain.report.model_card import ExportCard
from tests.support.facts_corpus import CAPITALS, COUNTRY_SENTENCES, FACT, probes, write_facts_corpus
from tests.support.launching import run_ranks
from tests.support.paths import REPO_ROOT, SCRIPTS

OBJECTIVES = {"mlm+nsp": "nsp", "mlm": "full-sentences"}  # objective -> the shards that train it
STEPS = 400  # at lr 2e-2, after 400 steps, seeds 7, 11, 3: MLM + NSP 8, 8, 7 of 8 facts; MLM 8, 8, 8;
LR = 2e-2  # 2-7 of 8 after 300; at lr 1e-2 it took 600 steps (6 of 8 after 500), at micro-batch 16 600 steps gave 2-3
MOST = 6  # of the 8 probes


def run_config(path: Path, shards: Path, run_dir: Path) -> Path:
    """One phase at seq 32, a small BERT (2 layers, hidden 128) without dropout, 64 sequences a step, 30 % masking:
    what learns eight facts in a few hundred steps on CPU."""
    ds_config = str(REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero2_cpu.json")
    config = {
        "run": {"dir": str(run_dir), "seed": 7, "phases": ["phase1"]},
        "model": {"preset": "tiny", "overrides": {"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 256,
                                                  "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}},
        "data": {"shards": str(shards), "num_workers": 0, "mask_probability": 0.3},
        "phase1": {"seq_len": 32, "ds_config": ds_config, "steps": STEPS, "warmup_fraction": 0.1, "lr": LR,
                   "micro_batch_size": 32, "gradient_accumulation_steps": 1},
        "checkpoint": {"every_steps": STEPS, "keep_last": 1},
        "logging": {"progress_bar": False, "val_every_steps": STEPS, "val_batches": 1},
    }
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """objective -> its phase-1 export folder (and `random:<objective>` -> a random-init export of the same shape)."""
    from transformers import BertConfig

    work = tmp_path_factory.mktemp("learns_facts")
    corpus = write_facts_corpus(work / "corpus.txt")
    folders: dict[str, Path] = {}
    plan = []
    for objective, segments in OBJECTIVES.items():
        shards, run_dir = work / f"shards_{segments}", work / f"run_{segments}"
        assert data_prep_main(["build", "--text", str(corpus), "--vocab-size", "400", "--seq-lens", "32",
                               "--segments", segments, "--num-shards", "2", "--val-fraction", "0.05",
                               "--workers", "1", "--out", str(shards)]) == 0
        plan.append({"name": objective, "config": str(run_config(work / f"{segments}.json", shards, run_dir))})
        folders[objective] = run_dir / "export" / "phase1"
    # Both trainings in ONE 2-rank launch, one `pretrain.train.main` after the other (the plan runner of
    # tests/scripts/elastic_scenarios.py): the ranks start up once (torch, transformers, DeepSpeed: the most
    # CPU-seconds of a short run), and the second training is a fresh run in its own folder, as a user would run it.
    (work / "plan.json").write_text(json.dumps(plan), encoding="utf-8")
    run_ranks(SCRIPTS / "elastic_scenarios.py", [str(work / "plan.json")], num_ranks=2, timeout=1800)
    assert json.loads((work / "plan.outcomes.json").read_text(encoding="utf-8")) == dict.fromkeys(OBJECTIVES, 0)
    for objective, segments in OBJECTIVES.items():
        run_dir = work / f"run_{segments}"
        resolved = json.loads((run_dir / "config.resolved.json").read_text(encoding="utf-8"))["resolved"]
        torch.manual_seed(0)
        untrained = build_model(BertConfig.from_dict(resolved["model_config"]))
        folders[f"random:{objective}"] = work / f"random_{segments}"
        export_state_dict(untrained.state_dict(), resolved, folders[f"random:{objective}"], source="random init",
                          write_card=ExportCard())
    return folders


def capitals_named(folder: Path) -> dict[str, tuple[str, str]]:
    """Probe -> (fill-mask's first word, the capital), the model loaded from the folder alone as the Hugging Face
    docs show."""
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(folder))
    return {text: (fill(text)[0]["token_str"], capital) for text, capital in probes(fill.tokenizer.mask_token).items()}


@pytest.mark.multirank
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_the_export_names_the_facts_it_was_taught(exports: dict[str, Path], objective: str) -> None:
    config = json.loads((exports[objective] / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == (["BertForPreTraining"] if objective == "mlm+nsp" else ["BertForMaskedLM"])
    named = capitals_named(exports[objective])
    assert len(named) == len(CAPITALS)
    assert sum(word == capital for word, capital in named.values()) >= MOST, named


@pytest.mark.multirank
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_random_weights_of_the_same_shape_do_not(exports: dict[str, Path], objective: str) -> None:
    named = capitals_named(exports[f"random:{objective}"])
    assert sum(word == capital for word, capital in named.values()) <= 1, named
    assert all(word.strip() for word, _ in named.values())  # real tokens, not the empty strings of a 5-token tokenizer


@pytest.mark.multirank
def test_the_fill_mask_readout_tells_the_trained_export_from_random_weights(exports: dict[str, Path]) -> None:
    """pretrain/report/fill_mask.py, the demo's readout: one whole word hidden per sentence (here the country of a
    corpus sentence, which the context narrows to eight), ranked by the export and by random weights."""
    sentences = [template.format(country=country, capital=capital) for country, capital in CAPITALS.items()
                 for template in (FACT, *COUNTRY_SENTENCES)]
    readout = read_fill_mask(exports["mlm"], sentences)
    assert readout.sentences == len(sentences)
    assert readout.trained.top10 >= 0.9 > 0.1 >= readout.random.top10, readout
    assert readout.trained.median_rank < 10 < 50 < readout.random.median_rank, readout
    assert len(readout.examples) == 3 and all("[MASK]" in text for text, _, _ in readout.examples)


def test_the_readout_hides_a_whole_word_of_four_letters_or_more() -> None:
    tokens = ["[CLS]", "the", "capital", "of", "fra", "##nce", "is", "paris", ".", "[SEP]"]
    assert masked_position(list(range(len(tokens))), tokens, special_ids={0, 9}) == 7  # capital, paris: the middle
    assert masked_position([0, 1, 2], ["[CLS]", "of", "[SEP]"], special_ids={0, 2}) is None
