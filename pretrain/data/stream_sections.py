"""The run-config keys the data stream reads (pretrain/data/batches.py `StreamPlan`), declared once, with their
checks: which part of the training instances a run reads (data.part, data.num_parts; pretrain/data/order.py deals
them) and how a micro-batch lays its instances out (phaseN.packing; pretrain/data/packing.py). The run config's
sections inherit them (pretrain/config/sections.py); the run plan hands the stream those sections.

Torch-free and apart from the stream's modules, so that reading a config loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.errors import ConfigError
from pretrain.keys import setting

__all__ = ["PackingSection", "PartSection"]


@dataclass
class PartSection:
    """data.<key>: the part of the training instances this run reads."""

    part: int = setting(
        0,
        "read only part `part` of `num_parts` disjoint, fixed parts of the training instances (validation "
        "is never split); codistillation sets it per group, a lone run can set it to match one group",
    )
    num_parts: int = setting(
        1,
        "how many disjoint parts the training instances are dealt into (the deal depends on neither the "
        "seed nor the world size); see data.part",
    )

    def check_parts(self) -> None:
        if self.num_parts < 1:
            raise ConfigError(f"data.num_parts: must be >= 1, got {self.num_parts}")
        if not 0 <= self.part < self.num_parts:
            raise ConfigError(f"data.part: must be in [0, data.num_parts={self.num_parts}), got {self.part}")


@dataclass
class PackingSection:
    """phaseN.<key>: how a micro-batch of the padded layout lays out its instances."""

    packing: bool = setting(
        False,
        "several instances per row, attention kept per instance: less padding (pretrain/data/packing.py, "
        "docs/performance.md). A layout of model.attention=padded; unpadded has no rows and no padding "
        "to pack, so there the key changes nothing (the run says so at start)",
    )
