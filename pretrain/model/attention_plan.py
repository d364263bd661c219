"""A phase's attention path as the run plan decided it: the value the model, the collator and the trainer read.

Beside the model code that reads it (pretrain/model/setup.py), so the model imports nothing of the config; the
choice itself, which reads the run config and the device's facts, is pretrain/config/attention.py's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionPlan:
    """A phase's attention path, as the run plan decided it (pretrain/plan/run_plan.py): what the collator lays out,
    what the model runs and whether its layers are compiled. `note`: a line rank 0 says at the phase's start."""

    unpadded: bool
    compile: bool
    note: str | None = None
    requested: str = "unpadded"  # model.attention as configured: auto | unpadded | padded
    why: str = ""  # why this path, in words (the launch line, config.resolved.json)
    compile_strict: bool = False  # model.compile=true: a failed compile is refused, not an eager fallback

    @property
    def path(self) -> str:
        return "unpadded" if self.unpadded else "padded"
