"""Every step monitor a phase runs: the one place a monitor is registered (what a monitor is:
pretrain/metrics/monitor_contract.py). The run plan calls `step_monitors` for each phase and hands the tuple to the trainer in its
LoopPlan; the trainer calls each in this order and merges their tags into the step's row.

A new per-step number: its monitor in a file of its own beside these, with its tags in its docstring, one line
here, and its test (tests/metrics/test_monitors.py checks every monitor listed here: documented = logged).
"""

from __future__ import annotations

from pretrain.metrics.compile_counters import CompileCounters
from pretrain.metrics.data_stats import DataStats
from pretrain.metrics.grad_groups import GroupGradNorms
from pretrain.metrics.grad_norm import GradNorm
from pretrain.metrics.memory import MemoryStats
from pretrain.metrics.monitor_contract import StepMonitor
from pretrain.metrics.optimizer_report import OptimizerReport
from pretrain.metrics.slow_rank_rule import SlowRankSection
from pretrain.metrics.slow_ranks import SlowRanks
from pretrain.metrics.unk_share import UnkShare


def step_monitors(seq_len: int, slow: SlowRankSection | None = None) -> tuple[StepMonitor, ...]:
    """The monitors of a phase whose rows hold `seq_len` tokens (`slow`: the run config's run section, typed as the slow-rank keys). Each logs
    nothing where it does not apply (compile counters when eager, trust ratios without ExactLamb, slow ranks on one
    rank), so the list is the same for every phase."""
    return (GradNorm(), GroupGradNorms(), OptimizerReport(), MemoryStats(), DataStats(seq_len), UnkShare(),
            CompileCounters(), SlowRanks(slow))
