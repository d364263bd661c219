"""The model card every export carries: README.md in the Hugging Face format, and the facts behind it.

A Hugging Face user expects a model folder to say what it is. The card's YAML header is what the Hub
reads (library_name: transformers, pipeline_tag, tags, the datasets when they are Hub datasets, and a
`model-index` with fine-tune results once there are any); its body says what a person needs: the
architecture, the vocabulary, the data, the recipe and how far it ran, the last validation figures and
the quality marks reached, and how to load it. No license is written: the weights' terms follow from the
training data, which the toolkit cannot know; the card says to add one before publishing.

The facts are gathered at export (`card_facts`: the checkpoint's run config and trainer state, the run folder's
metrics.jsonl and run_clock.json, the shards' manifest) and kept beside the card as model_card.json, a record
for people and tools. `./launch.sh report` regenerates the card with fine-tune results later from the run's own
records again (pretrain/report/card_refresh.py), never from the folder it writes: a model_card.json someone
else put there would otherwise put their words in our card. Both files are written through a temp file renamed
over the name (pretrain/report/trust.py), so a link standing under README.md.partial or README.md is replaced,
not written through.

The export (pretrain/checkpointing/export.py) sits below this floor, so it does not import the card: its caller
hands it an `ExportCard`, which it calls on the staged folder with the tokenizer facts it checked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpointing.layout import TAG_PATTERN, TRAINER_STATE
from pretrain.config.deepspeed import precision_of
from pretrain.report.records import (
    FinetuneResult,
    global_step,
    last_validation,
    read_rows,
    schedule_text,
)
from pretrain.report.trust import read_json, write_file
from pretrain.run_folder import CLOCK_FILE, TENSORBOARD

CARD_FILE = "README.md"
CARD_FACTS = "model_card.json"
CARD_TAGS = ["bert", "fill-mask", "pretraining", "deepspeed", "bert-ds"]
VALIDATION_KEYS = ("val/mlm_loss", "val/mlm_acc", "time/wall_s", "time/device_hours", "time/samples")
TRAINING_KEYS = ("loss/mlm", "loss/nsp", "acc/mlm", "acc/nsp")


def _run_dir(root: Path, run_config: dict[str, Any]) -> Path | None:
    """The run folder of a checkpoint: run.dir as the driver saw it, else the folder above checkpoints/."""
    for candidate in (Path(str(run_config.get("run", {}).get("dir", ""))), root.parent):
        if str(candidate) and (candidate / TENSORBOARD).is_dir():
            return candidate.resolve()
    return None


def _data_summary(resolved: dict[str, Any]) -> dict[str, Any]:
    """Where the shards came from, from their manifest (beside the vocab file the run used)."""
    manifest = read_json(Path(str(resolved.get("vocab_file", ""))).parent / "manifest.json")
    if not isinstance(manifest, dict):
        return {}
    build = manifest.get("config", {})
    return {
        "shards": str(Path(str(resolved.get("vocab_file", ""))).parent),
        "wiki_dumps": [Path(p).name for p in build.get("wiki_dumps", [])],
        "books": [Path(p).name for p in build.get("books", [])],
        "hf_datasets": list(build.get("hf_datasets", [])),
        "texts": [Path(p).name for p in build.get("texts", [])],
        "totals": manifest.get("totals", {}),
        "masking": manifest.get("masking", {}),
    }


def _state_of(root: Path | None, tag: str) -> dict[str, Any] | None:
    """The tag's trainer state; for a tag no longer there (a pruned step checkpoint), its phase and step from the
    tag's name; None when neither is known. `root` None: a checkpoint folder that is not the run's, not read."""
    state = read_json(root / tag / TRAINER_STATE) if root is not None else None
    if isinstance(state, dict):
        return state
    match = TAG_PATTERN.match(tag)
    return {"phase": match.group(1), "step": int(match.group(2))} if match else None


def card_facts(root: Path, tag: str, run_config: dict[str, Any], run_dir: Path | None = None,
               read_checkpoint: bool = True) -> dict[str, Any]:
    """What the card says about the checkpoint root/tag, gathered from the files a run leaves. `run_dir`: the run
    folder when the caller knows it (the report); `read_checkpoint` False: the tag's files are not read."""
    state = _state_of(Path(root) if read_checkpoint else None, tag)
    run_dir = Path(run_dir).resolve() if run_dir is not None else _run_dir(Path(root), run_config)
    step = global_step(run_config, state["phase"], state["step"]) if state else None
    rows = read_rows(run_dir) if run_dir else []
    validation = last_validation(rows, step)
    training = [row for row in rows if "loss/mlm" in row and (step is None or row["step"] <= step)]
    clock = read_json(run_dir / CLOCK_FILE) if run_dir else None
    targets = clock.get("targets", {}) if isinstance(clock, dict) else {}
    return {
        "format": 1,
        "source": str(Path(root) / tag),
        "run_dir": str(run_dir) if run_dir else None,
        "run_config": run_config,
        "state": state,
        "global_step": step,
        "validation": {k: validation[k] for k in ("step", *VALIDATION_KEYS) if k in validation} if validation else None,
        "training": {k: training[-1][k] for k in ("step", *TRAINING_KEYS) if k in training[-1]} if training else None,
        "targets": {k: v for k, v in targets.items() if step is None or v.get("step", 0) <= step},
        "data": _data_summary(run_config.get("resolved", {})),
    }


def _baseline(result: FinetuneResult) -> bool:
    """A fine-tune of the same architecture from random weights (the demo's baseline): not these weights' score."""
    return any("random weights" in note for note in result.notes)


def _card_data(facts: dict[str, Any], name: str, finetune: Sequence[FinetuneResult]) -> Any:
    from huggingface_hub import EvalResult, ModelCardData  # the card's YAML as the Hub parses it

    results = []
    for result in finetune:
        if _baseline(result):
            continue  # a baseline that did not use these weights
        squad = result.task == "squad"
        for metric, value in result.metrics.items():
            results.append(EvalResult(
                task_type="question-answering" if squad else "text-classification",
                dataset_type=("squad_v2" if "2.0" in result.benchmark else "squad") if squad else "glue",
                dataset_name=result.benchmark if squad else f"GLUE {result.task.upper()}",
                dataset_config=None if squad else result.task, dataset_split="validation",
                metric_type=metric, metric_value=round(value, 4)))
    hf_datasets = sorted({d.split(":")[0] for d in facts.get("data", {}).get("hf_datasets", [])})
    return ModelCardData(library_name="transformers", pipeline_tag="fill-mask", tags=list(CARD_TAGS),
                         datasets=hf_datasets or None, model_name=name, eval_results=results or None)


def _number(value: Any, digits: int = 4) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "n/a"


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def introduction(nsp: bool, resolved: dict[str, Any]) -> str:
    """What was trained and what the folder holds: MLM + NSP (BERT's sentence pairs) or MLM alone."""
    masking = resolved.get("mask_probability") or {}
    rate = f" at {max(masking.values()):.0%} masking" if masking else ""
    if nsp:
        return ("A BERT pretrained from scratch with BERT-DS (masked-LM + next-sentence prediction on sentence pairs"
                f"{rate}, DeepSpeed, exact LAMB), exported as `BertForPreTraining`: the encoder with its MLM and NSP "
                "heads. Its logits were checked against the training checkpoint's at export.")
    segments = resolved.get("segments", "packed")
    return ("A BERT pretrained from scratch with BERT-DS (masked-LM alone, no next-sentence prediction, on "
            f"{segments} inputs{rate}, DeepSpeed), exported as `BertForMaskedLM`: the encoder with its MLM head; it "
            "has no pooler and no NSP head, none having been trained (a classifier fine-tune starts its pooler from "
            "random weights). Its logits were checked against the training checkpoint's at export.")


def _tokenizer_line(facts: dict[str, Any]) -> list[str]:
    """How the tokenizer was proven at export: the shards' own, reloaded with AutoTokenizer, ids checked."""
    checked = facts.get("tokenizer")
    if not checked:
        return []
    probe = ("the shards' probe" if checked.get("probe_source") == "shards" else "a fixed set") + " of " + \
        f"{checked.get('probe_sentences')} sentences"
    return [f"The tokenizer (`tokenizer.json`) is the one data prep tokenized the training data with; at export it "
            f"loaded with `AutoTokenizer` as {checked.get('class')} of {_count(checked.get('size'))} tokens and gave "
            f"data prep's ids to {probe} ({checked.get('checked_with')})."]


def _body(facts: dict[str, Any], name: str, folder_text: str, finetune: Sequence[FinetuneResult]) -> list[str]:
    config = facts.get("run_config", {})
    resolved = config.get("resolved", {})
    model = resolved.get("model_config", {})
    state = facts.get("state") or {}
    nsp = resolved.get("objective", "mlm+nsp") == "mlm+nsp"  # runs before the key trained both
    lines = [f"# {name}", "", introduction(nsp, resolved), ""]
    about = config.get("run", {}).get("about")
    if about:
        lines += [f"Recipe: {about}", ""]
    lines += ["## Architecture", "",
              f"{model.get('num_hidden_layers', '?')} layers, hidden size {model.get('hidden_size', '?')}, "
              f"{model.get('num_attention_heads', '?')} attention heads, feed-forward "
              f"{model.get('intermediate_size', '?')}, activation {model.get('hidden_act', '?')}, "
              f"{model.get('max_position_embeddings', '?')} positions (preset `{config.get('model', {}).get('preset')}`).",
              "", "## Vocabulary", "",
              f"WordPiece, {_count(model.get('vocab_size'))} tokens, lowercase: {resolved.get('lowercase')}, "
              f"sha256 `{str(resolved.get('vocab_sha256'))[:16]}…` (`vocab.txt` in this folder).", *_tokenizer_line(facts),
              "", "## Data", ""]
    data = facts.get("data") or {}
    sources = [*(f"Wikipedia dump `{d}`" for d in data.get("wiki_dumps", [])),
               *(f"books `{b}`" for b in data.get("books", [])),
               *(f"Hugging Face dataset `{h}`" for h in data.get("hf_datasets", [])),
               *(f"text `{t}`" for t in data.get("texts", []))]
    totals = data.get("totals", {})
    lines.append(("Sources: " + "; ".join(sources) + ".") if sources else "Sources: not recorded in the shards' manifest.")
    if totals:
        shown = ", ".join(f"{totals[k]:,} {k}" for k in ("documents", "sentences", "tokens") if isinstance(totals.get(k), int))
        lines.append(f"Corpus: {shown}; masking {data.get('masking', {}).get('mode', '?')}.")
    lines += ["", "## Recipe and steps", "",
              "| phase | seq len | global batch | steps | lr | lr schedule | optimizer | precision |",
              "|---|---|---|---|---|---|---|---|"]
    for phase in config.get("run", {}).get("phases", []):
        section, ds = config.get(phase, {}), resolved.get("ds_configs", {}).get(phase, {})
        precision = precision_of(ds)
        lines.append(f"| {phase} | {section.get('seq_len')} | {ds.get('train_batch_size', section.get('batch_size'))} | "
                     f"{section.get('steps')} | {section.get('lr')} | {schedule_text(config, phase)} | "
                     f"{ds.get('optimizer', {}).get('type', '?')} | {precision} |")
    lines += ["", f"This export: `{facts.get('source')}`, {state.get('phase', '?')} step {state.get('step', '?')} "
              f"(global step {facts.get('global_step')}), {_count(state.get('samples_seen'))} sequences seen, "
              f"on {resolved.get('world_size', '?')} ranks." if state else "Steps: not recorded.",
              "", "## Validation", ""]
    validation, training = facts.get("validation"), facts.get("training")
    if validation:
        lines.append(f"At step {validation['step']} on the held-out shards: masked-LM loss "
                     f"{_number(validation.get('val/mlm_loss'))}, masked-LM accuracy {_number(validation.get('val/mlm_acc'))}.")
    else:
        lines.append("No validation figures were recorded for this checkpoint.")
    if training:
        nsp_loss = f", NSP {_number(training.get('loss/nsp'))}" if nsp else ""
        lines.append(f"Training loss at step {training['step']}: MLM {_number(training.get('loss/mlm'))}{nsp_loss}.")
    for key, mark in sorted(facts.get("targets", {}).items(), key=lambda item: float(item[0])):
        lines.append(f"- val/mlm_acc {key} reached at step {mark.get('step')}: {_number(mark.get('wall_s', 0) / 3600, 2)} h "
                     f"wall-clock, {_number(mark.get('device_hours'), 2)} device-hours.")
    finetune = [result for result in finetune if not _baseline(result)]  # the card describes these weights
    if finetune:
        lines += ["", "## Fine-tuning results", "", "| benchmark | task | metric | value | notes |", "|---|---|---|---|---|"]
        for result in finetune:
            for metric, value in result.metrics.items():
                lines.append(f"| {result.benchmark} | {result.task} | {metric} | {_number(value, 2)} | "
                             f"{'; '.join(result.notes)} |")
    lines += ["", "## How to load it", "", "```python", "from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline",
              "", f'tokenizer = AutoTokenizer.from_pretrained("{folder_text}")',
              f'model = AutoModelForMaskedLM.from_pretrained("{folder_text}")'
              + ("  # the MLM head; the NSP head is dropped" if nsp else ""),
              f'fill = pipeline("fill-mask", model="{folder_text}")', 'print(fill("The capital of France is [MASK]."))', "```",
              "", f"Fine-tune it: `./launch.sh squad finetune --model {folder_text} --train train-v1.1.json --dev "
              "dev-v1.1.json --out runs/squad`.", "",
              "## License", "", "Not recorded: the weights follow the terms of the training data above. Add a "
              "`license:` to the header before publishing.", ""]
    return lines


def render_card(facts: dict[str, Any], folder_text: str, finetune: Sequence[FinetuneResult] = ()) -> str:
    """README.md's text: the YAML header, then the body."""
    state = facts.get("state") or {}
    run_dir = facts.get("run_dir") or facts.get("run_config", {}).get("run", {}).get("dir") or "bert-ds"
    name = f"{Path(str(run_dir)).name}-{state.get('phase', 'export')}"
    header = _card_data(facts, name, finetune).to_yaml()
    return "---\n" + header + "\n---\n\n" + "\n".join(_body(facts, name, folder_text, finetune))


def write_model_card(folder: Path, facts: dict[str, Any], folder_text: str,
                     finetune: Sequence[FinetuneResult] = ()) -> Path:
    """README.md and model_card.json in `folder`; `folder_text` is how the card names the folder to load."""
    folder = Path(folder)
    write_file(folder / CARD_FACTS, (json.dumps({**facts, "folder": folder_text}, indent=1) + "\n").encode())
    write_file(folder / CARD_FILE, render_card(facts, folder_text, finetune).encode("utf-8"))
    return folder / CARD_FILE


@dataclass(frozen=True)
class ExportCard:
    """The card an export writes (a CardWriter of pretrain/checkpointing/export.py): `facts` gathered by card_facts
    from a checkpoint and its run folder, or None for weights with no run behind them (tests, a random-weights
    baseline), whose card says what the export knows: the source and the resolved block."""

    facts: dict[str, Any] | None = None

    def __call__(self, folder: Path, known: dict[str, Any], folder_text: str) -> Path:
        """`known`: the export's source, resolved block and the tokenizer facts it proved on the saved folder."""
        facts = {**self.facts, "tokenizer": known["tokenizer"]} if self.facts is not None else known
        return write_model_card(folder, facts, folder_text)

