"""The ``finetune`` command's arguments and their typed, validated form (no torch imported here).

One home per setting, as in pretraining: these flags own what a fine-tune tunes (lr, schedule, batch
sizes, precision); the DeepSpeed JSON (--ds-config) holds engine mechanics only, and one that sets an
owned key is refused naming the flag (pretrain/finetune/squad/finetune.py, pretrain/config/deepspeed.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pretrain.finetune.common import (
    EngineFlags,
    add_config_arguments,
    flag,
)
from pretrain.finetune.common import config_from_args as common_config_from_args
from pretrain.finetune.squad.data import SquadFormatError
from pretrain.finetune.vocab_check import ALLOW_UNK_DOC


@dataclass(frozen=True)
class FinetuneConfig(EngineFlags):
    """Every `finetune` flag, declared once (the engine's, shared with GLUE, in EngineFlags): `add_arguments`
    builds the command line (names, types, defaults, choices, help) from these fields, so the flags and their
    documentation cannot drift apart."""

    format_error = SquadFormatError
    items = "windows"
    json_hint = " (ds_configs/deepspeed/squad_*.json)"

    model: Path = flag(None, "Hugging Face BERT folder (our export, MiniLM, ...): config.json + weights + "
                             "vocab.txt / tokenizer.json", required=True)
    out: Path = flag(None, "output folder (predictions, results, tensorboard)", required=True)
    train: Path | None = flag(None, "SQuAD training JSON; omit to only evaluate")
    dev: Path | None = flag(None, "SQuAD dev JSON to predict and score")
    hf_dataset: str | None = flag(None, "load SQuAD (both splits) by name", choices=("squad", "squad_v2"))
    version: int | None = flag(None, "SQuAD version (default: from the data: 2 when any question is "
                                     "unanswerable)", choices=(1, 2))
    epochs: float = flag(2.0, "passes over the training windows")
    lr: float = flag(3e-5, "peak learning rate, reached at the end of warmup (BERT's SQuAD value for AdamW; "
                           "our ExactLamb config starts from 2e-4)")
    seed: int = flag(42, "seed of the head's initial weights, the data order and dropout")
    max_seq_length: int = flag(384, "tokens per window (question + context + 3 special tokens)")
    doc_stride: int = flag(128, "context tokens between the starts of two windows of one paragraph")
    max_query_length: int = flag(64, "question tokens kept")
    n_best: int = flag(20, "start/end candidates per window considered by the post-processing")
    max_answer_length: int = flag(30, "longest answer (tokens) the post-processing accepts")
    null_score_diff_threshold: float = flag(0.0, "v2: predict no answer when its score beats the best span by this")
    eval_batch_size: int = flag(64, "windows per forward pass and rank")
    max_train_examples: int | None = flag(None, "first N training questions only (smoke runs, benchmarks)")
    max_eval_examples: int | None = flag(None, "first N dev questions only")
    log_every: int = flag(10, "optimizer steps between TensorBoard / console logs")
    save_model: bool = flag(False, "save_pretrained the fine-tuned model into OUT/model")
    # The architecture and tokenizer of --model with fresh weights (drawn from --seed): the same fine-tune
    # without pretraining, the baseline that shows what pretraining bought (the demo runs both).
    random_init: bool = flag(False, "--model's architecture + tokenizer, fresh weights: the no-pretraining "
                                     "baseline")
    # Refused by default (pretrain/finetune/vocab_check.py): a tokenizer that reads the text as [UNK]s trains on nothing.
    allow_unk: bool = flag(False, ALLOW_UNK_DOC)

    def __post_init__(self) -> None:
        for name in ("model", "out"):
            if getattr(self, name) is None:
                raise SquadFormatError(f"--{name} is required")
        if self.hf_dataset is not None and (self.train is not None or self.dev is not None):
            raise SquadFormatError("give either --hf-dataset or --train/--dev files, not both")
        if self.hf_dataset is not None and self.hf_dataset not in ("squad", "squad_v2"):
            raise SquadFormatError(f"--hf-dataset must be squad or squad_v2, got {self.hf_dataset!r}")
        if self.hf_dataset is None and self.dev is None:
            raise SquadFormatError("--dev FILE (or --hf-dataset) is required: fine-tuning ends by scoring the dev set")
        positive = {
            "max_seq_length": self.max_seq_length,
            "doc_stride": self.doc_stride,
            "max_query_length": self.max_query_length,
            "n_best": self.n_best,
            "max_answer_length": self.max_answer_length,
            "eval_batch_size": self.eval_batch_size,
            "log_every": self.log_every,
        }
        for name, value in positive.items():
            if value <= 0:
                raise SquadFormatError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        for name in ("max_train_examples", "max_eval_examples"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SquadFormatError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.max_seq_length < self.max_query_length + 4:
            raise SquadFormatError(
                f"--max-seq-length {self.max_seq_length} leaves no room for the context after a "
                f"--max-query-length {self.max_query_length} question and 3 special tokens"
            )
        if self.epochs <= 0:
            raise SquadFormatError(f"--epochs must be > 0, got {self.epochs}")
        if self.lr <= 0:
            raise SquadFormatError(f"--lr must be > 0, got {self.lr}")
        if self.version not in (None, 1, 2):
            raise SquadFormatError(f"--version must be 1 or 2, got {self.version}")
        self.check_engine_flags()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--name-with-dashes` for every FinetuneConfig field: its type, default, choices and doc."""
    add_config_arguments(parser, FinetuneConfig)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    return common_config_from_args(args, FinetuneConfig)
