"""The GLUE ``finetune`` command's flags and their typed, validated form (no torch imported here).

One home per setting, as in pretraining and SQuAD (pretrain/finetune/common.py): these flags own
what a fine-tune tunes (lr, schedule, batch sizes, precision); the DeepSpeed JSON (--ds-config)
holds engine mechanics only, and one that sets an owned key is refused naming the flag. The
defaults are BERT's GLUE fine-tune (Devlin et al. 2019, appendix A.3: AdamW, weight decay 0.01,
10% warmup then linear decay, batch 32, 3 epochs, sequences of 128 tokens; lr picked per task
from 5e-5, 4e-5, 3e-5, 2e-5).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import ConfigError
from pretrain.finetune.common import (
    EngineFlags,
    add_config_arguments,
    check_positive,
    flag,
)
from pretrain.finetune.common import config_from_args as common_config_from_args
from pretrain.finetune.glue.data import GlueFormatError
from pretrain.finetune.glue.tasks import TASKS, Task, task_named
from pretrain.finetune.vocab_check import ALLOW_UNK_DOC

TASK_NAMES = ", ".join(task.name for task in TASKS.values())


@dataclass(frozen=True)
class GlueConfig(EngineFlags):
    """Every GLUE `finetune` flag, declared once (the engine's, shared with SQuAD, in EngineFlags; the command
    line and its --help are built from these)."""

    format_error = GlueFormatError
    items = "examples"
    steps_scope = " per seed"

    task: str = flag(None, f"GLUE task: {TASK_NAMES} (or GLUE's spelling: CoLA, SST-2, STS-B, ...)", required=True)
    model: Path = flag(None, "Hugging Face BERT folder (our export, or any BERT): config.json + weights + "
                             "vocab.txt / tokenizer.json; a BertForPreTraining export gets a fresh classifier",
                       required=True)
    data: Path = flag(None, "the task's data: the official GLUE folder (glue_data/CoLA: train.tsv, dev.tsv, "
                            "[test.tsv]), a Hugging Face dataset saved with save_to_disk, or SPLIT.parquet files",
                      required=True)
    out: Path = flag(None, "output folder: results.json, seed-N/ per seed, submission/, tensorboard/", required=True)
    seeds: int = flag(1, "fine-tune this many times (seeds --seed, --seed+1, ...): each is reported, and the "
                         "median (BERT's paper reports the median of several runs)")
    seed: int = flag(42, "the first seed: the classifier's initial weights, the data order and dropout")
    epochs: float = flag(3.0, "passes over the training set")
    lr: float = flag(2e-5, "peak learning rate, reached at the end of warmup")
    max_seq_length: int = flag(128, "tokens per example (both sentences and 3 special tokens; longer pairs are "
                                    "cut, the longer sentence first)")
    eval_batch_size: int = flag(128, "examples per forward pass and rank when predicting")
    max_train_examples: int | None = flag(None, "first N training examples only (smoke runs)")
    max_eval_examples: int | None = flag(None, "first N examples of each dev and test set only")
    log_every: int = flag(50, "optimizer steps between TensorBoard / console logs")
    save_model: bool = flag(False, "save_pretrained the fine-tuned model of the seed best on dev (+ tokenizer) "
                                   "into OUT/model (ZeRO 0-2)")
    # Refused by default (pretrain/finetune/vocab_check.py): a tokenizer that reads the text as [UNK]s trains on nothing.
    allow_unk: bool = flag(False, ALLOW_UNK_DOC)

    def __post_init__(self) -> None:
        for name in ("task", "model", "data", "out"):
            if getattr(self, name) is None:
                raise GlueFormatError(f"--{name} is required")
        try:
            task_named(self.task)
            check_positive({name: getattr(self, name) for name in (
                "seeds", "epochs", "lr", "max_seq_length", "eval_batch_size", "max_train_examples",
                "max_eval_examples", "log_every")})
        except (ValueError, ConfigError) as err:
            raise GlueFormatError(str(err)) from None
        self.check_engine_flags()

    @property
    def glue_task(self) -> Task:
        return task_named(self.task)

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + offset for offset in range(self.seeds)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GlueConfig)


def config_from_args(args: argparse.Namespace) -> GlueConfig:
    return common_config_from_args(args, GlueConfig)
