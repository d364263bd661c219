"""The rank-side set-up of the model's attention path and compilation, right after the model is built.

The launch preflight already refused what it can see without torch (pretrain/config/attention.py); each
rank checks again (a run started without launch.sh is checked too) and adds what needs the device: the
flash kernel in this torch build, the GPU's compute capability, the head size. A problem is a ConfigError:
one line, exit 2, before the engine is built. Then the encoder layers are compiled where model.compile
says so (pretrain/model/compiled.py).
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.config.attention import PADDED_HINT, compile_enabled, setup_problem
from pretrain.config.deepspeed import precision_of
from pretrain.config.sections import ConfigError, RunConfig
from pretrain.model.bert import SparseBertForPreTraining
from pretrain.model.compiled import compile_layers
from pretrain.model.unpadded import check_layers_supported
from pretrain.model.varlen_attention import kernel_problem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def prepare_model_path(model: SparseBertForPreTraining, config: RunConfig, phase: str, ds_config: dict[str, Any],
                       device: torch.device) -> None:
    """Refuse an attention / compile setup this rank cannot run (one line), else compile if asked."""
    if config.model.attention != "unpadded":
        return
    problem = setup_problem(config, phase, ds_config, device.type)
    if problem is None:
        try:
            check_layers_supported(model)
        except ValueError as err:
            problem = str(err)
    if problem is None:
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        missing = kernel_problem(device, DTYPES[precision_of(ds_config)], head_dim)
        if missing is not None:
            problem = f"model.attention=unpadded: {missing}; {PADDED_HINT}"
    if problem is not None:
        raise ConfigError(problem)
    if compile_enabled(config, device.type):
        compile_layers(model)
