"""Every shipped recipe, rehearsed on 2 CPU ranks through the DeepSpeed path a GPU run takes.

`pretrain.config.rehearsal` shrinks each `ds_configs/recipes/*.json` (model, steps, phase batch keys, buckets) and keeps
everything that selects code: bf16 + ZeRO-1 + fp32 accumulation (DeepSpeed's BF16_Optimizer around
our LAMB), clipping, LAMB parameters, packing, activation checkpointing, codistillation. A recipe
added later is rehearsed here with no new test code. CPU-only recipes (`*cpu*`) run as shipped in
the demo and driver tests. What cannot run on a CPU (NCCL, CUDA kernels) is bench/gpu_check/gpu_check.sh's job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pretrain.config.rehearsal import (
    gpu_precision,
    shrink_run_config,
    shrink_squad_ds_config,
    squad_toy_flags,
)
from tests.support.launching import REPO_ROOT, deepspeed_cpu_env, run_ranks
from tests.support.paths import SCRIPTS
from tests.support.pretrain_fixtures import build_shards, step_records
from tests.support.squad_fixtures import write_squad

SCRIPT = SCRIPTS / "recipe_scenarios.py"
CONFIGS = REPO_ROOT / "ds_configs" / "recipes"
DEEPSPEED_CONFIGS = REPO_ROOT / "ds_configs" / "deepspeed"
RECIPES = sorted(p.name for p in CONFIGS.glob("*.json") if "cpu" not in p.name)
SQUAD_CONFIGS = sorted(p.name for p in DEEPSPEED_CONFIGS.glob("squad*.json") if "cpu" not in p.name)
SEQ_LENS = {"phase1": 32, "phase2": 64}
STEPS = 4
pytestmark = pytest.mark.multirank


def expected_wrapper(ds: dict[str, Any], precision: str) -> str:
    """DeepSpeed 0.19.8's choice for a client optimizer (its engine's _configure_optimizer)."""
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    if precision == "bf16" and stage == 1 and ds.get("data_types", {}).get("grad_accum_dtype") == "fp32":
        return "BF16_Optimizer"
    return {0: "ExactLamb", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer",
            3: "DeepSpeedZeroOptimizer_Stage3"}[stage]


class Rehearsals:
    """Every recipe's rehearsal and the SQuAD fine-tunes of the first one's export, in ONE 2-rank launch per
    test session, on first use: each launch costs the ranks' start-up (~10 s of a 2-core machine), and the
    runs are independent folders in sequence, as a user would run them one after the other."""

    def __init__(self, root: Path) -> None:
        self.root, self.launch_log = root, root / "launch.log"
        self.shards = {objective: build_shards(root / f"shards_{segments}", seq_lens=tuple(SEQ_LENS.values()), train=96,
                                               val=16, segments=segments)
                       for objective, segments in (("mlm+nsp", "nsp"), ("mlm", "full-sentences"))}
        self.works = {recipe: self._prepare(recipe) for recipe in RECIPES}
        self.squad_work = self._prepare_squad(self.works[RECIPES[0]])
        done = run_ranks(SCRIPT, ["pretrain", *map(str, self.works.values()), "squad", str(self.squad_work)],
                         num_ranks=2, timeout=1800)
        self.launch_log.write_text(done.stdout + done.stderr)

    def _prepare(self, recipe: str) -> Path:
        work = self.root / Path(recipe).stem
        work.mkdir()
        shipped = json.loads((CONFIGS / recipe).read_text())
        shards = self.shards[shipped.get("data", {}).get("objective") or "mlm+nsp"]  # what the recipe trains
        shrunk = shrink_run_config(shipped, CONFIGS, shards, work, ranks=2, steps=STEPS, seq_lens=SEQ_LENS)
        (work / "run.json").write_text(json.dumps(shrunk, indent=2))
        return work

    def _prepare_squad(self, recipe_work: Path) -> Path:
        """The shipped SQuAD JSONs, shrunk, to fine-tune the rehearsed recipe's phase-2 export with."""
        work = self.root / "squad"
        work.mkdir()
        (work / "export").symlink_to(model_dirs(recipe_work)[0] / "export" / "phase2")
        write_squad(work / "train.json", repeat=1)
        write_squad(work / "dev.json")
        for name in SQUAD_CONFIGS:
            shipped = json.loads((DEEPSPEED_CONFIGS / name).read_text())
            stem = f"squad_{Path(name).stem}"
            (work / f"{stem}.json").write_text(json.dumps(shrink_squad_ds_config(shipped)))
            (work / f"{stem}.meta").write_text(json.dumps({"precision": gpu_precision("auto"), "shipped": name,
                                                           "flags": squad_toy_flags(2)}))
        return work

    def get(self, recipe: str) -> Path:
        return self.works[recipe]


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory: pytest.TempPathFactory) -> Rehearsals:
    return Rehearsals(tmp_path_factory.mktemp("recipes"))


def model_dirs(work: Path) -> list[Path]:
    """The run folders of the recipe's models: one, or one per codistillation group."""
    run = json.loads((work / "run.json").read_text())
    base = Path(run["run"]["dir"])
    groups = run.get("codistill", {}).get("groups", 2) if run.get("codistill", {}).get("enabled") else 0
    return [base / f"group{g}" for g in range(groups)] if groups else [base]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_both_phases_resumes_and_exports_through_the_gpu_path(rehearsals: Rehearsals, recipe: str) -> None:
    work = rehearsals.get(recipe)
    run = json.loads((work / "run.json").read_text())
    outcomes = json.loads((work / "outcomes.json").read_text())
    last = run["run"]["phases"][-1]
    assert outcomes["a_interrupted"] == 0 and outcomes["a_resumed"] == 0 and outcomes["c_last_phase_in_one_go"] == 0
    assert outcomes["a_latest_after_stop"] == f"{last}-step0000002"  # the stop landed inside the last phase

    # The DeepSpeed path of every phase is the one a GPU run of the shipped file takes.
    shipped = json.loads((CONFIGS / recipe).read_text())
    paths = json.loads((work / "paths_a.json").read_text())
    for phase in run["run"]["phases"]:
        ds = json.loads(Path(run[phase]["ds_config"]).read_text())
        precision = gpu_precision(shipped["run"].get("precision", "auto"))
        assert run["run"]["precision"] == precision
        took = paths[phase]
        assert took["wrapper"] == expected_wrapper(ds, precision), took
        assert took["client"] == ("ExactLamb" if ds["optimizer"]["type"] == "ExactLamb" else took["client"])
        assert took["bf16"] == (precision == "bf16") and took["fp16"] == (precision == "fp16")
        assert took["zero_stage"] == ds["zero_optimization"]["stage"] and took["accumulation"] > 1

    for model_dir in model_dirs(work):
        checkpoints = model_dir / "checkpoints"
        assert (checkpoints / "latest").read_text() == f"{last}-step{STEPS:07d}"
        for phase in run["run"]["phases"]:
            assert (checkpoints / f"{phase}-step{STEPS:07d}" / "PHASE_END").is_file()
            # the export (consolidated from every rank's BF16_Optimizer partition) is the live fp32 masters
            masters = torch.load(model_dir / f"masters_{phase}.pt")
            exported = load_file(model_dir / "export" / phase / "model.safetensors")
            shared = set(masters) & set(exported)
            assert len(shared) >= len(masters) - 1, sorted(set(masters) - set(exported))  # tied decoder may be elided
            for name in shared:
                assert torch.equal(exported[name].float(), masters[name]), name

    if not run.get("codistill", {}).get("enabled"):
        # A's last phase was interrupted and resumed; C ran it in one go (phase 2 from A's phase-1 export, or a
        # one-phase recipe from scratch). Same weights, data and schedule: the same losses, to the last bit.
        a = step_records(model_dirs(work)[0])
        c = step_records(work / "c")
        for step in range(1, STEPS + 1):
            assert a[(last, step)]["loss/total"] == c[(last, step)]["loss/total"], step
            assert a[(last, step)]["lr"] == c[(last, step)]["lr"], step
        assert json.loads((work / "paths_c.json").read_text())[last] == paths[last]
    else:
        for g in range(run["codistill"]["groups"]):
            assert (work / "c" / f"group{g}" / "export" / "phase2" / "model.safetensors").is_file()
    objective = json.loads((model_dirs(work)[0] / "config.resolved.json").read_text())["resolved"]["objective"]
    assert objective == (shipped.get("data", {}).get("objective") or "mlm+nsp")


def test_squad_configs_finetune_the_rehearsed_export(rehearsals: Rehearsals, tmp_path: Path) -> None:
    recipe_run = rehearsals.get(RECIPES[0])
    run_dir = model_dirs(recipe_run)[0]
    # ./launch.sh export of the BF16_Optimizer checkpoint equals the driver's own phase-end export.
    phase1_tag = run_dir / "checkpoints" / f"phase1-step{STEPS:07d}"
    done = subprocess.run([str(REPO_ROOT / "launch.sh"), "export", str(phase1_tag), str(tmp_path / "exported")],
                          env=deepspeed_cpu_env() | {"PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, drivers = (load_file(p / "model.safetensors") for p in (tmp_path / "exported", run_dir / "export" / "phase1"))
    assert ours.keys() == drivers.keys() and all(torch.equal(ours[k], drivers[k]) for k in ours)

    work = rehearsals.squad_work  # fine-tuned in the rehearsals' launch, after the recipes
    outcomes = json.loads((work / "outcomes.json").read_text())
    for meta_file in sorted(work.glob("squad_*.meta")):
        meta = json.loads(meta_file.read_text())
        assert outcomes[meta_file.stem] == 0, meta
        results = json.loads((work / meta_file.stem / "results.json").read_text())
        shipped = json.loads((DEEPSPEED_CONFIGS / meta["shipped"]).read_text())
        assert results["precision"] == meta["precision"] and results["train_steps"] == 3
        assert results["train_batch_size"] == int(meta["flags"][1])  # the toy batch, given as a flag
        assert results["world_size"] == 2 and 0 <= results["scores"]["f1"] <= 100
        # DeepSpeed-native Adam types must be torch's (FusedAdam would compile with nvcc on every rank)
        expected = "ExactLamb" if shipped["optimizer"]["type"] == "ExactLamb" else "AdamW"
        assert results["optimizer"] == expected, results
        assert results["optimizer_wrapper"] == expected_wrapper(shipped, meta["precision"]), results
