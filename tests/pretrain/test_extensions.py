"""The one extension mechanism: a caller's TrainingPlugin objects stacked on the run config's plug-in.

PluginStack (pretrain/plugin.py) is checked on plug-ins defined here; the trainer's side (start_phase
first, after_step after each step, the loss terms added) on a real one-rank DeepSpeed engine; and that
the trainer, which reads only its LoopPlan of the run config, loads no DeepSpeed on import.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.plugin import CONFIG_PLUGIN_ONLY, JobShare, PluginStack, StepAgreement, TrainingPlugin
from pretrain.trainer import PhaseTrainer
from tests.support.extensions import AddedLoss, AfterEachStep
from tests.support.paths import REPO_ROOT
from tests.support.trainer_fixtures import build_trainer


class Recorder(TrainingPlugin):
    """Appends (name, hook, phase step) for each phase-start and after-step call it gets."""

    def __init__(self, name: str, calls: list[tuple[str, str, int]]) -> None:
        self.name, self.calls = name, calls

    def start_phase(self, phase: Any) -> None:
        self.calls.append((self.name, "start_phase", phase.state.step))

    def after_step(self, trainer: Any) -> None:
        self.calls.append((self.name, "after_step", trainer.state.step))


class Configured(Recorder):
    """A run config's plug-in with a topology and a saved state of its own."""

    state_file = "configured_state.pt"

    def job_share(self) -> JobShare:
        return JobShare(rank=1, world_size=2, seed_offset=1)

    @property
    def first_rank(self) -> int:
        return 2

    def state_dict(self) -> dict[str, Any]:
        return {"mine": 1}

    def agree_on_step(self, step: StepAgreement, device: torch.device) -> tuple[StepAgreement, str | None]:
        return step, "configured"

    def export_targets(self, phase: str, source: Path, out: Path, rank: int) -> list[tuple[Path, Path]]:
        return [(source / "configured", out)]


def overriding(hook: str) -> TrainingPlugin:
    """An extension whose class overrides `hook` (a property, a method or the state file's name)."""
    default = getattr(TrainingPlugin, hook)
    if isinstance(default, property):
        member: Any = property(lambda self: None)
    elif callable(default):
        member = lambda self, *args: None  # noqa: E731 - a method body that does nothing
    else:
        member = "extension_state.pt"
    return type(f"Overrides_{hook}", (TrainingPlugin,), {hook: member})()


@pytest.mark.parametrize("hook", CONFIG_PLUGIN_ONLY)
def test_an_extension_that_overrides_a_config_plugin_hook_is_refused_by_name(hook: str) -> None:
    with pytest.raises(ValueError, match=rf"may not override {hook}\b"):
        PluginStack(TrainingPlugin(), [Recorder("fine", []), overriding(hook)])


def test_an_old_style_step_callback_is_refused() -> None:
    with pytest.raises(TypeError, match="must be a pretrain.plugin.TrainingPlugin"):
        PluginStack(TrainingPlugin(), [lambda trainer: None])  # type: ignore[list-item]


def test_the_stack_answers_topology_and_state_from_the_config_plugin_only() -> None:
    configured = Configured("config", [])
    stack = PluginStack(configured, [Recorder("probe", []), AddedLoss(lambda o, b, s: (o, {}))])
    assert stack.state_file == "configured_state.pt" and stack.state_dict() == {"mine": 1}
    assert stack.job_share() == JobShare(rank=1, world_size=2, seed_offset=1)
    assert (stack.first_rank, stack.mpu, stack.replica_group) == (2, None, None)
    step = StepAgreement(stop=False, save_due=True, aborting_here=False)
    assert stack.agree_on_step(step, torch.device("cpu")) == (step, "configured")
    assert stack.export_targets("phase1", Path("src"), Path("out"), 0) == [(Path("src/configured"), Path("out"))]
    assert stack.configured is configured


def test_loss_terms_are_summed_in_order_and_their_numbers_merged() -> None:
    def first(output: Any, batch: Any, state: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return output * 2, {"first": 1.0, "shared": 1.0}

    def second(output: Any, batch: Any, state: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return output + 3, {"second": 2.0, "shared": 2.0}

    assert PluginStack(TrainingPlugin(), [Recorder("probe", [])]).loss_term() is None
    assert PluginStack(TrainingPlugin(), [AddedLoss(first)]).loss_term() is first  # alone: used as it is
    total, numbers = PluginStack(AddedLoss(first), [AddedLoss(second)]).loss_term()(torch.tensor(1.0), {}, None)
    assert float(total) == 2.0 + 4.0
    assert numbers == {"first": 1.0, "second": 2.0, "shared": 2.0}


def test_the_trainer_calls_start_phase_first_then_after_step_and_adds_every_loss_term(tmp_path: Path) -> None:
    """A real phase of 3 steps: start_phase once, before any step and on the config's plug-in first; after_step
    after every step, in stack order; both added terms reach every micro-batch (their numbers are logged);
    and the loop runs with its job taken away (it reads its LoopPlan, built by the run plan)."""
    built = build_trainer(tmp_path, steps=3)
    calls: list[tuple[str, str, int]] = []
    views: list[Any] = []
    terms: list[int] = []

    def term(name: str, value: float):  # noqa: ANN202 - an ExtraLoss
        def added(output: Any, batch: Any, state: Any) -> tuple[torch.Tensor, dict[str, float]]:
            terms.append(state.step)
            return output.loss.new_zeros(()), {f"probe/{name}": value}
        return added

    class PhaseStartView(TrainingPlugin):
        def start_phase(self, phase: Any) -> None:
            views.append((phase.state.step, type(phase.engine.module.config).__name__, phase.held_out_batches()))

    after = AfterEachStep(lambda trainer: calls.append(("function", "after_step", trainer.state.step)))
    stack = PluginStack(Recorder("config", calls), [Recorder("probe", calls), PhaseStartView(), after,
                                                   AddedLoss(term("a", 1.0)), AddedLoss(term("b", 2.0))])
    job = dataclasses.replace(built.job, plugin=stack)
    trainer = PhaseTrainer(job, built.settings, built.engine, built.train_batches, built.val_batches,
                           built.throughput, built.state)
    assert trainer.settings is built.settings  # the plan's, handed in whole
    assert (trainer.settings.phase, trainer.settings.steps) == ("phase1", 3)
    values = trainer.train_step()
    assert (values.values["probe/a"], values.values["probe/b"]) == (1.0, 2.0)
    trainer.state.step += 1  # as the loop does

    trainer.job = None  # type: ignore[assignment]  # the loop must not need it (and the trainer has no config)
    assert trainer.train() == "complete"
    assert calls == [("config", "start_phase", 1), ("probe", "start_phase", 1),
                     ("config", "after_step", 2), ("probe", "after_step", 2), ("function", "after_step", 2),
                     ("config", "after_step", 3), ("probe", "after_step", 3), ("function", "after_step", 3)]
    assert len(views) == 1 and views[0][:2] == (1, "BertConfig") and views[0][2] is not None
    accumulation = trainer.accumulation
    assert terms == [step for step in range(3) for _ in range(2 * accumulation)]  # both terms, every micro-batch


def test_importing_the_trainer_loads_no_deepspeed() -> None:
    code = "import sys, pretrain.trainer; print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_every_hook_is_in_the_contracts_loop_and_in_the_architecture_table() -> None:
    """The contract's docstring writes the hooks once, as the loop they sit in: every hook is called there."""
    hooks = sorted(name for name in vars(TrainingPlugin) if not name.startswith("_") and name != "state_file")
    assert {"start_phase", "after_step", "loss_term", "agree_on_step"} <= set(hooks)
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text[text.index("## The plug-in hooks"):text.index("## Choices")]
    loop = TrainingPlugin.__doc__.split("for phase in plan.phases:")
    assert len(loop) == 2, "the contract's docstring writes its loop once"
    assert [h for h in hooks if f"plugin.{h}" not in TrainingPlugin.__doc__] == []
    assert [h for h in hooks if f"`{h}" not in table] == []
