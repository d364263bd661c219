"""One run, any number of ranks: the world-size-invariant data stream, elastic resume, damaged checkpoints.

Four launches of tests/scripts/elastic_scenarios.py (real DeepSpeed CPU ranks, tiny BERT, dropout 0,
global batch 16, our LAMB), each running several `pretrain.train.main` calls:

    2 ranks   inv2: 24 steps, ZeRO-2, micro 8 x 1 accumulation (checkpoints at 8, 16, 24);
              src_{z0,z1,z3,bf16}: 2 steps, then stop (ZeRO-0/1/3 fp32, bf16 ZeRO-1 = BF16_Optimizer)
    1 rank    inv1: the same 24 steps as micro 4 x 4;  e21_*: resume those checkpoints on 1 rank
    4 ranks   inv4: micro 2 x 2;  e24_*: resume them on 4 ranks (they write the 4-rank checkpoints);
              co4: codistillation, 2 groups x 2 ranks, 2 steps
    2 ranks   e42_*: resume the 4-rank checkpoints on 2 ranks; co42: the codistillation groups on 1 rank each;
              d_*: a truncated / a missing file in the newest checkpoint, and no intact checkpoint at all
(the 1- and 4-rank launches run at the same time). z2 resumes continue to step 24 and their losses are
compared with the uninterrupted 2-rank run; every resume compares the whole training state snapshotted
before the stop (N ranks) with the one restored (M ranks): max abs difference 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpointing.checkpoint import consolidated_state_dict
from pretrain.checkpointing.layout import CONSOLIDATED
from pretrain.checkpointing.safe_load import load_data
from tests.support.launching import finish_ranks, start_ranks
from tests.support.paths import SCRIPTS
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

SCRIPT = SCRIPTS / "elastic_scenarios.py"
KINDS = {"z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False), "bf16": (1, True)}
MICRO = {1: 4, 2: 8, 4: 2}  # global batch 16 on 1, 2, 4 ranks: 4 x 4, 8 x 1, 2 x 2 (micro x accumulation)
STEPS, EVERY = 24, 8
LOSS_TOLERANCE = 5e-6  # absolute, on losses of ~3.9; measured: <= 4e-7 (printed by the tests, run with -s)
pytestmark = pytest.mark.multirank


def write_config(work: Path, shards: Path, name: str, kind: str, codistill: bool = False) -> Path:
    stage, bf16 = KINDS[kind]
    path = tiny_run_config(work / f"{name}.json", shards, work / name, phase1=STEPS)
    config = json.loads(path.read_text())
    config["run"]["phases"] = ["phase1"]
    config["model"]["overrides"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    config["checkpoint"] = {"every_steps": EVERY, "keep_last": 3, "export_at_phase_end": False}
    config["logging"] = {"progress_bar": False, "val_every_steps": EVERY, "val_instances": 16, "peak_tflops": 1.0}
    # global batch 16 with the accumulation derived for each world size; the micro batch per launch (entry)
    config["phase1"].update(batch_size=16, gradient_accumulation_steps=None)
    # a masking rate that moves every step (0.30 -> 0.15): the resumes below land in its middle, on other worlds
    config["data"]["mask_probability"] = 0.3
    config["phase1"].update(masking_schedule="linear", mask_rate_end=0.15)
    ds: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if bf16:
        config["run"]["precision"] = "bf16"
        ds.update(data_types={"grad_accum_dtype": "fp32"})
    config["phase1"]["ds_overrides"] = ds
    if codistill:
        config["codistill"] = {"enabled": True, "groups": 2, "alpha": 1.0, "burn_in_steps": 1, "refresh_every": 1}
    path.write_text(json.dumps(config, indent=2))
    return path


def clone(work: Path, source: str, name: str, tag_step: int) -> Path:
    """A copy of run `source` as run `name`, its checkpoints cut back to the tag of `tag_step` (a run that
    stopped there), every model's folder (codistillation: one per group)."""
    config = json.loads((work / f"{source}.json").read_text())
    config["run"]["dir"] = str(work / name)
    shutil.copytree(work / source, work / name, ignore=shutil.ignore_patterns("tensorboard", "snapshot_*"))
    for latest in (work / name).rglob("latest"):
        tag = f"phase1-step{tag_step:07d}"
        for folder in latest.parent.glob("phase1-step*"):
            if int(folder.name.split("step")[1]) > tag_step:
                shutil.rmtree(folder)
        latest.write_text(tag)
    (work / f"{name}.json").write_text(json.dumps(config, indent=2))
    return work / f"{name}.json"


def entry(work: Path, name: str, ranks: int, stop: int | None = None, **extra: Any) -> dict[str, Any]:
    overrides = [f"--phase1.micro_batch_size={MICRO[ranks]}"]
    if stop:
        overrides.append(f"--run.stop_after_steps={stop}")
    return {"name": name, "config": str(work / f"{name}.json"), "overrides": overrides, **extra}


def launch(work: Path, label: str, ranks: int, plan: list[dict[str, Any]]) -> Any:
    (work / f"{label}.json").write_text(json.dumps(plan))
    return start_ranks(SCRIPT, [str(work / f"{label}.json")], num_ranks=ranks)


def finish(work: Path, label: str, proc: Any) -> None:
    done = finish_ranks(proc, timeout=600)
    (work / f"{label}.log").write_text(done.stdout + done.stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("elastic")
    shards = build_shards(work / "shards")
    others = [k for k in KINDS if k != "z2"]
    write_config(work, shards, "inv2", "z2")
    for ranks in (1, 4):
        write_config(work, shards, f"inv{ranks}", "z2")
    for kind in others:
        write_config(work, shards, f"src_{kind}", kind)
    write_config(work, shards, "co4", "z2", codistill=True)
    plan = [entry(work, "inv2", 2, snapshot_steps=[EVERY, 2 * EVERY])]
    plan += [entry(work, f"src_{k}", 2, stop=2, snapshot_steps=[2]) for k in others]
    finish(work, "l2a", launch(work, "l2a", 2, plan))

    plans: dict[int, list[dict[str, Any]]] = {1: [], 4: []}
    for ranks in (1, 4):
        plans[ranks].append(entry(work, f"inv{ranks}", ranks))
        clone(work, "inv2", f"e2{ranks}_z2", EVERY)
        plans[ranks].append(entry(work, f"e2{ranks}_z2", ranks, snapshot_start=True,
                                  snapshot_steps=[2 * EVERY] if ranks == 4 else []))
        for kind in others:
            clone(work, f"src_{kind}", f"e2{ranks}_{kind}", 2)
            plans[ranks].append(entry(work, f"e2{ranks}_{kind}", ranks, stop=1, snapshot_start=True,
                                      snapshot_steps=[3] if ranks == 4 else []))
    plans[4].append(entry(work, "co4", 2, stop=2, snapshot_steps=[2]))  # micro 8 per rank: 2 ranks per group
    procs = {ranks: launch(work, f"l{ranks}", ranks, plans[ranks]) for ranks in (1, 4)}
    for ranks, proc in procs.items():
        finish(work, f"l{ranks}", proc)

    plan = [entry(work, "e42_z2", 2, snapshot_start=True)]
    clone(work, "e24_z2", "e42_z2", 2 * EVERY)
    for kind in others:
        clone(work, f"e24_{kind}", f"e42_{kind}", 3)
        plan.append(entry(work, f"e42_{kind}", 2, stop=1, snapshot_start=True))
    for name in ("d_trunc", "d_missing", "d_none"):
        clone(work, "inv2", name, 2 * EVERY)
        plan.append(entry(work, name, 2, stop=1))
    # codistillation last: DeepSpeed keeps its mpu in a process global, which a later plain run would inherit
    clone(work, "co4", "co42", 2)
    plan.append(entry(work, "co42", 4, stop=1, snapshot_start=True))  # micro 2 x 8 on 1 rank per group
    damage_checkpoints(work)
    finish(work, "l2b", launch(work, "l2b", 2, plan))
    return work


def damage_checkpoints(work: Path) -> None:
    newest = f"phase1-step{2 * EVERY:07d}"
    optim = work / "d_trunc" / "checkpoints" / newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    (work / "d_missing" / "checkpoints" / newest / "mp_rank_00_model_states.pt").unlink()
    for tag in (newest, f"phase1-step{EVERY:07d}"):
        path = work / "d_none" / "checkpoints" / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        path.write_bytes(path.read_bytes()[:100])


# ---------------------------------------------------------------------------------------------- helpers
def records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The last logged record of each phase-1 step."""
    out = {}
    for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("phase") == "phase1":
            out[record["phase_step"]] = {**out.get(record["phase_step"], {}), **record}
    return out


def loss_gap(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], steps: range, key: str) -> float:
    return max(abs(a[s][key] - b[s][key]) for s in steps)


def state_gap(before: dict[str, Any], after: dict[str, Any]) -> float:
    """Max abs difference over every parameter's fp32 weight, moments and compute-precision weight."""
    assert before["params"].keys() == after["params"].keys()
    return max((before["params"][n][k] - after["params"][n][k]).abs().max().item()
               for n in before["params"] for k in ("fp32", "exp_avg", "exp_avg_sq", "module"))


def outcomes(work: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for path in work.glob("l*.outcomes.json"):
        found.update(json.loads(path.read_text()))
    return found


# ---------------------------------------------------------------------------------------------- tests
def test_every_run_ends_as_planned(runs: Path) -> None:
    done = outcomes(runs)
    assert done.pop("d_none") == 2
    assert done and set(done.values()) == {0}, done


def test_losses_do_not_depend_on_the_world_size_or_the_split(runs: Path) -> None:
    """1, 2 and 4 ranks, micro x accumulation 4x4, 8x1, 2x2 of the same global batch: the same instances,
    masks (at the linear masking schedule's rate of each step) and (token-normalised) losses at every step, and
    the same validation numbers."""
    runs_by_world = {w: records(runs / f"inv{w}") for w in (1, 2, 4)}
    for world, accumulation in ((1, 4), (2, 1), (4, 2)):
        resolved = json.loads((runs / f"inv{world}" / "config.resolved.json").read_text())["resolved"]
        assert resolved["world_size"] == world
        assert resolved["ds_configs"]["phase1"]["gradient_accumulation_steps"] == accumulation
    reference = runs_by_world[2]
    assert sorted(reference) == list(range(1, STEPS + 1))
    gaps = {}
    for world in (1, 4):
        for key in ("loss/total", "loss/mlm", "loss/nsp", "grad_norm"):
            gaps[(world, key)] = loss_gap(runs_by_world[world], reference, range(1, STEPS + 1), key)
        gaps[(world, "val/mlm_loss")] = loss_gap(runs_by_world[world], reference, range(EVERY, STEPS + 1, EVERY),
                                                 "val/mlm_loss")
        # what is counted, not computed: identical
        for step in range(1, STEPS + 1):
            assert runs_by_world[world][step]["acc/nsp"] == reference[step]["acc/nsp"]
            assert runs_by_world[world][step]["lr"] == reference[step]["lr"]
            assert runs_by_world[world][step]["schedule/mask_rate"] == reference[step]["schedule/mask_rate"]
    assert [reference[s]["schedule/mask_rate"] for s in (1, STEPS)] == pytest.approx([0.3, 0.15])
    print("max |difference| vs 2 ranks over 24 steps:", {f"{w} ranks {k}": f"{v:.2e}" for (w, k), v in gaps.items()})
    assert all(v <= LOSS_TOLERANCE for v in gaps.values()), gaps
    assert reference[STEPS]["loss/mlm"] < reference[1]["loss/mlm"] - 0.05  # it trained: the check is not vacuous


@pytest.mark.parametrize("move", ["e21", "e24", "e42"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_on_another_world_size_restores_the_whole_state_exactly(runs: Path, move: str, kind: str) -> None:
    source = {"e21": "inv2" if kind == "z2" else f"src_{kind}", "e24": "inv2" if kind == "z2" else f"src_{kind}",
              "e42": f"e24_{kind}"}[move]
    step = {"z2": {"e21": EVERY, "e24": EVERY, "e42": 2 * EVERY}}.get(kind, {"e21": 2, "e24": 2, "e42": 3})[move]
    before = torch.load(runs / source / f"snapshot_{step}.pt", weights_only=False)
    after = torch.load(runs / f"{move}_{kind}" / "snapshot_start.pt", weights_only=False)
    worlds = {"e21": (2, 1), "e24": (2, 4), "e42": (4, 2)}[move]
    assert (before["world_size"], after["world_size"]) == worlds
    assert before["wrapper"] == after["wrapper"] == {
        "z0": "ExactLamb", "z1": "DeepSpeedZeroOptimizer", "z2": "DeepSpeedZeroOptimizer",
        "z3": "DeepSpeedZeroOptimizer_Stage3", "bf16": "BF16_Optimizer"}[kind]
    assert state_gap(before, after) == 0.0
    for key in ("optimizer_steps", "lrs", "scheduler_last_epoch", "global_steps", "global_samples", "trainer_state"):
        assert before[key] == after[key], key
    assert after["trainer_state"]["data_position"] == step * 16 and after["optimizer_steps"] == [step]
    log = (runs / {"e21": "l1.log", "e24": "l4.log", "e42": "l2b.log"}[move]).read_text()
    assert f"elastic resume: {runs / f'{move}_{kind}' / 'checkpoints'}/phase1-step{step:07d} was written by " \
           f"{worlds[0]} ranks, this job has {worlds[1]}; converted" in log


def test_every_checkpoint_loads_as_data_and_consolidates_to_its_converted_weights(runs: Path) -> None:
    """Every file the 1-, 2- and 4-rank runs wrote (ZeRO-0/1/2/3, BF16_Optimizer, codistillation groups, converted
    elastic states) loads with weights_only=True and the allowlist (pretrain/checkpointing/safe_load.py); and the
    consolidation that export and init_from read (consolidate.py) gives each 2- and 4-rank checkpoint the fp32
    weights its elastic conversion, an independent reader of the same partitions, found: bit for bit."""
    files = [f for f in runs.rglob("*.pt") if not f.name.startswith("snapshot_")
             and not f.relative_to(runs).parts[0].startswith("d_")]  # d_*: damaged on purpose
    for file in files:
        assert isinstance(load_data(file), dict), file
    converted = sorted(runs.rglob(CONSOLIDATED))
    for elastic in converted:
        merged = consolidated_state_dict(elastic.parent.parent, elastic.parent.name)
        for name, saved in load_data(elastic)["params"].items():
            assert torch.equal(merged[name], saved["weight"]), (elastic, name)
    assert len(files) > 100 and len(converted) >= 3 * len(KINDS), (len(files), converted)


def test_losses_after_an_elastic_resume_continue_the_uninterrupted_run(runs: Path) -> None:
    reference = records(runs / "inv2")
    gaps = {}
    for name, first in (("e21_z2", EVERY + 1), ("e24_z2", EVERY + 1), ("e42_z2", 2 * EVERY + 1)):
        resumed = records(runs / name)
        assert sorted(resumed) == list(range(first, STEPS + 1)), name
        gaps[name] = loss_gap(resumed, reference, range(first, STEPS + 1), "loss/total")
        # resumed mid-schedule on another world size: each step masked at the uninterrupted run's rate
        assert all(resumed[s]["schedule/mask_rate"] == reference[s]["schedule/mask_rate"] for s in resumed), name
    print("max |loss/total difference| after the resume vs the uninterrupted 2-rank run:",
          {k: f"{v:.2e}" for k, v in gaps.items()})
    assert all(v <= LOSS_TOLERANCE for v in gaps.values()), gaps


def test_codistillation_groups_resize_on_resume(runs: Path) -> None:
    for group in (0, 1):
        before = torch.load(runs / "co4" / f"group{group}" / "snapshot_2.pt", weights_only=False)
        after = torch.load(runs / "co42" / f"group{group}" / "snapshot_start.pt", weights_only=False)
        assert (before["world_size"], after["world_size"]) == (2, 1)
        assert state_gap(before, after) == 0.0
        assert before["trainer_state"] == after["trainer_state"] and before["lrs"] == after["lrs"]
    latest = [(runs / "co42" / f"group{g}" / "checkpoints" / "latest").read_text() for g in (0, 1)]
    assert latest == ["phase1-step0000003"] * 2


@pytest.mark.parametrize(("name", "why"), [
    ("d_trunc", "zero_pp_rank_1_mp_rank_00_optim_states.pt has "),
    ("d_missing", "mp_rank_00_model_states.pt is missing"),
])
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(runs: Path, name: str, why: str) -> None:
    folder = runs / name / "checkpoints"
    damaged, intact = f"phase1-step{2 * EVERY:07d}", f"phase1-step{EVERY:07d}"
    lines = [line for line in (runs / "l2b.log").read_text().splitlines() if str(folder / damaged) in line]
    assert len(lines) == 1 and why in lines[0], lines
    assert lines[0].endswith(f"moved to {damaged}.damaged, resuming from {intact}")
    assert (folder / f"{damaged}.damaged").is_dir() and not (folder / damaged).exists()
    assert (folder / "latest").read_text() == f"phase1-step{EVERY + 1:07d}"  # resumed at 8, trained 1 step, saved
    # same world size and split as the run that wrote it: step 9 is bit-identical to the uninterrupted run's
    assert records(runs / name)[EVERY + 1]["loss/total"] == records(runs / "inv2")[EVERY + 1]["loss/total"]


def test_no_intact_checkpoint_stops_with_one_clear_line(runs: Path) -> None:
    errors = [line for line in (runs / "l2b.log").read_text().splitlines()
              if "no intact checkpoint" in line and str(runs / "d_none") in line]
    assert errors and all(line == errors[0] for line in errors), errors  # every rank says the same one line
    # a damaged checkpoint is no config error: its own prefix, the same words after it
    assert errors[0].startswith("resume error: checkpoint.dir: no intact checkpoint to resume from")
    assert "phase1-step0000016: zero_pp_rank_0_mp_rank_00_optim_states.pt has 100 bytes" in errors[0]
