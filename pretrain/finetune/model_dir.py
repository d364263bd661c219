"""Check a Hugging Face BERT folder before anything heavy is loaded (no torch here)."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.finetune.squad.data import SquadFormatError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
VOCAB_FILES = ("tokenizer.json", "vocab.txt")


def check_model_dir(path: Path) -> dict:
    """Return the folder's config.json; raise a SquadFormatError naming what is missing or wrong."""
    if not path.is_dir():
        raise SquadFormatError(f"--model {path}: not a folder (expected a Hugging Face BERT checkpoint folder)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SquadFormatError(f"--model {path}: no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise SquadFormatError(f"{config_path}: malformed JSON: {err}") from None
    if not isinstance(config, dict):
        raise SquadFormatError(f"{config_path}: expected a JSON object")
    if config.get("model_type") not in (None, "bert"):
        raise SquadFormatError(f"{config_path}: model_type is {config.get('model_type')!r}; this fine-tuner needs a BERT")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise SquadFormatError(f"--model {path}: no weights (looked for {', '.join(WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in VOCAB_FILES):
        raise SquadFormatError(f"--model {path}: no vocabulary (looked for {', '.join(VOCAB_FILES)})")
    return config
