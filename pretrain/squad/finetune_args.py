"""The ``finetune`` command's arguments and their typed, validated form (no torch imported here)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pretrain.squad.data import SquadFormatError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DS_CONFIG = REPO_ROOT / "ds_configs" / "squad.json"
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class FinetuneConfig:
    model: Path  # a Hugging Face BERT folder: config.json + weights + vocab.txt / tokenizer.json
    out: Path
    train: Path | None = None
    dev: Path | None = None
    hf_dataset: str | None = None  # "squad" or "squad_v2": load both splits by name
    ds_config: Path = DEFAULT_DS_CONFIG
    version: int | None = None  # 1 or 2; None = from the data (v2 when any question is unanswerable)
    epochs: float = 2.0
    max_steps: int | None = None  # overrides epochs
    lr: float | None = None  # overrides ds_config optimizer.params.lr
    warmup_fraction: float = 0.1
    precision: str = "auto"  # auto: the JSON's bf16/fp16 on GPU, fp32 on CPU
    seed: int = 42
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    n_best: int = 20
    max_answer_length: int = 30
    null_score_diff_threshold: float = 0.0
    eval_batch_size: int = 64  # windows per forward pass and rank
    max_train_examples: int | None = None  # first N questions only (smoke runs, benchmarks)
    max_eval_examples: int | None = None
    log_every: int = 10  # optimizer steps between TensorBoard / console logs
    save_model: bool = False  # save_pretrained the fine-tuned model into OUT/model
    # The architecture and tokenizer of --model with fresh weights (drawn from --seed): the same fine-tune
    # without pretraining, the baseline that shows what pretraining bought (the demo runs both).
    random_init: bool = False

    def __post_init__(self) -> None:
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
        for name in ("max_steps", "max_train_examples", "max_eval_examples"):
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
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise SquadFormatError(f"--warmup-fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.lr is not None and self.lr <= 0:
            raise SquadFormatError(f"--lr must be > 0, got {self.lr}")
        if self.precision not in PRECISIONS:
            raise SquadFormatError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.version not in (None, 1, 2):
            raise SquadFormatError(f"--version must be 1 or 2, got {self.version}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FinetuneConfig(model=Path("."), out=Path("."), dev=Path("."))
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face BERT folder (our export, MiniLM, ...)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (predictions, results, tensorboard)")
    parser.add_argument("--train", type=Path, default=None, help="SQuAD training JSON; omit to only evaluate")
    parser.add_argument("--dev", type=Path, default=None, help="SQuAD dev JSON to predict and score")
    parser.add_argument("--hf-dataset", default=None, choices=("squad", "squad_v2"), help="load SQuAD by name")
    parser.add_argument("--ds-config", type=Path, default=defaults.ds_config, help="DeepSpeed JSON (ds_configs/squad*.json)")
    parser.add_argument("--version", type=int, default=None, choices=(1, 2), help="SQuAD version (default: from the data)")
    parser.add_argument("--epochs", type=float, default=defaults.epochs)
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (overrides the DeepSpeed JSON)")
    parser.add_argument("--warmup-fraction", type=float, default=defaults.warmup_fraction)
    parser.add_argument("--precision", default=defaults.precision, choices=PRECISIONS)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-seq-length", type=int, default=defaults.max_seq_length)
    parser.add_argument("--doc-stride", type=int, default=defaults.doc_stride)
    parser.add_argument("--max-query-length", type=int, default=defaults.max_query_length)
    parser.add_argument("--n-best", type=int, default=defaults.n_best)
    parser.add_argument("--max-answer-length", type=int, default=defaults.max_answer_length)
    parser.add_argument("--null-score-diff-threshold", type=float, default=defaults.null_score_diff_threshold)
    parser.add_argument("--eval-batch-size", type=int, default=defaults.eval_batch_size)
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument("--save-model", action="store_true", help="save_pretrained the fine-tuned model to OUT/model")
    parser.add_argument("--random-init", action="store_true",
                        help="--model's architecture + tokenizer, fresh weights: the no-pretraining baseline")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment instead.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    fields = {name: getattr(args, name) for name in FinetuneConfig.__dataclass_fields__ if hasattr(args, name)}
    return FinetuneConfig(**fields)
