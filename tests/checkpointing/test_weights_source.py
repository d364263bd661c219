"""Weights and shards share a vocab (pretrain/checkpointing/weights_source.py): resuming from a checkpoint, or
starting a phase from a checkpoint or an export, trained with another vocab is refused in one line naming both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.checkpointing.layout import RUN_CONFIG
from pretrain.checkpointing.weights_source import VocabIdentity, check_checkpoint_vocab, initial_weights
from pretrain.errors import ConfigError
from pretrain.run_folder import EXPORT_INFO

SHARDS = VocabIdentity("b" * 64, "/data/wiki_books/vocab.txt")


def checkpoint(root: Path, tag: str, sha: str, vocab_file: str) -> Path:
    (root / tag).mkdir(parents=True)
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"")  # what makes a folder a tag folder
    (root / tag / RUN_CONFIG).write_text(json.dumps({"resolved": {"vocab_sha256": sha, "vocab_file": vocab_file}}))
    (root / "latest").write_text(tag)
    return root


def test_resuming_a_checkpoint_of_another_vocab_is_refused_naming_both(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "ckpt", "phase1-step0000100", "a" * 64, "/data/old/vocab.txt")
    with pytest.raises(ConfigError) as refused:
        check_checkpoint_vocab(root, "phase1-step0000100", SHARDS, f"resume from {root}")
    message = str(refused.value)
    assert message.startswith(f"resume from {root}: {root}/phase1-step0000100 was trained with the vocab "
                              "/data/old/vocab.txt (sha256 aaaaaaaaaaaa), the shards use /data/wiki_books/vocab.txt "
                              "(sha256 bbbbbbbbbbbb)") and "\n" not in message
    check_checkpoint_vocab(root, "phase1-step0000100", VocabIdentity("a" * 64, "x"), "resume")  # same vocab: fine


def test_init_from_weights_of_another_vocab_is_refused_before_they_are_read(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "ckpt", "phase1-step0000007", "a" * 64, "/data/old/vocab.txt")
    with pytest.raises(ConfigError, match=r"^phase2.init_from: .*phase1-step0000007 was trained with the vocab "
                                          r"/data/old/vocab.txt \(sha256 a{12}\), the shards use "):
        initial_weights(str(root), SHARDS, "phase2.init_from")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / EXPORT_INFO).write_text(json.dumps({"vocab_sha256": "c" * 64}))
    with pytest.raises(ConfigError, match=rf"^phase2.init_from: {export} was trained with the vocab "
                                          rf"{export}/vocab.txt \(sha256 c{{12}}\), the shards use "):
        initial_weights(str(export), SHARDS, "phase2.init_from")
