"""The export's tokenizer is data prep's: `AutoTokenizer.from_pretrained(export)` gives the shards' ids.

Shards are built by the real data prep (an uncased given vocab on real Wikipedia text, and a vocab it trains itself,
cased), a model is exported the way the driver exports it, and the folder is read back as the Hugging Face docs
show. Before this check an export's tokenizer had 5 tokens on transformers 5 (every word `[UNK]`) and every test
passed; here that fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from data_prep.__main__ import main as data_prep_main
from data_prep.shard_format.shards import Manifest
from data_prep.shard_format.tokenizer_probe import Probe
from pretrain.checkpointing.export import export_state_dict
from pretrain.checkpointing.export_tokenizer import TokenizerExportError
from pretrain.model.bert import bert_config, build_model
from pretrain.report.model_card import ExportCard
from tests.support.facts_corpus import write_facts_corpus

WIKI_PARAGRAPH = (
    "Anarchism is a political philosophy that advocates self-governed societies based on voluntary institutions. "
    "These are often described as stateless societies, although several authors have defined them more "
    "specifically as institutions based on non-hierarchical or free associations. Zürich's café, naïve résumés!"
)


def prep(out: Path, *inputs: str) -> Manifest:
    assert data_prep_main(["build", *inputs, "--seq-lens", "32", "--num-shards", "1", "--val-fraction", "0",
                           "--workers", "1", "--out", str(out)]) == 0
    return Manifest.load(out)


def resolved_for(manifest: Manifest, nsp: bool = True) -> dict[str, Any]:
    """The resolved block the driver's plan writes (pretrain/plan/run_plan.py), for a tiny model over these shards."""
    config = bert_config("tiny", manifest.vocab_size, 64, next_sentence_prediction=nsp)
    return {"model_config": config.to_dict(), "vocab_file": str(manifest.vocab_path.resolve()),
            "vocab_sha256": manifest.vocab_sha256, "lowercase": bool(manifest.data["vocab"]["lowercase"]),
            "tokenizer_file": str(manifest.tokenizer_path), "tokenizer_probe_file": str(manifest.probe_path),
            "objective": "mlm+nsp" if nsp else "mlm", "segments": manifest.segments}


def export(resolved: dict[str, Any], out: Path) -> dict[str, Any]:
    """A model of random weights exported as the driver exports a phase's end."""
    from transformers import BertConfig

    torch.manual_seed(0)
    model = build_model(BertConfig.from_dict(resolved["model_config"]))
    return export_state_dict(model.state_dict(), resolved, out, source="test", write_card=ExportCard())


@pytest.fixture(scope="module")
def uncased_shards(tmp_path_factory: pytest.TempPathFactory) -> Manifest | None:
    from tests.conftest import shared_data_dir

    data = shared_data_dir()
    if data is None:
        return None
    out = tmp_path_factory.mktemp("uncased") / "shards"
    return prep(out, "--wikiextractor", str(data / "wikipedia" / "wikiextractor_sample"),
                "--vocab", str(data / "vocab" / "bert-base-uncased-vocab.txt"))


@pytest.fixture(scope="module")
def trained_shards(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    work = tmp_path_factory.mktemp("trained")
    return prep(work / "shards", "--text", str(write_facts_corpus(work / "corpus.txt", documents=64)),
                "--vocab-size", "300", "--cased")


def assert_same_ids(export_dir: Path, manifest: Manifest, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(export_dir), local_files_only=True)
    prep_tokenizer = Tokenizer.from_file(str(manifest.tokenizer_path))
    assert len(loaded) == manifest.vocab_size
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert loaded.convert_tokens_to_ids(specials) == [prep_tokenizer.token_to_id(token) for token in specials]
    probe = Probe.load(manifest.probe_path)
    assert len(probe.sentences) >= 30
    for sentence, ids in zip(probe.sentences, probe.ids, strict=True):
        assert loaded(sentence, add_special_tokens=False)["input_ids"] == list(ids), sentence
    for text in texts:  # text the probe never saw, tokenized by data prep's own file
        assert loaded(text)["input_ids"] == prep_tokenizer.encode(text).ids, text


@pytest.mark.shared_data
def test_an_uncased_vocab_export_tokenizes_real_wikipedia_as_data_prep(uncased_shards: Manifest | None,
                                                                      tmp_path: Path) -> None:
    if uncased_shards is None:
        pytest.skip("../shared/data is absent (set BERT_DS_SHARED_DATA to a folder laid out like it)")
    info = export(resolved_for(uncased_shards), tmp_path / "export")
    assert info["tokenizer"]["size"] == 30522 and info["tokenizer"]["probe_source"] == "shards"
    assert_same_ids(tmp_path / "export", uncased_shards, [WIKI_PARAGRAPH])
    from transformers import AutoTokenizer

    words = AutoTokenizer.from_pretrained(str(tmp_path / "export")).tokenize(WIKI_PARAGRAPH)
    assert "[UNK]" not in words and "political" in words and "zurich" in words  # lower-cased, accents stripped


def test_a_trained_cased_vocab_export_tokenizes_as_data_prep(trained_shards: Manifest, tmp_path: Path) -> None:
    assert trained_shards.data["vocab"]["lowercase"] is False
    export(resolved_for(trained_shards, nsp=False), tmp_path / "export")
    assert_same_ids(tmp_path / "export", trained_shards, ["The capital of France is Paris .", "paris PARIS Paris"])


def test_every_export_kind_fills_a_mask_with_words_through_the_pipeline(trained_shards: Manifest,
                                                                         tmp_path: Path) -> None:
    """BertForPreTraining (MLM + NSP) and BertForMaskedLM (MLM alone) through their Auto classes and fill-mask."""
    from transformers import AutoModelForMaskedLM, AutoModelForPreTraining, pipeline

    vocab = set(trained_shards.vocab_path.read_text(encoding="utf-8").split("\n"))
    for nsp, auto in ((True, AutoModelForPreTraining), (False, AutoModelForMaskedLM)):
        folder = tmp_path / f"nsp_{nsp}"
        export(resolved_for(trained_shards, nsp=nsp), folder)
        assert type(auto.from_pretrained(str(folder))).__name__ == ("BertForPreTraining" if nsp else "BertForMaskedLM")
        fill = pipeline("fill-mask", model=str(folder), top_k=5)
        predictions = fill(f"The capital of France is {fill.tokenizer.mask_token} .")
        assert len(predictions) == 5
        assert all(p["token_str"].strip() and p["token_str"].replace(" ", "") in vocab | {p["token_str"]}
                   for p in predictions), predictions
        assert "[UNK]" not in fill.tokenizer.tokenize("The capital of France is Paris .")


def test_an_export_whose_tokenizer_does_not_reproduce_the_probe_is_refused(trained_shards: Manifest,
                                                                           tmp_path: Path) -> None:
    probe = json.loads(trained_shards.probe_path.read_text(encoding="utf-8"))
    probe["ids"][3][1] += 1  # what a tokenizer that splits one word differently would give
    (tmp_path / "probe.json").write_text(json.dumps(probe), encoding="utf-8")
    resolved = {**resolved_for(trained_shards), "tokenizer_probe_file": str(tmp_path / "probe.json")}
    with pytest.raises(TokenizerExportError, match=r"^export of test to .* refused: its tokenizer does not tokenize "
                                                   r"as data prep did: probe sentence 4 of \d+ .* at token 1 where "
                                                   r"data prep gave .*\(transformers 5\.\d+"):
        export(resolved, tmp_path / "export")
    assert not (tmp_path / "export").exists()  # nothing half-written under the export's name


def test_shards_without_a_tokenizer_file_export_data_preps_tokenizer_rebuilt(trained_shards: Manifest,
                                                                           tmp_path: Path) -> None:
    """Shards built before tokenizer.json existed: the same tokenizer, rebuilt from vocab.txt as data prep builds it."""
    resolved = {**resolved_for(trained_shards), "tokenizer_file": None, "tokenizer_probe_file": None}
    info = export(resolved, tmp_path / "export")
    assert info["tokenizer"]["probe_source"] == "fixed sentences"
    assert_same_ids(tmp_path / "export", trained_shards, ["The capital of France is Paris ."])
