"""Bad SQuAD input fails early with a message naming the file and the question id."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pretrain.finetune.squad.__main__ import main
from pretrain.finetune.squad.data import (
    SquadFormatError,
    articles_from_rows,
    load_predictions,
    load_squad,
    parse_squad,
)
from tests.support import squad_fixtures


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def _good() -> dict:
    return {"data": squad_fixtures.squad_articles(), "version": "1.1"}


def test_good_file_parses_into_examples(tmp_path: Path) -> None:
    squad = load_squad(_write(tmp_path / "ok.json", _good()))
    assert squad.version == 1 and squad.declared_version == "1.1"
    assert len(squad.examples) == sum(len(qas) for _, qas in squad_fixtures.PARAGRAPHS)
    first = squad.examples[0]
    assert first.context[first.answers[0].start :].startswith(first.answers[0].text)


def _broken(mutate) -> dict:
    data = _good()
    mutate(data)
    return data


def _qa(data: dict) -> dict:
    return data["data"][0]["paragraphs"][1]["qas"][2]


BAD_FILES = [
    ("no data key", lambda d: d.pop("data"), r"missing key 'data'"),
    ("missing question", lambda d: _qa(d).pop("question"), r"question id 'q0-1-2'.*missing key 'question'"),
    ("answer_start off by one", lambda d: _qa(d)["answers"][0].update(answer_start=_qa(d)["answers"][0]["answer_start"] + 1),
     r"question id 'q0-1-2'.*answer_start \d+ does not match the context"),
    ("answer_start not int", lambda d: _qa(d)["answers"][0].update(answer_start="12"), r"q0-1-2.*must be int"),
    ("duplicate id", lambda d: d["data"][0]["paragraphs"][0]["qas"][0].update(id="q0-1-2"), r"q0-1-2.*duplicate id"),
    ("no answers in v1", lambda d: _qa(d).update(answers=[]), r"q0-1-2.*no answers"),
    ("context not a string", lambda d: d["data"][0]["paragraphs"][0].update(context=None), r"paragraphs\[0\].*'context' must be str"),
]


@pytest.mark.parametrize(("name", "mutate", "message"), BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_bad_squad_file_is_named(tmp_path: Path, name: str, mutate, message: str) -> None:
    path = _write(tmp_path / "bad.json", _broken(mutate))
    with pytest.raises(SquadFormatError, match=message) as info:
        load_squad(path)
    assert str(path) in str(info.value)


def test_malformed_json_and_predictions(tmp_path: Path) -> None:
    path = tmp_path / "truncated.json"
    path.write_text(json.dumps(_good())[:-10], encoding="utf-8")
    with pytest.raises(SquadFormatError, match=r"truncated.json: malformed JSON"):
        load_squad(path)
    with pytest.raises(SquadFormatError, match=r"pred.json: question id 'q1': the prediction must be a string"):
        load_predictions(_write(tmp_path / "pred.json", {"q1": ["a list"]}))


def test_cli_exits_2_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "bad.json", _broken(lambda d: _qa(d).pop("question")))
    preds = _write(tmp_path / "pred.json", {})
    assert main(["evaluate", str(bad), str(preds)]) == 2
    assert "q0-1-2" in capsys.readouterr().err


def test_scoring_ignores_answer_start_as_the_official_scorer_does(tmp_path: Path) -> None:
    # Training labels need answer_start; the official scorer never reads it, so a file with a
    # shifted offset is still scored, while loading it for training is refused.
    shifted = _write(tmp_path / "shifted.json", _broken(lambda d: _qa(d)["answers"][0].update(answer_start=0)))
    with pytest.raises(SquadFormatError, match="does not match the context"):
        load_squad(shifted)
    examples = load_squad(shifted, check_offsets=False).examples
    preds = _write(tmp_path / "pred.json", {examples[0].qid: examples[0].answers[0].text})
    assert main(["evaluate", str(shifted), str(preds)]) == 0


def test_hf_rows_round_trip_to_the_official_layout() -> None:
    data = _good()
    rows = [
        {"id": qa["id"], "title": article["title"], "context": paragraph["context"], "question": qa["question"],
         "answers": {"text": [a["text"] for a in qa["answers"]], "answer_start": [a["answer_start"] for a in qa["answers"]]}}
        for article in data["data"] for paragraph in article["paragraphs"] for qa in paragraph["qas"]
    ]
    rebuilt = articles_from_rows(rows)
    assert rebuilt == data["data"]
    v2_rows = copy.deepcopy(rows)
    v2_rows[0]["answers"] = {"text": [], "answer_start": []}
    assert parse_squad({"data": articles_from_rows(v2_rows)}, "rows").version == 2


@pytest.mark.parametrize(
    ("remove", "message"),
    [("model.safetensors", "no weights"), ("tokenizer.json", "no vocabulary"), ("config.json", "no config.json")],
)
def test_finetune_rejects_incomplete_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], remove: str, message: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    (model / remove).unlink()
    dev = _write(tmp_path / "dev.json", _good())
    code = main(["finetune", "--model", str(model), "--dev", str(dev), "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and str(model) in err
    assert not (tmp_path / "out").exists()


def test_finetune_rejects_windows_longer_than_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 128}))
    (model / "model.safetensors").write_text("")
    (model / "vocab.txt").write_text("[PAD]\n")
    dev = _write(tmp_path / "dev.json", _good())
    assert main(["finetune", "--model", str(model), "--dev", str(dev), "--out", str(tmp_path / "out")]) == 2
    assert "--max-seq-length 384 exceeds max_position_embeddings 128" in capsys.readouterr().err
