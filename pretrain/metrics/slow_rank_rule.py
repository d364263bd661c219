"""The slow-rank rule, torch-free: its keys (`SlowRankSection`, with their check), each rank's medians over a window
(`RankTimes`), the verdict every rank reaches from the same gathered medians (`judge`), and where this rank runs
(`node_name`, `spare_nodes`). The monitor that times the steps and gathers the medians is
pretrain/metrics/slow_ranks.py; this part is apart so that the run config (pretrain/config/sections.py) inherits
the keys without loading torch.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from statistics import median

from pretrain.errors import NODE_NAME_ENV, NODES_SPARE_ENV, ConfigError
from pretrain.keys import setting


@dataclass
class SlowRankSection:
    """run.<key>: when a rank counts as slow and what it then does (RunSection, pretrain/config/sections.py, inherits
    these keys; the run plan hands the monitor the config's run section, typed as this declaration)."""

    slow_rank_threshold: float = setting(
        0.20,
        "a rank whose median step time (its forward passes and its wait for data, not its wait in collectives) over "
        "a window is this much above its peers' median is named in one line and health/slowest_rank_ratio: 0.20 is "
        "20 % slower. A slow GPU (throttled, a degraded link) slows every rank of the job (docs/pretraining.md)",
    )
    slow_rank_window_steps: int = setting(
        50,
        "optimizer steps per comparison of the ranks' step times (one gather of a few numbers per window); 0: off",
    )
    evict_slow: bool = setting(
        False,
        "a rank found slow (run.slow_rank_threshold) leaves the job when the launcher has a spare node "
        "(./launch.sh pretrain --nodes MIN:MAX): every rank checkpoints and exits 5, the slow rank's line names its "
        "host, and the job restarts without it; without a spare node the rank is only named",
    )

    def check_slow_ranks(self) -> None:
        if not self.slow_rank_threshold > 0:
            raise ConfigError(f"run.slow_rank_threshold: must be > 0, got {self.slow_rank_threshold}")
        if self.slow_rank_window_steps < 0:
            raise ConfigError(f"run.slow_rank_window_steps: must be >= 0 (0: off), got {self.slow_rank_window_steps}")


def node_name() -> str:
    """This rank's node as the launcher names it (its agent's, or SLURM's), else the host name."""
    return os.environ.get(NODE_NAME_ENV) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def spare_nodes() -> int:
    """How many spare nodes the launcher's agent said it has (BERT_DS_NODES_SPARE); 0 when unset or unreadable."""
    try:
        return max(int(os.environ.get(NODES_SPARE_ENV, "0")), 0)
    except ValueError:
        return 0


@dataclass(frozen=True)
class RankTimes:
    """One rank's medians over a window, seconds per optimizer step: what the ranks gather."""

    host: str
    forward: float
    data: float
    total: float  # the median of forward + data per step (not the sum of the two medians)


@dataclass(frozen=True)
class SlowVerdict:
    """The window's slowest rank against its peers; `slow`: above the threshold."""

    rank: int
    times: RankTimes
    peers: float  # the median of the other ranks' `total`
    ratio: float
    steps: int
    slow: bool

    def line(self) -> str:
        """The one line that names a slow rank: rank, host, its time against its peers', over which steps."""
        t = self.times
        return (f"slow rank: rank {self.rank} (host {t.host}) took {t.total * 1e3:.1f} ms per step against its peers' "
                f"median {self.peers * 1e3:.1f} ms ({self.ratio:.2f}x; forward {t.forward * 1e3:.1f} ms, data wait "
                f"{t.data * 1e3:.1f} ms), the median of its last {self.steps} steps")


def judge(times: list[RankTimes], threshold: float, steps: int) -> SlowVerdict | None:
    """The slowest rank of a window from every rank's medians (the same list on every rank: the same verdict);
    None with fewer than 2 ranks or no time to compare with."""
    if len(times) < 2:
        return None
    ratios = []
    for rank, mine in enumerate(times):
        peers = median(t.total for i, t in enumerate(times) if i != rank)
        ratios.append((mine.total / peers if peers > 0 else 0.0, rank, peers))
    ratio, rank, peers = max(ratios)
    if ratio <= 0:
        return None
    return SlowVerdict(rank, times[rank], peers, ratio, steps, ratio > 1.0 + threshold)
