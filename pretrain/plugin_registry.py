"""How the core finds a plug-in: `PluginSpec` (what a plug-in registers), `PluginRegistry` (the installed
entry points of group `bert_ds.plugins`, or the specs a caller hands in). The config loader asks it for a
section's dataclass and checks; the driver (pretrain/plugin.py `build_plugin`) for the plug-in itself.

Beside the plug-in contract (pretrain/plugin.py), below the loop that calls the hooks and the config that reads
sections with it: it imports no plug-in until a RUN.json names its section, nothing of the project but the
ground floor's types, and no torch. The run config sits above (pretrain/config/, which composes the sections the
loop's components declare), so `check` and `build` take it typed loosely (`Any`: a RunConfig).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types of the floors below only (tests/pretrain/test_import_layers.py)
    from pretrain.distributed.info import DistInfo

ENTRY_POINT_GROUP = "bert_ds.plugins"


@dataclass(frozen=True)
class PluginSpec:
    """What a plug-in registers (the entry point's object): light to import, no torch."""

    name: str  # its RUN.json section, equal to its entry-point name
    section: type  # the section's dataclass, keys declared with pretrain.keys.setting(default, doc)
    # (section, whole RunConfig) -> None; ValueError naming the dotted key (cross-section checks included)
    check: Callable[[Any, Any], None]
    # (RunConfig, world DistInfo) -> the plug-in, or None when the section turns it off. Collective.
    build: Callable[[Any, DistInfo], Any]  # a pretrain.plugin.TrainingPlugin, or None
    # (section, ranks in the job) -> the data-parallel ranks of one model (what `job_share` will say), without
    # processes: the launch-time batch check (pretrain/launch/preflight.py). None: that check leaves the batch to the ranks.
    data_parallel_size: Callable[[Any, int], int] | None = None
    # (section, rank, ranks in the job) -> the subfolder of run.dir and checkpoint.dir that rank writes in (what
    # `job_share` will say), without processes: the elastic agent names the checkpoint a rank restarts from.
    # None (or a None result): run.dir itself.
    job_subfolder: Callable[[Any, int, int], str | None] | None = None


class PluginRegistry:
    """Plug-in declarations by RUN.json section name. `PluginRegistry()` reads the installed entry points
    (each plug-in imported only when its name is asked for); `PluginRegistry(specs)` serves the given ones."""

    def __init__(self, specs: Iterable[PluginSpec] | None = None) -> None:
        self._given = None if specs is None else {spec.name: spec for spec in specs}

    def names(self) -> list[str]:
        """Names of the registered plug-ins (= their RUN.json sections), without importing any of them."""
        if self._given is not None:
            return sorted(self._given)
        return installed_plugins()

    def spec(self, name: str) -> PluginSpec:
        """The declaration registered as `name` (an installed one is imported only now). KeyError: none."""
        if self._given is not None:
            return self._given[name]
        return plugin_spec(name)

    def sections(self) -> dict[str, type]:
        """Every registered plug-in's section dataclass (imports every plug-in's spec: for --help and docs)."""
        return {name: self.spec(name).section for name in self.names()}


INSTALLED = PluginRegistry()  # the entry points of group ENTRY_POINT_GROUP


def installed_plugins() -> list[str]:
    """Names of the installed plug-ins (= their RUN.json sections), without importing any of them."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


@functools.cache
def plugin_spec(name: str) -> PluginSpec:
    """Import the plug-in registered as `name` (only then) and return its declaration."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise KeyError(f"{name}: no plug-in installed under entry-point group {ENTRY_POINT_GROUP!r}")
    spec = found[0].load()
    if not isinstance(spec, PluginSpec) or spec.name != name:
        raise TypeError(f"entry point {found[0].value!r} must be a PluginSpec named {name!r}, got {spec!r}")
    return spec


def plugin_sections() -> dict[str, type]:
    """Every installed plug-in's section dataclass (imports every plug-in's spec: for --help and docs)."""
    return INSTALLED.sections()
