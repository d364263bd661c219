"""The contract of a fine-tune's saved model (issue 40, item 6): what a user does with OUT/model works.

A user loads the folder with transformers' Auto classes and runs it through ``transformers.pipeline``, with
whatever transformers they have; our own loader and scorer agreeing with each other proves nothing about
that. So these helpers load and run the folder the way a user does, with the installed transformers, and
check what comes back: a SQuAD model answers with a span of the context, a GLUE model with one of the
task's labels, and the folder's tokenizer reads the text as words (not [UNK]s: the issue's bug).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.finetune.glue.tasks import Task
from pretrain.finetune.vocab_check import UNK_LIMIT, count_unk


def loaded_tokenizer_fits(tokenizer: object, model: object, texts: list[str]) -> None:
    """The folder's tokenizer belongs to its model (no id past its embeddings) and reads `texts` as words."""
    assert len(tokenizer) <= model.config.vocab_size, (len(tokenizer), model.config.vocab_size)
    count = count_unk(tokenizer, texts, "saved")
    assert count.tokens and count.unk_share <= UNK_LIMIT, count


def check_question_answering(folder: Path, context: str, question: str) -> str:
    """OUT/model loads with AutoModelForQuestionAnswering + AutoTokenizer and pipeline("question-answering")
    answers `question` with a non-empty span of `context`; returns the answer. Where the installed transformers
    has no such pipeline (removed in 5.x: "use text-generation with a chat model"), the extraction it did,
    written with the same two classes (``extract_answer``): what a user of such a version writes."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer, pipeline

    model = AutoModelForQuestionAnswering.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    loaded_tokenizer_fits(tokenizer, model, [context, question])
    try:
        answer = pipeline("question-answering", model=model, tokenizer=tokenizer)(question=question,
                                                                                  context=context)
    except KeyError as err:
        if "removed" not in str(err):
            raise
        answer = extract_answer(model, tokenizer, question, context)
    text = answer["answer"]
    assert isinstance(text, str) and text.strip(), answer
    assert context[answer["start"]:answer["end"]] == text and text in context, answer
    return text


def extract_answer(model: Any, tokenizer: Any, question: str, context: str, max_tokens: int = 30) -> dict[str, Any]:
    """The best span of `context` (start + end logit, end >= start, at most `max_tokens`), as the removed
    question-answering pipeline chose it: ``{"answer", "start", "end", "score"}``, character offsets."""
    import torch

    inputs = tokenizer(question, context, truncation="only_second", return_offsets_mapping=True,
                       return_tensors="pt")
    offsets = inputs.pop("offset_mapping")[0].tolist()
    in_context = [index for index, sequence in enumerate(inputs.sequence_ids(0)) if sequence == 1]
    with torch.no_grad():
        output = model(**inputs)
    starts, ends = output.start_logits[0].tolist(), output.end_logits[0].tolist()
    score, first, last = max((starts[s] + ends[e], s, e) for s in in_context for e in in_context
                             if s <= e < s + max_tokens)
    begin, end = offsets[first][0], offsets[last][1]
    return {"answer": context[begin:end], "start": begin, "end": end, "score": score}


def check_text_classification(folder: Path, task: Task, pairs: list[tuple[str, str | None]]) -> list[str]:
    """OUT/model loads with AutoModelForSequenceClassification + AutoTokenizer and pipeline("text-classification")
    labels each of `pairs` (a sentence, or a pair) with one of the task's labels (STS-B, a regression: its
    one output, "score"); returns the labels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = AutoModelForSequenceClassification.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    loaded_tokenizer_fits(tokenizer, model, [text for pair in pairs for text in pair if text])
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer)
    inputs = [{"text": a, "text_pair": b} if b is not None else a for a, b in pairs]
    outputs = [classify(item) for item in inputs]
    labels = [(out[0] if isinstance(out, list) else out)["label"] for out in outputs]
    assert set(labels) <= (set(task.labels) or {"score"}), (labels, task.labels)
    return labels
