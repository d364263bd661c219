"""Learning-rate schedules as pure functions of the optimizer step.

The engine wraps the multiplier in a `LambdaLR`, whose step counter DeepSpeed saves and restores
with the checkpoint, so the position in the schedule survives a resume. Each phase has its own
schedule (re-warmed in phase 2) because each phase builds its own engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.config.checks import check_schedule


@dataclass(frozen=True)
class WarmupPolyDecay:
    """Linear warmup to the base lr, then polynomial decay to 0 at `total_steps` (NVIDIA's BERT recipe).

    multiplier(step) = (step + 1) / warmup_steps                       while step < warmup_steps
                     = (1 - (step - W) / (total_steps - W)) ** power   afterwards (W = warmup_steps)

    `step` is the number of optimizer steps already applied, so step 0 trains at a small non-zero lr
    rather than wasting a step at lr 0. A callable object (not a lambda) so `LambdaLR.state_dict`
    can record its fields.
    """

    total_steps: int
    warmup_fraction: float
    power: float = 0.5

    def __post_init__(self) -> None:
        check_schedule(self.total_steps, self.warmup_fraction, self.power)

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.warmup_fraction * self.total_steps)

    def __call__(self, step: int) -> float:
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        decay_steps = self.total_steps - warmup
        progress = min(1.0, (step - warmup) / decay_steps) if decay_steps > 0 else 1.0
        return (1.0 - progress) ** self.power
