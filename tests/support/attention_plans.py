"""Run plans with only what `settle_attention` reads (pretrain/device_check/settle.py), and a planted wrong varlen kernel:
for the tests of the kernel self-test's verdict, in one process and across ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pretrain.config.sections import ModelSection, PhaseSection, RunSection
from pretrain.data.batches import StreamPlan
from pretrain.model.attention_plan import AttentionPlan
from pretrain.model.bert import bert_config
from pretrain.plan.run_plan import PhasePlan, RunPlan
from pretrain.trainer import LoopPlan


def across_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                    dropout: float, scale: float) -> torch.Tensor:
    """Wrong: every token attends to every token of the micro-batch (the segment bounds ignored)."""
    rows = [x.transpose(0, 1)[None] for x in (q, k, v)]
    return F.scaled_dot_product_attention(*rows, scale=scale)[0].transpose(0, 1)


@dataclass(frozen=True)
class Place:
    """The parts of a DistInfo settle_attention reads."""

    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")


def phase_stub(name: str, requested: str, unpadded: bool = True, compile_strict: bool = False) -> PhasePlan:
    """A phase plan with what settle_attention reads (the rest is not used)."""
    attention = AttentionPlan(unpadded=unpadded, compile=False, requested=requested, compile_strict=compile_strict,
                              why=f"model.attention={requested}" + (": the reference varlen kernel" if unpadded else ""))
    return PhasePlan(name=name, model_config=bert_config("tiny", 64, 64), ds_config={}, precision="fp32",
                     schedule=None, data=None, trainer=LoopPlan(phase=name),  # type: ignore[arg-type]
                     stream=StreamPlan(unpadded=unpadded), throughput=None, attention=attention,  # type: ignore[arg-type]
                     section=PhaseSection(seq_len=32), run=RunSection(), model=ModelSection())


def run_plan_stub(requested: str, compile_strict: bool = False, unpadded: bool = True) -> RunPlan:
    phases = {name: phase_stub(name, requested, unpadded, compile_strict) for name in ("phase1", "phase2")}
    return RunPlan(job=None, phases=phases, resolved={"run": {}, "resolved": {"world_size": 1}})  # type: ignore[arg-type]
