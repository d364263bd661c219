"""The typed `codistill` config section (no torch import: config parsing stays light).

    "codistill": {"enabled": true, "groups": 2, "alpha": 1.0, "burn_in_steps": 400,
                  "refresh_every": 50, "temperature": 1.0, "loss": "kl",
                  "targets": ["mlm"], "disjoint_data": true, "exchange": "collective",
                  "exchange_dir": null, "group": null, "exchange_timeout_s": 1800}

Two ways to run the groups:
* one job (`group` null): the world is split into `groups` contiguous rank blocks;
* separate jobs (`group` = this job's group index, `exchange` = filesystem): each job is one group,
  possibly on other nodes or at other times, and the groups meet only in `exchange_dir` (a shared
  file system), as in Anil et al. 2018.

Step numbers (`burn_in_steps`, `refresh_every`) count optimizer steps of the whole run: phase 2
continues after phase 1's steps, like the TensorBoard x-axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.keys import setting

DISTILL_TARGETS = ("mlm", "nsp")
DISTILL_LOSSES = ("kl", "soft_ce")
EXCHANGES = ("collective", "filesystem")


def group_folder(group: int) -> str:
    """The subfolder of run.dir (and checkpoint.dir) group `group` writes in: group<g>."""
    return f"group{group}"


class CodistillConfigError(ValueError):
    """A `codistill.*` value is wrong; the message names the dotted key."""


@dataclass
class CodistillSection:
    """Codistillation: several copies of the model train at once, each also learning from the others'
    predictions (docs/codistillation.md)."""

    enabled: bool = setting(False, "train `groups` model copies that distill from each other")
    groups: int = setting(
        2,
        "model copies (>= 2); the world is split into this many contiguous, equal rank blocks",
    )
    alpha: float = setting(1.0, "weight of the distillation term")
    burn_in_steps: int = setting(0, "optimizer steps (whole run) before distillation starts")
    refresh_every: int = setting(50, "optimizer steps between teacher refreshes")
    temperature: float = setting(
        1.0,
        "softmax temperature of the teachers' targets and the student's predictions in the distillation "
        "term (> 0)",
    )
    loss: str = setting(
        "kl",
        "kl = KL(teacher || student); soft_ce = cross-entropy against the soft targets (same gradient)",
    )
    targets: list[str] = setting(["mlm"], 'what is distilled: "mlm" and optionally "nsp"')
    exchange: str = setting(
        "collective",
        "collective (all-gather over the world) | filesystem (the other groups' published weights in "
        "exchange_dir)",
    )
    exchange_dir: str | None = setting(None, "filesystem exchange folder; default <run.dir>/exchange")
    disjoint_data: bool = setting(
        True,
        "group g reads only part g of `groups` disjoint parts of the training shards",
    )
    group: int | None = setting(
        None,
        "separate jobs: this job is group `group` alone (needs exchange = filesystem); null: one job runs "
        "every group",
    )
    exchange_timeout_s: float = setting(
        1800.0,
        "separate jobs: how long a refresh waits for another group's first weights, and the end of the run "
        "for the other groups' final weights, before going on (without that teacher / with its older "
        "weights)",
    )


def check_codistill(section: CodistillSection, world_size: int | None = None) -> None:
    """Range and choice checks; with `world_size`, also that the world splits into equal groups."""
    if not section.enabled:
        return
    if section.groups < 2:
        raise CodistillConfigError(f"codistill.groups: must be >= 2 (one model is plain training), got {section.groups}")
    if section.alpha < 0:
        raise CodistillConfigError(f"codistill.alpha: must be >= 0, got {section.alpha}")
    if section.burn_in_steps < 0:
        raise CodistillConfigError(f"codistill.burn_in_steps: must be >= 0, got {section.burn_in_steps}")
    if section.refresh_every < 1:
        raise CodistillConfigError(f"codistill.refresh_every: must be >= 1, got {section.refresh_every}")
    if section.temperature <= 0:
        raise CodistillConfigError(f"codistill.temperature: must be > 0, got {section.temperature}")
    if section.loss not in DISTILL_LOSSES:
        raise CodistillConfigError(f"codistill.loss: {section.loss!r} is not one of {list(DISTILL_LOSSES)}")
    if not section.targets or "mlm" not in section.targets:
        raise CodistillConfigError(f"codistill.targets: must contain 'mlm' (optionally 'nsp'), got {section.targets}")
    unknown = [t for t in section.targets if t not in DISTILL_TARGETS]
    if unknown:
        raise CodistillConfigError(f"codistill.targets: unknown {unknown}; allowed {list(DISTILL_TARGETS)}")
    if section.exchange not in EXCHANGES:
        raise CodistillConfigError(f"codistill.exchange: {section.exchange!r} is not one of {list(EXCHANGES)}")
    if section.group is not None and not 0 <= section.group < section.groups:
        raise CodistillConfigError(f"codistill.group: must be in [0, codistill.groups={section.groups}), got {section.group}")
    if section.group is not None and section.exchange != "filesystem":
        raise CodistillConfigError(
            "codistill.exchange: groups in separate jobs (codistill.group set) can only meet through files; "
            f"set it to 'filesystem', got {section.exchange!r}"
        )
    if section.exchange_timeout_s < 0:
        raise CodistillConfigError(f"codistill.exchange_timeout_s: must be >= 0, got {section.exchange_timeout_s}")
    if section.group is None and world_size is not None and world_size % section.groups:
        raise CodistillConfigError(
            f"codistill.groups: {section.groups} groups do not split a world of {world_size} ranks into equal blocks"
        )
