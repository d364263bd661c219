"""What the core reads off a built DeepSpeed engine without importing DeepSpeed (pretrain/engine.py builds it).

The trainer runs on any object with the engine's methods; it needs DeepSpeed's classes for nothing, so
`import pretrain.trainer` loads no DeepSpeed (tests/pretrain/test_extensions.py checks it).
"""

from __future__ import annotations

from typing import Any

import torch


def client_optimizer(engine: Any) -> torch.optim.Optimizer:
    """Our ExactLamb (or the torch optimizer DeepSpeed built) behind the engine's ZeRO/fp16 wrappers."""
    optimizer = getattr(engine, "basic_optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"engine has no client torch optimizer (found {type(optimizer).__name__})")
    return optimizer
