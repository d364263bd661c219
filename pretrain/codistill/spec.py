"""How codistillation registers with the core: the `codistill` section, its checks and its factory.

The entry point `bert_ds.plugins: codistill` (pyproject.toml) names `SPEC`. The config loader imports
this module only when a RUN.json has a `codistill` section; it stays light (no torch) so reading such
a config is as fast as a plain one, and the heavy plug-in (process groups, teachers) is imported only
when a run switches it on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pretrain.codistill.config import CodistillConfigError, CodistillSection, check_codistill, group_folder
from pretrain.plugin import TrainingPlugin
from pretrain.plugin_registry import PluginSpec

if TYPE_CHECKING:
    from pretrain.config.sections import RunConfig
    from pretrain.distributed.info import DistInfo

NAME = "codistill"


def check(section: CodistillSection, config: RunConfig) -> None:
    """The section's ranges and choices, and that codistillation alone deals the data into parts."""
    check_codistill(section)
    if section.enabled and section.disjoint_data and config.data.num_parts != 1:
        raise CodistillConfigError(
            f"data.num_parts: codistillation deals the data into one part per group (codistill.disjoint_data); "
            f"leave data.part/num_parts unset, got num_parts={config.data.num_parts}"
        )


def data_parallel_size(section: CodistillSection, world_size: int) -> int:
    """The ranks one model's batch is split over in a job of `world_size` ranks (what the plug-in's
    `job_share` will report): the whole job when each group runs as its own job (`codistill.group`),
    else one of `groups` equal blocks. Lets the launch-time check do the batch arithmetic without processes."""
    if not section.enabled or section.group is not None:
        return world_size
    if section.groups < 1 or world_size % section.groups:
        raise CodistillConfigError(f"codistill.groups: {section.groups} groups do not split a world of {world_size} "
                                   "ranks into equal blocks")
    return world_size // section.groups


def job_subfolder(section: CodistillSection, rank: int, world_size: int) -> str | None:
    """The folder rank `rank` of a job of `world_size` ranks writes in (what `job_share` will say), without processes:
    its group's. The elastic agent names the checkpoint that rank restarts from with it."""
    if not section.enabled:
        return None
    return group_folder(section.group if section.group is not None else rank // data_parallel_size(section, world_size))


def build(config: RunConfig, dist_info: DistInfo) -> TrainingPlugin | None:
    """Collective when enabled (it creates the groups' process groups); None when `enabled` is false."""
    if not config.plugins[NAME].enabled:
        return None
    # deferred: the plug-in's torch code loads only when a run enables it; reading its spec stays light
    from pretrain.codistill.codistillation import Codistillation

    return Codistillation(config, dist_info)


SPEC = PluginSpec(name=NAME, section=CodistillSection, check=check, build=build,
                  data_parallel_size=data_parallel_size, job_subfolder=job_subfolder)
