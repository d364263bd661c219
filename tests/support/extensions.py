"""Extensions a test adds to a real driver run: `pretrain.train.main(argv, extensions=[...])`.

The driver has one extension mechanism, the TrainingPlugin hooks (pretrain/plugin.py); these wrap the two
things tests do with it, a function run after every step and a term added to the loss, so a script hands
over the function and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.plugin import ExtraLoss, PhaseView, TrainingPlugin


class AfterEachStep(TrainingPlugin):
    """Runs `callback(trainer)` on every rank after each optimizer step (after the config plug-in's hook)."""

    def __init__(self, callback: Callable[[Any], None]) -> None:
        self.callback = callback

    def after_step(self, trainer: PhaseView) -> None:
        self.callback(trainer)


class AddedLoss(TrainingPlugin):
    """Adds `term(output, batch, state) -> (tensor, numbers)` to every micro-batch's task loss."""

    def __init__(self, term: ExtraLoss) -> None:
        self.term = term

    def loss_term(self) -> ExtraLoss:
        return self.term


def after_each_step(*callbacks: Callable[[Any], None]) -> list[TrainingPlugin]:
    """One AfterEachStep per callback, in order."""
    return [AfterEachStep(callback) for callback in callbacks]
