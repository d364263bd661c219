"""An export's model card, rewritten by `./launch.sh report` with the fine-tune results found since.

The facts come from the run's own records, never from the folder being written. The export's model_card.json is
written, not read: in a folder someone else can write, its `run.about` could carry any text into our card (a
review showed a shell line reaching a user's `.bashrc` that way). What is read:

- the export's export_info.json: which checkpoint it came from (`source`), and the tokenizer facts the export
  proved, kept only when each value has the type and shape the export writes;
- that checkpoint's run_config.json and trainer_state.json, when the checkpoint lies in the run's own checkpoint
  folder (RUN_DIR/checkpoints or the run's `checkpoint.dir`); a tag pruned since gives its phase and step by name;
- otherwise the run's config.resolved.json, and RUN_DIR's metrics and clock (pretrain/report/model_card.py).

The card names the folder as the report found it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.checkpointing.layout import RUN_CONFIG
from pretrain.report.model_card import card_facts, write_model_card
from pretrain.report.records import FinetuneResult, located
from pretrain.report.trust import read_json
from pretrain.run_folder import CHECKPOINTS, EXPORT_INFO, RESOLVED_CONFIG

CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
LIBRARY_VERSION = re.compile(r"transformers [0-9A-Za-z.+-]{1,40}")


def tokenizer_facts(block: Any) -> dict[str, Any] | None:
    """export_info.json's tokenizer facts when every value is what the export writes; else None (no line)."""
    if not isinstance(block, dict):
        return None
    whole = all(isinstance(block.get(key), int) and not isinstance(block.get(key), bool)
                for key in ("size", "probe_sentences"))
    if not (whole and isinstance(block.get("class"), str) and CLASS_NAME.fullmatch(block["class"])
            and isinstance(block.get("checked_with"), str) and LIBRARY_VERSION.fullmatch(block["checked_with"])):
        return None
    probe = "shards" if block.get("probe_source") == "shards" else "fixed sentences"
    return {"class": block["class"], "size": block["size"], "probe_sentences": block["probe_sentences"],
            "probe_source": probe, "checked_with": block["checked_with"]}


def checkpoint_roots(run_dir: Path, config: dict[str, Any]) -> set[Path]:
    """The run's own checkpoint folders: RUN_DIR/checkpoints and the `checkpoint.dir` its resolved config names."""
    roots = {(run_dir / CHECKPOINTS).resolve()}
    named = config.get("checkpoint", {}).get("dir") if isinstance(config.get("checkpoint"), dict) else None
    if isinstance(named, str) and named:
        roots.add(Path(named).resolve())
    return roots


def refresh_card(folder: Path, run_dir: Path, finetune: Sequence[FinetuneResult]) -> bool:
    """Rewrite the card of the export `folder` of the run `run_dir` with `finetune`; False: no source recorded."""
    folder, run_dir = Path(folder), Path(run_dir)
    info = read_json(folder / EXPORT_INFO)
    source = info.get("source") if isinstance(info, dict) else None
    if not isinstance(source, str) or not source:
        return False
    config = read_json(run_dir / RESOLVED_CONFIG)
    config = config if isinstance(config, dict) else {}
    checkpoint = located(source, folder / EXPORT_INFO)
    ours = checkpoint.parent.resolve() in checkpoint_roots(run_dir, config)
    recorded = read_json(checkpoint / RUN_CONFIG) if ours else None
    run_config = recorded if isinstance(recorded, dict) else config
    facts = card_facts(checkpoint.parent, checkpoint.name, run_config, run_dir=run_dir, read_checkpoint=ours)
    facts["source"] = source
    tokenizer = tokenizer_facts(info.get("tokenizer"))
    if tokenizer is not None:
        facts["tokenizer"] = tokenizer
    write_model_card(folder, facts, str(folder), finetune)
    return True
