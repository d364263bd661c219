"""The rank-side set-up of the model's attention path and compilation, right after the model is built.

The run plan already chose the path by the device's facts and the kernel self-test (pretrain/config/attention.py,
pretrain/device_check/settle.py `settle_attention`), refusing what cannot run in one line. What is left is the model's own
check (no decoder BERT on the unpadded path) and compiling the encoder layers where the plan says so
(pretrain/model/compiled.py): strictly under an explicit model.compile=true (a failed compile is a ConfigError),
else with an eager fallback and one line from the rank that fell back, naming it and its host. It takes plain
values (the phase's AttentionPlan), never the run config, and, where the caller has one, the process's
CompileLedger: one for all phases, so compile/recompiles counts over the process and a fallback is said once and
holds for later phases (pretrain/model/compiled.py).
"""

from __future__ import annotations

import os
import socket

import torch

from pretrain.errors import ConfigError
from pretrain.model.attention_plan import AttentionPlan
from pretrain.model.bert import SparseBertForPreTraining
from pretrain.model.compiled import CompileLedger, compile_layers
from pretrain.model.unpadded import check_layers_supported


def this_process() -> str:
    """This process in the job, for a line only it can say: 'rank 3 (node-b)' (the rank from the process group, else
    RANK; the host by name)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    return f"rank {rank} ({socket.gethostname()})"


def say_now(line: str) -> None:
    print(line, flush=True)


def prepare_model_path(model: SparseBertForPreTraining, attention: AttentionPlan,
                       ledger: CompileLedger | None = None) -> None:
    """Refuse an attention path this model cannot run (one line), else compile the layers if the plan says so.
    A compile fallback is this process's own (one rank may fall back where the others compile), so every rank says
    its own, naming itself (`this_process`): a silent rank would pace the job at eager speed unseen. `ledger`: the
    process's (None: this phase's own, counted from 0)."""
    if not attention.unpadded:
        return
    try:
        check_layers_supported(model)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if attention.compile:
        compile_layers(model, strict=attention.compile_strict, say=say_now, ledger=ledger, where=this_process())

