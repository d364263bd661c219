"""The rank-side set-up of the model's attention path and compilation, right after the model is built.

The run plan already refused what it can see without the device (pretrain/config/attention.py, also in the
launch preflight); each rank adds what needs the device: the flash kernel in this torch build, the GPU's
compute capability, the head size. A problem is a ConfigError: one line, exit 2, before the engine is built.
Then the encoder layers are compiled where the plan says so (pretrain/model/compiled.py). It takes plain
values (the phase's AttentionPlan and precision), never the run config.
"""

from __future__ import annotations

import torch

from pretrain.config.attention import PADDED_HINT, AttentionPlan
from pretrain.errors import ConfigError
from pretrain.model.bert import SparseBertForPreTraining
from pretrain.model.compiled import compile_layers
from pretrain.model.unpadded import check_layers_supported
from pretrain.model.varlen_attention import kernel_problem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def prepare_model_path(model: SparseBertForPreTraining, attention: AttentionPlan, precision: str,
                       device: torch.device) -> None:
    """Refuse an attention path this rank cannot run (one line), else compile the layers if the plan says so."""
    if not attention.unpadded:
        return
    try:
        check_layers_supported(model)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    missing = kernel_problem(device, DTYPES[precision], head_dim)
    if missing is not None:
        raise ConfigError(f"model.attention=unpadded: {missing}; {PADDED_HINT}")
    if attention.compile:
        compile_layers(model)
