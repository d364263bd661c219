"""The fine-tunes check what they read (issue 40): a tokenizer under which the task's text is [UNK]s, or that is
not the model's, is refused in one line before anything trains; --allow-unk lets it through with a warning;
the share of [UNK] the fine-tune saw is recorded in results.json ("vocab_check")."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pretrain.errors import FinetuneFormatError
from pretrain.finetune.glue.__main__ import main as glue_main
from pretrain.finetune.squad.__main__ import main as squad_main
from pretrain.finetune.vocab_check import (
    UNK_LIMIT,
    VocabCheck,
    VocabCount,
    check_vocab,
    count_unk,
    sample,
    tokens_by_id,
    unk_word,
    vocab_sha256,
)
from tests.finetune.glue.glue_files import write_task
from tests.support import squad_fixtures
from tests.support.squad_fixtures import SHORT_WINDOWS, SPECIAL_TOKENS, wordpiece_tokenizer

# A vocab that lacks almost every word of the fixture text: "The lighthouse at ..." reads "the [UNK] [UNK] ...".
FEW_WORDS = {token: index for index, token in enumerate((*SPECIAL_TOKENS, "the", "was", "in", "of"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """good/: a tiny QA model with its own tokenizer; broken/: the same model with the FEW_WORDS tokenizer."""
    work = tmp_path_factory.mktemp("vocab_check")
    squad_fixtures.build_tiny_bert(work / "good", head="qa", seed=2)
    shutil.copytree(work / "good", work / "broken")
    squad_fixtures.replace_tokenizer(work / "broken", wordpiece_tokenizer(FEW_WORDS))
    squad_fixtures.write_squad(work / "train.json")
    squad_fixtures.write_squad(work / "dev.json")
    return work


def squad(work: Path, model: str, out: str, *flags: str) -> int:
    """`squad finetune` evaluating only (no --train: no engine, seconds) unless `flags` say otherwise."""
    return squad_main(["finetune", "--model", str(work / model), "--dev", str(work / "dev.json"), "--out",
                       str(work / out), *SHORT_WINDOWS, *flags])


def vocab_record(out: Path) -> dict:
    return json.loads((out / "results.json").read_text(encoding="utf-8"))["vocab_check"]


def test_the_test_tokenizers_are_what_they_claim(work: Path) -> None:
    """The fixtures' own tokenizers load with their full vocab (transformers 5 dropped a vocab_file given to
    BertTokenizerFast: the issue's 5-token tokenizer)."""
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(work / "good"))) == len(squad_fixtures.fixture_vocab()) > 100
    assert len(AutoTokenizer.from_pretrained(str(work / "broken"))) == len(FEW_WORDS)


def test_squad_refuses_a_tokenizer_that_reads_the_text_as_unk_in_one_line(
        work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert squad(work, "broken", "refused", "--train", str(work / "train.json")) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    broken = work / "broken"
    assert lines[0].startswith(f"error: --model {broken}: ") and "of the task's tokens are [UNK] under the " \
        f"tokenizer {broken} ({len(FEW_WORDS)} tokens; 'lighthouse' became [UNK]" in lines[0], lines[0]
    assert lines[0].endswith("pass --allow-unk to fine-tune anyway")
    assert not (work / "refused").exists()  # refused before the model, the engine or any output


def test_allow_unk_fine_tunes_anyway_and_records_the_share(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert squad(work, "broken", "allowed", "--allow-unk") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "[UNK]" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: --model {work / 'broken'}: ")
    assert warnings[0].endswith("fine-tuning anyway (--allow-unk)")
    record = vocab_record(work / "allowed")
    assert record["tokenizer"] == str(work / "broken") and record["tokenizer_size"] == len(FEW_WORDS)
    assert record["unk_share"] > 0.5 and record["unk_example"] == "lighthouse"
    assert record["unk_share"] == record["unk_tokens"] / record["tokens"] and record["unk_limit"] == UNK_LIMIT


def test_the_models_own_tokenizer_passes_and_its_share_is_recorded(work: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert squad(work, "good", "passed") == 0
    assert "[UNK]" not in capsys.readouterr().err
    record = vocab_record(work / "passed")
    assert record["tokenizer"] == str(work / "good") and record["tokens"] > 100 and record["texts"] > 10
    assert (record["unk_share"], record["unk_tokens"], record["unk_example"]) == (0.0, 0, None)


def test_glue_refuses_the_same_tokenizer_and_allows_it_with_the_flag(
        work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_task(tmp_path / "MRPC", "MRPC")
    flags = ["finetune", "--task", "mrpc", "--model", str(work / "broken"), "--data", str(data), "--seeds", "1",
             "--max-steps", "1", "--batch-size", "4", "--max-seq-length", "32"]
    assert glue_main([*flags, "--out", str(tmp_path / "refused")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --model {work / 'broken'}: ") and "[UNK]" in lines[0]
    assert "pass --allow-unk" in lines[0] and not (tmp_path / "refused").exists()
    assert glue_main([*flags, "--out", str(tmp_path / "allowed"), "--allow-unk"]) == 0
    record = vocab_record(tmp_path / "allowed")
    assert record["unk_share"] > 0.5 and record["tokenizer"] == str(work / "broken")


def with_export_info(source: Path, folder: Path, sha: str | None) -> Path:
    """A copy of `source` with our export's export_info.json naming the vocab `sha`."""
    shutil.copytree(source, folder)
    (folder / "export_info.json").write_text(json.dumps({"source": "ckpt/global_step1", "vocab_sha256": sha}))
    return folder


def check(folder: Path, **overrides: object) -> VocabCount:
    """check_vocab on `folder`'s own tokenizer and the fixture text."""
    from transformers import AutoTokenizer

    settings = {"tokenizer": AutoTokenizer.from_pretrained(str(folder)), "model_dir": folder,
                "model_config": json.loads((folder / "config.json").read_text()),
                "texts": [context for context, _ in squad_fixtures.PARAGRAPHS], **overrides}
    return check_vocab(VocabCheck(**settings))


def test_a_tokenizer_that_is_not_the_exports_vocab_is_refused_naming_both(work: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sha = vocab_sha256(list(squad_fixtures.fixture_vocab()))
    assert check(with_export_info(work / "good", tmp_path / "ours", sha)).unk_share == 0.0
    foreign = with_export_info(work / "broken", tmp_path / "foreign", sha)
    assert squad_main(["finetune", "--model", str(foreign), "--dev", str(work / "dev.json"), "--out",
                       str(tmp_path / "out"), "--allow-unk"]) == 2  # --allow-unk does not cover another vocab
    lines = capsys.readouterr().err.splitlines()
    ours = vocab_sha256(list(FEW_WORDS))
    assert lines == [f"error: --model {foreign}: the tokenizer {foreign} ({len(FEW_WORDS)} tokens, vocab sha256 "
                     f"{ours[:12]}) is not the vocab the model was pretrained with ({foreign / 'export_info.json'}: "
                     f"vocab_sha256 {sha[:12]}); load the model with its own tokenizer (re-export it)"]


def test_the_exports_vocab_txt_written_otherwise_still_names_the_same_vocab(work: Path, tmp_path: Path) -> None:
    """A vocab.txt with Windows line ends and no last newline hashes otherwise than the tokenizer's vocab written
    one a line; the folder's vocab.txt with the recorded sha256 and the same tokens is the same vocab."""
    data = "\r\n".join(squad_fixtures.fixture_vocab()).encode("utf-8")
    folder = with_export_info(work / "good", tmp_path / "crlf", hashlib.sha256(data).hexdigest())
    (folder / "vocab.txt").write_bytes(data)
    assert check(folder).tokens > 0
    (folder / "vocab.txt").write_bytes(data.replace(b"lighthouse", b"lamphouse"))  # not the recorded bytes
    with pytest.raises(FinetuneFormatError, match="is not the vocab the model was pretrained with"):
        check(folder)
    assert check(with_export_info(work / "good", tmp_path / "no_sha", None)).tokens > 0  # nothing to compare


def test_a_tokenizer_larger_than_the_models_embeddings_is_refused_naming_both(work: Path) -> None:
    config = json.loads((work / "good" / "config.json").read_text())
    size = config["vocab_size"]
    with pytest.raises(FinetuneFormatError) as err:
        check(work / "good", model_config={**config, "vocab_size": size - 1})
    assert str(err.value) == (f"--model {work / 'good'}: the tokenizer {work / 'good'} has {size} tokens, more than "
                              f"the model's {size - 1} embeddings (vocab_size in {work / 'good' / 'config.json'}): "
                              "they do not belong together")


def test_the_sample_is_bounded_distinct_and_spread_and_the_unk_word_is_found_without_offsets(work: Path) -> None:
    texts = [f"text {i}" for i in range(10)] * 3 + ["", "  "]
    assert sample(texts) == [f"text {i}" for i in range(10)]
    assert sample(texts, limit=5) == [f"text {i}" for i in (0, 2, 4, 6, 8)]
    tokenizer = wordpiece_tokenizer(FEW_WORDS)
    text = "the lighthouse of Karsby"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert unk_word(tokenizer, text, ids, None) == "lighthouse"  # a slow tokenizer's path: no offsets
    count = count_unk(tokenizer, [text, "the of in"], "few")
    assert (count.tokens, count.unk_tokens, count.unk_example) == (7, 2, "lighthouse")
    assert tokens_by_id(tokenizer) == list(FEW_WORDS)


@pytest.mark.shared_data
def test_real_squad_text_under_the_real_vocab_and_under_the_issues_five_token_tokenizer(shared_data: Path) -> None:
    """bert-base-uncased's vocab.txt read as transformers 5 reads it (``vocab=``, 30,522 tokens) sees real SQuAD
    as words; the issue's export tokenizer (the 5 special tokens alone) sees nothing but [UNK] and is refused."""
    from transformers import BertTokenizerFast

    from pretrain.finetune.squad.data import SquadFormatError, load_squad
    from pretrain.finetune.squad.finetune import squad_texts

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    squad = load_squad(shared_data / "squad" / "train-v1.1-subset.json")
    real = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    assert len(real) == 30522
    seen = count_unk(real, squad_texts(squad), "bert-base-uncased")
    assert seen.texts == 2000 and seen.tokens > 50000 and seen.unk_share < 0.001, seen
    five = wordpiece_tokenizer({token: index for index, token in enumerate(SPECIAL_TOKENS)})
    settings = VocabCheck(five, Path("export"), {"vocab_size": 30522}, squad_texts(squad), error=SquadFormatError)
    with pytest.raises(SquadFormatError, match=r"^--model export: 100\.0% of the task's tokens are \[UNK\] under "
                                               r"the tokenizer export \(5 tokens; '\w+' became \[UNK\]"):
        check_vocab(settings)


@pytest.mark.parametrize("command", [squad_main, glue_main])
def test_both_commands_document_the_flag(command: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        command(["finetune", "--help"])
    assert "--allow-unk  " in capsys.readouterr().out.replace("\n", " ")
