"""Load and validate SQuAD v1.1 / v2.0 files, prediction files and no-answer probability files.

Every error names the file and, where there is one, the question id, and it is raised before
any tokenisation or training starts. No torch here: the ``evaluate`` command uses this module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import FinetuneFormatError


class SquadFormatError(FinetuneFormatError):
    """A SQuAD, predictions or no-answer-probability file that cannot be used as it is."""


@dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset into the context


@dataclass(frozen=True)
class Example:
    qid: str
    title: str
    context: str
    question: str
    answers: tuple[Answer, ...]
    is_impossible: bool


@dataclass(frozen=True)
class SquadSet:
    """A parsed SQuAD file: ``articles`` is the official ``data`` list the scorer reads."""

    source: str
    version: int  # 1 (v1.1) or 2 (v2.0: questions may be unanswerable)
    articles: list[dict[str, Any]]
    examples: list[Example]
    declared_version: str | None = None  # the file's top-level "version", if any


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SquadFormatError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise SquadFormatError(f"{path}: not UTF-8 text ({err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SquadFormatError(f"{path}: malformed JSON: {err}") from None


def _require(mapping: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(mapping, dict):
        raise SquadFormatError(f"{where}: expected a JSON object, got {type(mapping).__name__}")
    if key not in mapping:
        raise SquadFormatError(f"{where}: missing key {key!r}")
    value = mapping[key]
    # bool is an int in Python; an answer_start of `true` is still malformed.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise SquadFormatError(f"{where}: key {key!r} must be {names}, got {type(value).__name__}")
    return value


def _parse_answers(
    qa: dict[str, Any], context: str, where: str, impossible: bool, check_offsets: bool
) -> tuple[Answer, ...]:
    answers = []
    for a_index, answer in enumerate(_require(qa, "answers", list, where)):
        a_where = f"{where} answers[{a_index}]"
        text = _require(answer, "text", str, a_where)
        start = _require(answer, "answer_start", int, a_where)
        found = context[start : start + len(text)] if start >= 0 else None
        if check_offsets and found != text:
            raise SquadFormatError(
                f"{a_where}: answer_start {start} does not match the context: the context has {quoted(found)} "
                f"there, the answer text is {quoted(text)}"
            )
        answers.append(Answer(text, start))
    if not answers and not impossible:
        raise SquadFormatError(f"{where}: no answers, and the question is not marked is_impossible")
    if answers and impossible:
        raise SquadFormatError(f"{where}: is_impossible is true but the question has answers")
    return tuple(answers)


def parse_squad(obj: Any, source: str, check_offsets: bool = True) -> SquadSet:
    """Validate an official-layout SQuAD object and flatten it into examples (file order).

    ``check_offsets``: every ``answer_start`` must point at its answer text in the context. Training
    labels depend on it; scoring does not (the official scorer never reads it), so ``evaluate``
    and the dev set skip the check rather than refuse a file the official script accepts.
    """
    data = _require(obj, "data", list, source)
    examples: list[Example] = []
    seen: dict[str, str] = {}
    any_impossible = False
    for d_index, article in enumerate(data):
        a_where = f"{source}: data[{d_index}]"
        title = article.get("title", "") if isinstance(article, dict) else ""
        for p_index, paragraph in enumerate(_require(article, "paragraphs", list, a_where)):
            p_where = f"{a_where}.paragraphs[{p_index}]"
            context = _require(paragraph, "context", str, p_where)
            for q_index, qa in enumerate(_require(paragraph, "qas", list, p_where)):
                q_path = f"data[{d_index}].paragraphs[{p_index}].qas[{q_index}]"
                qid = _require(qa, "id", str, f"{source}: {q_path}")
                q_where = f"{source}: question id {quoted(qid)} ({q_path})"
                if qid in seen:
                    raise SquadFormatError(f"{q_where}: duplicate id (first seen at {seen[qid]})")
                seen[qid] = q_where
                question = _require(qa, "question", str, q_where)
                impossible = bool(qa.get("is_impossible", False))
                any_impossible |= impossible
                answers = _parse_answers(qa, context, q_where, impossible, check_offsets)
                examples.append(Example(qid, str(title), context, question, answers, impossible))
    if not examples:
        raise SquadFormatError(f"{source}: contains no questions")
    declared = obj.get("version")
    declared = None if declared is None else str(declared)
    version = 2 if any_impossible or (declared or "").startswith(("2", "v2")) else 1
    return SquadSet(source, version, data, examples, declared)


def load_squad(path: str | Path, check_offsets: bool = True) -> SquadSet:
    path = Path(path)
    return parse_squad(_read_json(path), str(path), check_offsets)


QUOTE_LIMIT = 60  # characters of a file's content quoted in an error message


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error quotes what it found, never a whole file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


PREDICTIONS_LAYOUT = "a JSON object {question id: answer text}"


def load_predictions(path: str | Path) -> dict[str, str]:
    """``{question_id: answer_text}`` as the official scripts read it.

    Refused in one short line naming the file: anything but that object, and a SQuAD dataset passed
    in the predictions' place (the usual slip: the two file arguments swapped).
    """
    path = Path(path)
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise SquadFormatError(f"{path}: expected predictions, {PREDICTIONS_LAYOUT}; got a JSON "
                               f"{_json_kind(obj)}")
    if isinstance(obj.get("data"), list):
        raise SquadFormatError(f"{path}: this is a SQuAD dataset (a 'data' list of articles), not predictions "
                               f"({PREDICTIONS_LAYOUT}): give the dataset first, the predictions second")
    for qid, text in obj.items():
        if not isinstance(text, str):
            raise SquadFormatError(f"{path}: question id {quoted(qid)}: the prediction must be a string "
                                   f"({PREDICTIONS_LAYOUT}), got {_json_kind(text)} {quoted(text)}")
    return obj


def _json_kind(value: Any) -> str:
    """The JSON name of a parsed value's type (what a user sees in the file)."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def load_na_probs(path: str | Path) -> dict[str, float]:
    """``{question_id: no-answer probability or score}`` (v2.0 ``--na-prob``)."""
    path = Path(path)
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise SquadFormatError(f"{path}: no-answer probabilities must be a JSON object {{id: number}}")
    for qid, value in obj.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise SquadFormatError(f"{path}: question id {quoted(qid)}: expected a number, got {quoted(value)}")
    return {qid: float(value) for qid, value in obj.items()}


def articles_from_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hugging Face ``squad``/``squad_v2`` rows (one per question) → the official nested layout.

    Consecutive rows with the same title and context form one paragraph, as in the source files.
    """
    articles: list[dict[str, Any]] = []
    for row in rows:
        answers = row["answers"]
        qa = {
            "id": row["id"],
            "question": row["question"],
            "answers": [
                {"text": text, "answer_start": int(start)}
                for text, start in zip(answers["text"], answers["answer_start"], strict=True)
            ],
        }
        if not qa["answers"]:
            qa["is_impossible"] = True
        if not articles or articles[-1]["title"] != row["title"]:
            articles.append({"title": row["title"], "paragraphs": []})
        paragraphs = articles[-1]["paragraphs"]
        if not paragraphs or paragraphs[-1]["context"] != row["context"]:
            paragraphs.append({"context": row["context"], "qas": []})
        paragraphs[-1]["qas"].append(qa)
    return articles


def load_hf_squad(name: str, split: str) -> SquadSet:
    """SQuAD by Hugging Face dataset name (``squad`` or ``squad_v2``); needs the hub or its cache."""
    import datasets  # only this path needs it; imported late so the scorer stays light

    rows = datasets.load_dataset(name, split=split)
    source = f"hf-dataset {name}[{split}]"
    version = "v2.0" if name.endswith("v2") else "1.1"
    return parse_squad({"data": articles_from_rows(rows), "version": version}, source)
