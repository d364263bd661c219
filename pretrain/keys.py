"""How a component declares the run-config keys it reads: `setting(default, doc)`, once, in its own module.

A component (the lr schedules, the checkpoint cadence, the slow-rank rule, the phase loop, ...) declares the keys
it reads as a dataclass of `setting` fields; the run config's sections (pretrain/config/sections.py) inherit
those declarations, so RUN.json, `--help` and the docs' key table (pretrain/config/doc.py) show each key where
its component declares it, and the run plan hands each component its own section: the config's instance, typed
as the component's declaration. A new key is its declaration, its check and its use in one component file.

The ground floor: it imports nothing of the project, so every floor may declare keys with it. The phase names
live here too (the loop seeds each phase apart; the config's phase sections are named by them), and run.seed,
which several components read.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DOC", "PHASE_NAMES", "SeedSection", "setting"]

DOC = "doc"  # the field metadata key of a key's documentation
PHASE_NAMES = ("phase1", "phase2")


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation (``name: type = setting(default, "what it does")``); a
    list/dict default is copied for every instance, as `field(default_factory=...)` would do.

    The text rides in the field's metadata, so `--help` and the docs table (pretrain/config/doc.py) read
    it back with `dataclasses.fields`, and a key added without a text fails tests/config/test_config_doc.py.
    """
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={DOC: doc})
    return dataclasses.field(default=default, metadata={DOC: doc})


@dataclass
class SeedSection:
    """run.seed: the one key that several components read (the plan's initial weights, the data stream's order
    and masks, the loop's dropout), so it is declared here, below all of them; RunSection inherits it."""

    seed: int = setting(12345, "seed of the initial weights, the data order, the dynamic masks and dropout")
