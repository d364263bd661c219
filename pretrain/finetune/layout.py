"""Every name a fine-tune's output folder (`--out`) holds, spelled once: SQuAD and GLUE write them, the run
report (pretrain/report/records.py) reads them back. Standard library only.

    OUT/results.json              the scores, the model folder they came from, the settings (both tasks)
    OUT/predictions.json          SQuAD: question id -> answer (the official scorer's input)
    OUT/nbest_predictions.json    SQuAD: the n best spans per question
    OUT/null_odds.json            SQuAD v2.0: the no-answer score per question
    OUT/tensorboard/              SQuAD: train/loss, train/lr, squad/*; GLUE: one run per seed, seed-N/
    OUT/seed-N/results.json       GLUE: one seed's scores; seed-N/dev/, seed-N/test/ its predictions (TSV)
    OUT/submission/               GLUE: the test predictions of the seed best on dev
    OUT/model/                    --save-model: the fine-tuned model + tokenizer (GLUE: the seed best on dev)
"""

from __future__ import annotations

from pathlib import Path

RESULTS = "results.json"
PREDICTIONS = "predictions.json"
NBEST_PREDICTIONS = "nbest_predictions.json"
NULL_ODDS = "null_odds.json"
TENSORBOARD = "tensorboard"
SUBMISSION = "submission"
MODEL = "model"
RESULTS_GLOB = "*" + RESULTS  # what the run report looks for in a folder beside the run


def seed_dir(out: Path, seed: int) -> Path:
    """GLUE: one seed's folder (its results.json, dev/ and test/ predictions)."""
    return Path(out) / f"seed-{seed}"


def seed_tensorboard(out: Path, seed: int) -> Path:
    """GLUE: one seed's TensorBoard run."""
    return Path(out) / TENSORBOARD / f"seed-{seed}"
