"""The step monitor contract: what a step logs beyond its losses and rates, one class per concern.

Why a contract: a per-step number used to mean edits in the loop, in the trainer's metrics and in a helper
elsewhere (the gradient norm had two homes, the optimizer's numbers a third), and the trainer grew with
each. A monitor is one class in one file of pretrain/metrics/, registered once in the table of
pretrain/metrics/monitor_registry.py, which the run plan hands to the trainer (LoopPlan.monitors); the
trainer calls every monitor at the same points and knows none by name (composer's callbacks, its
OptimizerMonitor among them, are the model):

    monitor.attach(engine)          once per trainer, on the trainer's own copy (`attach_all`)
    per optimizer step:
        per micro-batch: monitor.count(host_batch, step)   numbers counted on the host copy of the batch
        backward of the last micro-batch
        monitor.before_step()       the step's averaged gradients, not yet clipped (ZeRO-0 has them here only)
        engine.step()               a monitor's hook may read what only the step sees (ZeRO partitions)
        the step's one host read    pretrain/step_stats.py
        monitor.values(result)      scalars by tag; monitor.histograms(): tensors by tag
    monitor.close()                 hooks removed (attach calls it first: one hook per monitor, ever)

A monitor sees the step through `StepContext`: how far the phase is (`Progress`, pretrain/schedules/), the
vocabulary, and in `count` each micro-batch as collated on the host. What it counts there (names declared in
`counts`) is summed where pretrain/step_stats.py sums the step's own counts and rides the step's one all-reduce,
so no monitor runs a collective of its own for data numbers; `values` reads the sums over every rank in
`result.counted`.

What each call may cost: `count` reads host tensors only (no device work at all); `before_step` and a hook queue
device work only (no host read, no collective), so a
step that is not logged pays no sync for them. `values` runs for a logged step only, on every rank (rank 0
writes; a collective there is met by every rank), after the step's host read: reading a device number then
waits for nothing the step queued.

Tags: each monitor's docstring lists what it logs after a `Tags:` line, one tag per line: the tag, when it
is logged if not always (in brackets: [cuda], [cpu], [ExactLamb], [compiled], [histogram]), then what it
is. `<name>` in a tag stands for one path part. `documented_tags` reads the list back, and
tests/metrics/test_monitors.py checks that the tags documented are the tags logged.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pretrain.data.batches import Vocab
from pretrain.schedules.progress import Progress
from pretrain.step_stats import StepResult


@dataclass(frozen=True)
class StepContext:
    """What a monitor may know of the step besides its batches: how far the phase is and the vocabulary."""

    progress: Progress | None  # None: a trainer built without the plan's schedules (a bench)
    vocab: Vocab


class StepMonitor(Protocol):
    """What the trainer calls on each monitor (module docstring); every method but `values` has a default, so a
    monitor subclasses this and writes only what it needs."""

    counts: tuple[str, ...] = ()  # the names `count` returns (every rank the same: they share the step's reduce)

    def attach(self, engine: Any) -> None:
        """Bind to the phase's engine (the model is `engine.module`); called once per trainer."""

    def count(self, host_batch: dict[str, torch.Tensor], step: StepContext) -> dict[str, float]:
        """Numbers of one micro-batch counted on its host copy (no device work), by names of `counts`."""
        return {}

    def before_step(self) -> None:
        """At the accumulation boundary, before `engine.step()`: device work only."""

    def values(self, result: StepResult) -> dict[str, float]:
        """This step's scalars by tag (a logged step; after the step's host read)."""
        ...

    def histograms(self) -> dict[str, torch.Tensor]:
        """Tensors to log as histograms for the step `values` was last called for."""
        return {}

    def close(self) -> None:
        """Remove what `attach` installed (hooks)."""


def attach_all(monitors: Iterable[StepMonitor], engine: Any) -> list[StepMonitor]:
    """A trainer's own copies of the plan's monitors, attached to its engine: two trainers of one plan (a
    benchmark's rows, a test's second trainer) never share a monitor's state or hook."""
    attached = []
    for monitor in monitors:
        mine = copy.copy(monitor)
        mine.attach(engine)
        attached.append(mine)
    return attached


@dataclass(frozen=True)
class TagDoc:
    """One tag as a monitor's docstring lists it: the tag, when it is logged (empty: always), what it is."""

    tag: str
    when: frozenset[str]
    what: str

    @property
    def pattern(self) -> re.Pattern[str]:
        """The tags this line stands for: `<name>` matches one path part."""
        return re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(self.tag)))  # re.escape leaves < > as they are


TAG_LINE = re.compile(r"^(?P<tag>\S+)\s+(?:\[(?P<when>[^\]]+)\]\s*)?(?P<what>.+)$")


def documented_tags(monitor: type | object) -> list[TagDoc]:
    """The tags a monitor's class docstring lists after its `Tags:` line (module docstring), in order."""
    cls = monitor if isinstance(monitor, type) else type(monitor)
    lines = (cls.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Tags:"), None)
    if start is None:
        return []
    found = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        match = TAG_LINE.match(line.strip())
        if match is None:
            raise ValueError(f"{cls.__name__}: a Tags: line reads `tag [when] what`, got {line.strip()!r}")
        when = frozenset(w.strip() for w in (match["when"] or "").split(",") if w.strip())
        found.append(TagDoc(match["tag"], when, match["what"]))
    return found
