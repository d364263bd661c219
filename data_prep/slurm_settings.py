"""What `build --slurm` asks SLURM for, per stage: CPUs, memory and a time limit for each job of a stage, and how
many elements of one array run at once. Typed and checked here, so that a bad value is one line before anything
is submitted, not a job that SLURM refuses (or that runs out of memory) hours in.

Stages (the jobs of data_prep/slurm_arrays.py): corpus, instances, scatter, gather, merge. Defaults: a corpus
element takes --workers CPUs (it runs that many corpus tasks at once), every other job one (the merge only
writes the manifest once every element succeeded); memory and time are SLURM's defaults (the partition's)
unless given; arrays run unthrottled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from data_prep.config import ConfigError

STAGES = ("corpus", "instances", "scatter", "gather", "merge")
WIDE_STAGES = ("corpus",)  # the stages that run --workers tasks at once by default
_MEM = re.compile(r"^[1-9][0-9]*[KMGT]?$")  # sbatch --mem: an integer, megabytes unless K/M/G/T
_TIME = re.compile(r"^([0-9]+-)?[0-9]+(:[0-9]{1,2}){0,2}$")  # sbatch --time: [days-]hours[:minutes[:seconds]] etc.


@dataclass(frozen=True)
class SlurmSettings:
    """`--array-throttle N` (None: no %N), `--stage-cpus/--stage-mem/--stage-time STAGE=VALUE` (repeatable)."""

    array_throttle: int | None = None
    stage_cpus: dict[str, int] = field(default_factory=dict)
    stage_mem: dict[str, str] = field(default_factory=dict)
    stage_time: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.array_throttle is not None and self.array_throttle < 1:
            raise ConfigError(f"--array-throttle {self.array_throttle}: must be at least 1")
        for flag, values in (("--stage-cpus", self.stage_cpus), ("--stage-mem", self.stage_mem),
                             ("--stage-time", self.stage_time)):
            for stage in values:
                if stage not in STAGES:
                    raise ConfigError(f"{flag} {stage}=...: unknown stage; expected one of {', '.join(STAGES)}")
        for stage, cpus in self.stage_cpus.items():
            if cpus < 1:
                raise ConfigError(f"--stage-cpus {stage}={cpus}: must be at least 1")
        for stage, mem in self.stage_mem.items():
            if not _MEM.match(mem):
                raise ConfigError(f"--stage-mem {stage}={mem}: expected a size such as 4000, 16G or 512M")
        for stage, limit in self.stage_time.items():
            if not _TIME.match(limit):
                raise ConfigError(f"--stage-time {stage}={limit}: expected a SLURM time such as 90, 2:00:00 or "
                                  "1-12:00:00")

    @classmethod
    def parse(cls, array_throttle: int | None, cpus: list[str], mem: list[str], time: list[str]) -> SlurmSettings:
        """From the command line's STAGE=VALUE strings (a later one for the same stage wins)."""
        return cls(array_throttle, {k: _int("--stage-cpus", k, v) for k, v in _pairs("--stage-cpus", cpus)},
                   dict(_pairs("--stage-mem", mem)), dict(_pairs("--stage-time", time)))

    def cpus(self, stage: str, workers: int) -> int:
        return self.stage_cpus.get(stage, workers if stage in WIDE_STAGES else 1)

    def limits(self, stage: str) -> list[str]:
        """The #SBATCH lines of the stage's memory and time limit (none: the partition's defaults)."""
        lines = [f"#SBATCH --mem={self.stage_mem[stage]}"] if stage in self.stage_mem else []
        return lines + ([f"#SBATCH --time={self.stage_time[stage]}"] if stage in self.stage_time else [])

    def throttle_suffix(self) -> str:
        """`%N` after an --array value: at most N elements of the array run at once."""
        return f"%{self.array_throttle}" if self.array_throttle else ""


def _pairs(flag: str, values: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        stage, sep, setting = value.partition("=")
        if not sep or not stage or not setting:
            raise ConfigError(f"{flag} {value}: expected STAGE=VALUE (stages: {', '.join(STAGES)})")
        pairs.append((stage, setting))
    return pairs


def _int(flag: str, stage: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} {stage}={value}: expected an integer") from None
