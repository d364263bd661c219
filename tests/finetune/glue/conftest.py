"""Shared GLUE fixtures: one tiny export (our layout: BertForPreTraining weights) for every test here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import squad_fixtures


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BertForPreTraining saved as pretrain/checkpointing/export.py writes it (save_pretrained + tokenizer)."""
    return squad_fixtures.build_tiny_bert(tmp_path_factory.mktemp("glue_export") / "export", head="pretraining",
                                          seed=1)
