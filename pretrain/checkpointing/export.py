"""A model's weights -> a Hugging Face model folder, verified.

The fp32 weights (consolidated from a checkpoint's ZeRO partitions by the caller: pretrain/export.py, the driver's
phase-end export and `python -m pretrain.export`) are loaded into a plain `BertForPreTraining` (a run that trained
MLM + NSP) or `BertForMaskedLM` (MLM alone: no NSP head is shipped untrained), and written with `save_pretrained`
(safetensors) plus the tokenizer the shards were built with (export_tokenizer.py: data prep's own `tokenizers`
object, reloaded with `AutoTokenizer` and checked on the shards' probe sentences). The folder is then re-loaded
with `AutoModelForPreTraining` / `AutoModelForMaskedLM` (offline, the way a user will) and its MLM logits compared
with the training model's on one batch; a mismatch is an error, not a warning. The folder appears under its final
name only once complete.

OUT is replaced only when it is an earlier export (it holds `export_info.json`) or an empty folder
(`check_export_target`): a typo such as `export runs/x/checkpoints runs/x` used to delete the whole run, the
checkpoints it was exporting included. A folder that holds or lies inside the checkpoint is refused too. The earlier
export is renamed aside and deleted only once the new one is in place, so a failure never leaves OUT empty. The
folder takes `0o777 & ~umask` (mkdtemp makes it 0700): an export is meant to be handed on.

Every export carries its model card, but the card is not this floor's: its facts are read from the run folder and
rendered by pretrain/report/model_card.py, above checkpointing/. So the caller hands `export_state_dict` the card
as a callable (`CardWriter`) and this module imports nothing of the report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    PreTrainedModel,
)

from data_prep.shard_format.atomic_io import atomic_write_json, give_mode, shared_mode
from pretrain.checkpointing.export_tokenizer import (
    TokenizerExportError,
    check_saved_tokenizer,
    save_tokenizer,
)
from pretrain.model.bert import SparseBertForPreTraining, trains_nsp
from pretrain.run_folder import EXPORT_INFO

# Keys that may legitimately be absent from a consolidated checkpoint: non-persistent buffers.
_OPTIONAL_KEYS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


NSP_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")  # what only a model that trains NSP has

CardWriter = Callable[[Path, dict[str, Any], str], object]
"""Writes the model card into the staged folder: (folder, what the export knows: `source`, `run_config` (the resolved
block alone) and `tokenizer` (the facts check_saved_tokenizer proved), the folder's final name for the card's
loading lines). pretrain/report/model_card.py's ExportCard is the one every caller hands in."""


class ExportTargetError(FileExistsError):
    """OUT is not a folder an export may replace; the message is the one line to print (nothing was written)."""


def check_export_target(out: Path, checkpoint: Path | None = None) -> None:
    """Refuse `out` unless it is new, an empty folder or an earlier export, and (with `checkpoint`, the source's
    checkpoint folder) unless it lies apart from the checkpoint. Cheap: callers run it before any work."""
    out = Path(out)
    where = f"export to {out} refused, nothing written:"
    if checkpoint is not None:
        target, source = out.resolve(), Path(checkpoint).resolve()
        if target == source or target in source.parents:
            raise ExportTargetError(f"{where} it holds the checkpoint being exported ({checkpoint}); choose a "
                                    "new folder, e.g. <run.dir>/export/<name>")
        if source in target.parents:
            raise ExportTargetError(f"{where} it lies inside the checkpoint folder {checkpoint}; choose a folder "
                                    "outside it")
    if out.is_symlink():
        raise ExportTargetError(f"{where} it is a symbolic link (to {os.readlink(out)}); name the folder itself")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportTargetError(f"{where} it is a file, not a folder")
    if (out / EXPORT_INFO).is_file():
        return  # an earlier export: replaced once the new one is complete
    entries = sorted(entry.name for entry in out.iterdir())
    if entries:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ExportTargetError(f"{where} it holds files that are no earlier export ({shown}; no {EXPORT_INFO}); "
                                "choose a new or empty folder")


def move_into_place(staging: Path, out: Path) -> None:
    """Rename the complete `staging` folder to `out`. An earlier export there is renamed aside first and deleted
    only after the new one is in place (a failed rename puts it back); `out` is checked again, as it may have
    changed during the export's work."""
    check_export_target(out)
    give_mode(staging, shared_mode(0o777))  # mkdtemp's 0700 -> what mkdir would give
    aside = None
    if out.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced.", dir=out.parent))
        os.replace(out, aside)  # onto the empty folder mkdtemp reserved
    try:
        os.replace(staging, out)
    except BaseException:
        if aside is not None:
            os.replace(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """`state_dict` into `model`, every weight accounted for. A model that trains MLM alone takes a BERT's weights
    without their pooler and NSP head (they are not part of it); the other way round is refused: weights
    trained without NSP have no NSP head to start an MLM + NSP run from."""
    if not trains_nsp(model.config):
        state_dict = {key: value for key, value in state_dict.items() if not key.startswith(NSP_PREFIXES)}
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [key for key in missing if key not in _OPTIONAL_KEYS and key != "cls.predictions.decoder.weight"]
    if missing or unexpected:
        kind = "BertForPreTraining (MLM + NSP)" if trains_nsp(model.config) else "BertForMaskedLM (MLM alone)"
        hint = ("; they were trained without NSP: start an MLM + NSP run from a BertForPreTraining"
                if missing and all(key.startswith(NSP_PREFIXES) for key in missing) else "")
        raise ValueError(f"{source}: weights do not fit {kind}: missing {missing}, unexpected {unexpected}{hint}")
    model.tie_weights()


def export_class(config: BertConfig) -> type[PreTrainedModel]:
    """The Hugging Face class an export of this model loads as: what it was trained for, and nothing more."""
    return BertForPreTraining if trains_nsp(config) else BertForMaskedLM


def folder_class(config: BertConfig) -> type[PreTrainedModel]:
    """The class a Hugging Face BERT folder's weights were saved from: ours say it in their config, others in
    `architectures` (a BertForMaskedLM has no NSP head to load)."""
    if not trains_nsp(config) or (config.architectures or []) == ["BertForMaskedLM"]:
        return BertForMaskedLM
    return BertForPreTraining


def verification_batch(config: BertConfig, seed: int = 0, batch: int = 2, seq_len: int = 32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    seq_len = min(seq_len, config.max_position_embeddings)
    input_ids = torch.randint(5, config.vocab_size, (batch, seq_len), generator=generator)
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq_len // 2 :] = 1
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": torch.ones_like(input_ids)}


@torch.no_grad()
def max_logit_difference(exported: Path, reference: SparseBertForPreTraining) -> float:
    """Largest |difference| of MLM logits between the exported folder and the reference model."""
    auto = AutoModelForPreTraining if trains_nsp(reference.config) else AutoModelForMaskedLM
    loaded = auto.from_pretrained(str(exported), local_files_only=True).eval()
    batch = verification_batch(reference.config)
    output = loaded(**batch)
    theirs = output.prediction_logits if trains_nsp(reference.config) else output.logits
    ours = reference.eval().dense_mlm_logits(**batch)
    return float((theirs - ours).abs().max())


def export_state_dict(
    state_dict: dict[str, torch.Tensor], resolved: dict[str, Any], out: Path, source: str, write_card: CardWriter,
    tolerance: float = 1e-4,
) -> dict[str, Any]:
    """Write `state_dict` as a verified HF folder at `out`; `resolved` is the run config's resolved block. `write_card`
    writes the model card into the folder before it appears under its name (required: no export ships without one).
    `out` must be new, empty or an earlier export (ExportTargetError before any work)."""
    out = Path(out)
    check_export_target(out)
    config = BertConfig.from_dict(resolved["model_config"])
    reference = SparseBertForPreTraining(config)
    load_weights(reference, state_dict, source)
    plain = export_class(config)(config)
    load_weights(plain, state_dict, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(str(staging), safe_serialization=True)
        saved = save_tokenizer(resolved, staging, config.max_position_embeddings)
        try:  # loaded as a user loads it, or no export
            tokenizer_facts = check_saved_tokenizer(staging, saved)
        except TokenizerExportError as err:
            raise TokenizerExportError(f"export of {source} to {out} refused: {err}") from None
        difference = max_logit_difference(staging, reference)
        if not difference <= tolerance:
            raise RuntimeError(
                f"export of {source}: MLM logits of the saved model differ from the checkpoint's by {difference:.3g}"
            )
        info = {"source": source, "max_abs_logit_difference": difference, "vocab_sha256": resolved.get("vocab_sha256"),
                "tokenizer": tokenizer_facts}
        atomic_write_json(staging / EXPORT_INFO, info)
        write_card(staging, {"source": source, "run_config": {"resolved": resolved}, "tokenizer": tokenizer_facts},
                   str(out))
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info
