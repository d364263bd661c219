"""The rank-side set-up of the model's attention path and compilation, right after the model is built.

The run plan already chose the path by the device's facts and the kernel self-test (pretrain/config/attention.py,
pretrain/plan/run_plan.py `settle_attention`), refusing what cannot run in one line. What is left is the model's own
check (no decoder BERT on the unpadded path) and compiling the encoder layers where the plan says so
(pretrain/model/compiled.py): strictly under an explicit model.compile=true (a failed compile is a ConfigError),
else with an eager fallback and one line. It takes plain values (the phase's AttentionPlan), never the run config,
and, where the caller has one, the process's CompileLedger: one for all phases, so compile/recompiles counts over
the process and a fallback is said once and holds for later phases (pretrain/model/compiled.py).
"""

from __future__ import annotations

from pretrain.errors import ConfigError
from pretrain.model.attention_plan import AttentionPlan
from pretrain.model.bert import SparseBertForPreTraining
from pretrain.model.compiled import CompileLedger, compile_layers
from pretrain.model.unpadded import check_layers_supported


def quiet(_line: str) -> None:
    """What a rank other than 0 does with a line meant for the console."""


def prepare_model_path(model: SparseBertForPreTraining, attention: AttentionPlan, announce: bool = True,
                       ledger: CompileLedger | None = None) -> None:
    """Refuse an attention path this model cannot run (one line), else compile the layers if the plan says so.
    `announce`: this rank prints the compile fallback's line (rank 0). `ledger`: the process's (None: this phase's
    own, counted from 0)."""
    if not attention.unpadded:
        return
    try:
        check_layers_supported(model)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if attention.compile:
        compile_layers(model, strict=attention.compile_strict, say=print if announce else quiet, ledger=ledger)

