"""Codistillation (Anil et al. 2018) as a plug-in of the pretraining driver: `"codistill": {"enabled": true}`.

The world is split into `groups` contiguous rank blocks (see groups.py). Each group is an
ordinary run of the single-model driver with its own view of the job:

    run.seed        = run.seed + g         (initial weights, dropout, masks, data order)
    data.part       = g of `groups` parts  (disjoint training data; `disjoint_data: false` shares it all)
    run.dir         = <run.dir>/group<g>   (TensorBoard, resolved config, exports, final numbers)
    checkpoint.dir  = <checkpoint.dir>/group<g>   (default <run.dir>/group<g>/checkpoints)
    rank/world size = position in the group / group size (data sharding, per-rank seeds, batch arithmetic)

so a group with `alpha = 0` is bit-for-bit the single-model run with seed `run.seed + g` and
`data.part = g, data.num_parts = groups` on `group size` ranks. The groups share one job (the world
split into rank blocks), or run as separate jobs (`codistill.group`, files only: exchange.py).
Each rank also holds frozen teachers (the other groups' models) and adds

    alpha * T^2 * D(mean_teachers softmax(z_t / T), softmax(z / T))      at masked positions (+ NSP)

to its task loss from global step `burn_in_steps` on. Teachers are refreshed at the global steps
burn_in + k * refresh_every (and when a phase starts after the burn-in); the teacher used at step
s is therefore the other groups' weights after the last refresh step <= s.

The driver sees it only through the TrainingPlugin hooks (pretrain/plugin.py; registered in spec.py),
each handing it data: `job_share` (the group's view), `mpu` for the engine, `replica_group` for the
trainer's statistics, `first_rank` for initial weights, `start_phase` when the trainer starts a phase
(the engine and a resume exist), `loss_term` (the distillation term), `after_step` (refreshes, final evaluation),
`agree_on_step` (stops, time-due checkpoints and NaN aborts common to every group), `state_dict` /
`load_state_dict` (the teachers, saved by the core's checkpointing in `codistill_teachers.pt` of every
tag) and `export_targets` (world rank 0 exports every group).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_prep.shard_format.atomic_io import atomic_write_json
from pretrain.codistill.config import CodistillSection, check_codistill, group_folder
from pretrain.codistill.exchange import FileExchange, GroupComm
from pretrain.codistill.groups import GroupLayout, ProcessGroups, create_process_groups
from pretrain.codistill.teacher import (
    collective_refresh,
    distillation_loss,
    engine_dtype,
    flat_weights,
    load_flat,
    make_teacher,
    soft_targets,
)
from pretrain.data.loader import model_inputs
from pretrain.distributed.info import DistInfo
from pretrain.errors import ConfigError
from pretrain.model.bert import IGNORE_INDEX, masked_lm_loss_sum, trains_nsp
from pretrain.plugin import ExtraLoss, JobShare, PhaseView, StepAgreement, TrainingPlugin
from pretrain.run_folder import CHECKPOINTS, EXCHANGE, export_dir
from pretrain.step_stats import host_values_to_device

if TYPE_CHECKING:
    from pretrain.config.sections import RunConfig
    from pretrain.model.bert import PretrainingOutput
    from pretrain.phase_state import PhaseState

TEACHERS_FILE = "codistill_teachers.pt"
FINAL_FILE = "codistill_final.json"


class Codistillation(TrainingPlugin):
    state_file = TEACHERS_FILE  # the teachers, saved with every checkpoint of the group (exact resume)

    def __init__(self, config: RunConfig, world: DistInfo) -> None:
        """Collective: every rank constructs it at the same point (it creates the process groups)."""
        self.section: CodistillSection = config.plugins["codistill"]
        check_codistill(self.section, world.world_size)
        self.base_config, self.world = config, world
        self.layout = GroupLayout(world.world_size, self.section.groups, world.rank, job_group=self.section.group)
        self.groups: ProcessGroups = create_process_groups(
            self.layout, timedelta(minutes=config.run.dist_timeout_minutes))
        self.exchange_dir = Path(self.section.exchange_dir or Path(config.run.dir) / EXCHANGE)
        comm = GroupComm(self.layout.group_size, self.layout.first_rank, self.groups.data_parallel, world.device)
        self.files = FileExchange(self.exchange_dir, self.layout.group, self.layout.other_groups, comm,
                                  is_first=self.layout.group_rank == 0)
        self.teachers: dict[int, torch.nn.Module] = {}  # other group index -> frozen model
        self.refreshed_at: int | None = None  # global step of the last refresh
        self.teacher_steps: dict[int, int] = {}  # other group -> global step its teacher's weights are from
        self.refresh_log: list[int] = []  # refresh steps of this process (tests, logs)
        self.final: dict[str, float] | None = None
        self._engine: Any = None
        self._pending: dict[str, Any] | None = None  # teachers read from a checkpoint before they exist

    # ------------------------------------------------------------------ the group's view of the run
    @property
    def mpu(self) -> Any:
        return self.groups.mpu

    @property
    def replica_group(self) -> Any:
        """This group's ranks (the model's data-parallel replicas); None in separate jobs: the world."""
        return self.groups.data_parallel

    @property
    def first_rank(self) -> int:
        return self.layout.first_rank

    def job_share(self) -> JobShare:
        """Group g: seed + g, <run.dir>/group<g> (and <checkpoint.dir>/group<g>), data part g of `groups`."""
        g = self.layout.group
        return JobShare(rank=self.layout.group_rank, world_size=self.layout.group_size, seed_offset=g,
                        subfolder=group_folder(g),
                        data_part=(g, self.layout.groups) if self.section.disjoint_data else None)

    def agree_on_step(self, step: StepAgreement, device: torch.device) -> tuple[StepAgreement, str | None]:
        """Groups of one job stop and save at the same step, for a signal, a time-due checkpoint or another
        group's NaN abort: checkpoint saves and refreshes are world collectives. One world all-reduce, one
        host read. (`replica_group` is None in separate jobs: nothing to agree.)"""
        if self.replica_group is None or not dist.is_initialized():
            return step, None
        flags = host_values_to_device([float(step.stop), float(step.save_due), float(step.aborting_here)], device)
        dist.all_reduce(flags)
        stop_anywhere, save_anywhere, abort_anywhere = (value > 0 for value in flags.tolist())
        agreed = StepAgreement(stop=stop_anywhere, save_due=save_anywhere, aborting_here=step.aborting_here)
        if not abort_anywhere or step.aborting_here:  # no abort, or this group's own (the trainer reports that one)
            return agreed, None
        limit = self.base_config.failures.max_consecutive_nonfinite
        return agreed, (f"another codistillation group had failures.max_consecutive_nonfinite={limit} "
                        "NaN/inf steps in a row; all groups stop together")

    def group_run_dir(self, group: int) -> Path:
        return Path(self.base_config.run.dir) / group_folder(group)

    def group_checkpoint_dir(self, group: int) -> Path:
        if self.base_config.checkpoint.dir:
            return Path(self.base_config.checkpoint.dir) / group_folder(group)
        return self.group_run_dir(group) / CHECKPOINTS

    def export_targets(self, phase: str, source: Path, out: Path, rank: int) -> list[tuple[Path, Path]]:
        """Every group's phase-end model as a Hugging Face folder at <run.dir>/group<g>/export/<phase>.

        transformers 5 `save_pretrained` writes nothing on a torch.distributed rank other than 0, so world
        rank 0 exports every group of this job (after the collective phase-end save, all folders are complete),
        each from its group's checkpoint folder: `source`, `out` and the group `rank` name only this group's.
        """
        if self.world.rank != 0:
            return []
        return [(self.group_checkpoint_dir(group), export_dir(self.group_run_dir(group), phase))
                for group in self.layout.groups_in_job]

    # ------------------------------------------------------------------ schedule
    def global_step(self, phase: str, step: int) -> int:
        return step + (self.base_config.phase1.steps if phase == "phase2" else 0)

    def is_refresh_step(self, global_step: int) -> bool:
        since = global_step - self.section.burn_in_steps
        return since >= 0 and since % self.section.refresh_every == 0

    # ------------------------------------------------------------------ teachers
    def start_phase(self, phase: PhaseView) -> None:
        """After the engine exists (and a resume loaded): build teachers, refresh when a phase starts."""
        engine, state = phase.engine, phase.state
        self._engine = engine
        if "nsp" in self.section.targets and not trains_nsp(engine.module.config):
            raise ConfigError("codistill.targets: 'nsp' needs shards of sentence pairs (data_prep --segments "
                              "nsp); these train MLM alone: distill 'mlm' only")
        if not self.teachers:
            dtype, model_config = engine_dtype(engine), engine.module.config  # the BertConfig the model was built from
            self.teachers = {h: make_teacher(model_config, self.world.device, dtype) for h in self.layout.other_groups}
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
        step = self.global_step(state.phase, state.step)
        if step >= self.section.burn_in_steps and (state.step == 0 or self.refreshed_at is None):
            self.refresh(step)

    @property
    def teacher_step(self) -> int | None:
        """The oldest teacher's step; None until every teacher has weights (no distillation before)."""
        if not self.teachers or set(self.teacher_steps) != set(self.teachers):
            return None
        return min(self.teacher_steps.values())

    def refresh(self, global_step: int, final: bool = False) -> None:
        """Collective over this job: every rank refreshes at the same global step."""
        if self.section.exchange == "collective":
            collective_refresh(self._engine, self.teachers, self.groups.exchange, self.layout.group,
                               self.layout.groups)
            self.teacher_steps = dict.fromkeys(self.teachers, global_step)
        else:
            self._refresh_from_files(global_step, final)
        self.refreshed_at = global_step
        if not self.refresh_log or self.refresh_log[-1] != global_step:
            self.refresh_log.append(global_step)

    def _refresh_from_files(self, global_step: int, final: bool) -> None:
        self.files.publish(global_step, flat_weights(self._engine))  # a collective in the group under ZeRO-3
        if not self.layout.separate_jobs:
            dist.barrier()  # every group of this job has published this very step
            self.teacher_steps.update(self.files.fetch(self.teachers, load_flat))
            missing = [h for h in self.teachers if self.teacher_steps.get(h) != global_step]
            if missing:
                raise FileNotFoundError(f"{self.exchange_dir}: groups {missing} did not publish step {global_step}")
            return
        # Separate jobs: wait (bounded) for a group that has never published, and at the end for the others'
        # final weights; otherwise take whatever each group published last.
        need = {h: global_step if final else 0 for h in self.teachers if final or h not in self.teacher_steps}
        if need and not self.files.wait(need, self.section.exchange_timeout_s) and self.layout.group_rank == 0:
            late = {h: str(self.files.folder(h)) for h in need}
            print(f"codistill: group {self.layout.group} at step {global_step}: after "
                  f"{self.section.exchange_timeout_s:.0f} s (codistill.exchange_timeout_s) groups {late} have not "
                  f"published {'their final weights' if final else 'any weights'}; going on with what there is",
                  flush=True)
        self.teacher_steps.update(self.files.fetch(self.teachers, load_flat))

    def state_dict(self) -> dict[str, Any]:
        """The teachers and their refresh steps (what an exact resume needs), as CPU tensors."""
        flat = {h: torch.cat([p.detach().reshape(-1) for p in t.parameters()]).cpu() for h, t in self.teachers.items()}
        return {"refreshed_at": self.refreshed_at, "teacher_step": self.teacher_step,
                "teacher_steps": dict(self.teacher_steps), "teachers": flat}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.teachers:
            self._restore(state)
        else:
            self._pending = state

    def _restore(self, state: dict[str, Any]) -> None:
        self.refreshed_at = state["refreshed_at"]
        self.teacher_steps = {int(h): int(step) for h, step in state["teacher_steps"].items()}
        for h, flat in state["teachers"].items():
            teacher = self.teachers[int(h)]
            param = next(teacher.parameters())
            load_flat(teacher, flat.to(device=param.device, dtype=param.dtype))

    # ------------------------------------------------------------------ loss (the `loss_term` hook)
    def distillation_term(
        self, output: PretrainingOutput, batch: dict[str, torch.Tensor], state: PhaseState
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        step = self.global_step(state.phase, state.step)
        zero = output.loss.new_zeros(())
        if step < self.section.burn_in_steps or self.teacher_step is None:
            return zero, {"codistill/distill_loss": 0.0, "codistill/active": 0.0}
        temperature, kind = self.section.temperature, self.section.loss
        with torch.no_grad():
            teacher_outputs = [teacher(**batch) for teacher in self.teachers.values()]
            mlm_targets = soft_targets([t.mlm_logits for t in teacher_outputs], temperature)
        labelled = output.mlm_mask  # every slot has logits; only the labelled ones are distilled
        mlm = distillation_loss(output.mlm_logits, mlm_targets, temperature, kind, valid=labelled)
        total = mlm
        numbers: dict[str, Any] = {"codistill/distill_mlm": mlm.detach()}
        if "nsp" in self.section.targets:
            with torch.no_grad():
                nsp_targets = soft_targets([t.nsp_logits for t in teacher_outputs], temperature)
            valid = batch["next_sentence_label"].reshape(-1) != IGNORE_INDEX  # packed rows pad NSP slots
            nsp = distillation_loss(output.nsp_logits, nsp_targets, temperature, kind, valid=valid)
            total = total + nsp
            numbers["codistill/distill_nsp"] = nsp.detach()
        agrees = (output.mlm_logits.detach().argmax(-1) == mlm_targets.argmax(-1)) & labelled
        agreement = agrees.sum().double() / labelled.sum().clamp_min(1)
        numbers.update({
            "codistill/distill_loss": total.detach(),
            "codistill/active": 1.0,
            "codistill/agreement": agreement,
            "codistill/teacher_age": float(step - self.teacher_step),
        })
        # alpha = 0 keeps the task loss tensor untouched: the group then trains exactly like a lone run.
        term = self.section.alpha * total if self.section.alpha > 0 else zero
        return term, numbers

    def loss_term(self) -> ExtraLoss:
        return self.distillation_term

    # ------------------------------------------------------------------ step hook
    def after_step(self, trainer: PhaseView) -> None:
        state = trainer.state
        step = self.global_step(state.phase, state.step)
        if state.step < trainer.settings.steps and self.is_refresh_step(step):
            self.refresh(step)
        if state.step == trainer.settings.steps and state.phase == self.base_config.run.phases[-1]:
            self.final_evaluation(trainer, step)

    @torch.no_grad()
    def final_evaluation(self, trainer: PhaseView, step: int) -> dict[str, float]:
        """Every model's and the ensemble's validation MLM loss, and the prediction churn between models."""
        if self.refreshed_at != step or self.layout.separate_jobs:
            self.refresh(step, final=True)  # the teachers become the other groups' final models
        values: dict[str, float] = {}
        held_out = trainer.held_out_batches()  # the trainer's own held-out instances
        if held_out is not None:
            values = self._evaluate(trainer.engine, held_out)
            trainer.metrics.scalars(trainer.global_step, values)
        if self.layout.group_rank == 0:
            report = {"group": self.layout.group, "global_step": step, "teacher_steps": self.teacher_steps, **values}
            atomic_write_json(self.group_run_dir(self.layout.group) / FINAL_FILE, report)  # the job's run.dir
        self.final = values
        return values

    def _evaluate(self, engine: Any, held_out: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        device = self.world.device
        engine.eval()
        # own nll, ensemble nll, teachers' nll, disagreements with the teachers, masked positions
        sums = torch.zeros(5, dtype=torch.float64, device=device)
        for batch in held_out:
            batch = model_inputs(batch, device)  # tensors to the device; an unpadded max_seqlen stays
            own = engine(**batch)
            # every slot has logits; only labelled ones count (empty slots: IGNORE_INDEX, masked out)
            labels, labelled = own.mlm_labels, own.mlm_mask
            others = [teacher(**batch).mlm_logits.float() for teacher in self.teachers.values()]
            probs = [F.softmax(own.mlm_logits.float(), -1), *(F.softmax(t, -1) for t in others)]
            ensemble = torch.stack(probs).mean(0)
            picked = ensemble.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            ensemble_nll = torch.where(labelled, -torch.log(picked.clamp_min(1e-30)), torch.zeros_like(picked))
            own_top = own.mlm_logits.argmax(-1)
            sums += torch.stack([
                masked_lm_loss_sum(own.mlm_logits, labels).double(),
                ensemble_nll.sum().double(),
                sum(masked_lm_loss_sum(t, labels) for t in others).double() / len(others),
                sum(((own_top != t.argmax(-1)) & labelled).sum() for t in others).double() / len(others),
                labelled.sum().double(),
            ])
        engine.train()
        if self.layout.group_size > 1:
            dist.all_reduce(sums, group=self.replica_group)
        own_nll, ensemble_nll, teacher_nll, disagreements, n = sums.tolist()
        n = max(n, 1.0)
        return {
            "codistill/final_val_mlm_loss": own_nll / n,
            "codistill/final_teachers_val_mlm_loss": teacher_nll / n,
            "codistill/final_ensemble_val_mlm_loss": ensemble_nll / n,
            "codistill/final_churn": disagreements / n,
        }
