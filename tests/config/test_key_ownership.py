"""Each run-config key is declared once, by the component that reads it, and handed on as its section, never copied.

Two AST scans of pretrain/ (no code runs but the config's own classes, to see which section each declaration lands
in): every `name: type = setting(default, doc)` is a key of exactly one section of the run config (a second
declaration of `run.seed` in another class, or a declaration no section inherits, fails), and no module copies a key
out of the config into a field of the same name (`val_every_steps=config.logging.val_every_steps`: the plan once
copied about 30 keys so into *Settings classes that declared them again, and each new knob was spelled 4 to 9 times).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import torch

from pretrain.config.doc import config_sections
from pretrain.config.load import load_config
from pretrain.config.sections import RunConfig
from pretrain.distributed.info import DistInfo
from pretrain.plan.run_plan import plan_run
from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import build_shards, tiny_run_config

PRETRAIN = REPO_ROOT / "pretrain"


def declarations(source: str) -> list[tuple[str, str, int]]:
    """(class, key, line) of every `key: type = setting(...)` in a class body of `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(statement.value, ast.Call) and isinstance(statement.value.func, ast.Name)
                    and statement.value.func.id == "setting"):
                found.append((node.name, statement.target.id, statement.lineno))
    return found


def key_copies(source: str, keys: set[str]) -> list[tuple[str, int]]:
    """(key, line) of every constructor call's keyword argument that copies a config key (one of `keys`) into a field
    of the same name: `Settings(k=config.<...>.k)` or `Settings(k=phase.k)` (a phase's section)."""
    found = []
    for call in ast.walk(ast.parse(source)):
        if not isinstance(call, ast.Call):
            continue
        callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if not callee[:1].isupper():  # a function's argument is no field: check_phase_shards(..., seq_len=...)
            continue
        for node in call.keywords:
            if node.arg not in keys or not isinstance(node.value, ast.Attribute) or node.value.attr != node.arg:
                continue
            root = node.value
            while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in ("config", "phase"):
                found.append((node.arg, node.lineno))
    return sorted(found, key=lambda found: found[1])


def sections_by_class() -> dict[str, set[str]]:
    """Class name -> the run-config sections (run, phase1, codistill, ...) that inherit its declarations."""
    landing: dict[str, set[str]] = {}
    for section in config_sections(RunConfig):
        for cls in section.type.__mro__:
            landing.setdefault(cls.__name__, set()).add(section.name)
    return landing


@functools.cache
def modules() -> dict[str, str]:
    return {path.relative_to(REPO_ROOT).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(PRETRAIN.rglob("*.py"))}


def doubly_declared(sources: dict[str, str], landing: dict[str, set[str]]) -> list[str]:
    """Keys (section.key) declared by more than one class, and declarations that no section of the config inherits."""
    where: dict[str, list[str]] = {}
    problems = []
    for path, source in sources.items():
        for cls, key, line in declarations(source):
            places = landing.get(cls)
            if not places:
                problems.append(f"{path}:{line} {cls}.{key}: a declaration that no section of the run config inherits")
            for section in sorted(places or ()):
                where.setdefault(f"{section}.{key}", []).append(f"{path}:{line} ({cls})")
    problems += [f"{key} declared {len(found)} times: {found}" for key, found in sorted(where.items()) if len(found) > 1]
    return problems


def test_every_key_is_declared_once_by_one_class() -> None:
    sources = modules()
    problems = doubly_declared(sources, sections_by_class())
    assert not problems, "declare each key once, in the component that reads it:\n" + "\n".join(problems)
    # the scan sees the components' declarations, not only the config's own
    declared = {(cls, key) for source in sources.values() for cls, key, _ in declarations(source)}
    assert {("CadenceSection", "every_steps"), ("SlowRankSection", "evict_slow"), ("SeedSection", "seed"),
            ("ValidationSection", "val_every_steps"), ("ScheduleSettings", "lr_schedule")} <= declared
    assert len(declared) >= 70
    # what it catches: the same key declared again in a class that the section also inherits, and a dead one
    twice = {"a.py": "class LoopRun:\n    seed: int = setting(1, 'x')\n",
             "b.py": "class RunSection(LoopRun):\n    seed: int = setting(1, 'x')\n",
             "c.py": "class TrainerSettings:\n    steps: int = setting(0, 'x')\n"}
    found = doubly_declared(twice, {"LoopRun": {"run"}, "RunSection": {"run"}})
    assert found[0].startswith("c.py:2 TrainerSettings.steps: a declaration that no section") and "run.seed declared 2" in found[1]


def test_no_module_copies_a_config_key_into_a_field_of_its_name() -> None:
    """The plan hands a component its section (`checkpoint=config.checkpoint`), or a value it derived
    (`step_offset=config.phase1.steps`); `val_every_steps=config.logging.val_every_steps` is a second declaration."""
    sources = modules()
    keys = {key for source in sources.values() for _, key, _ in declarations(source)}
    found = {path: copies for path, source in sources.items() if (copies := key_copies(source, keys))}
    assert not found, f"keys copied out of the config (hand the component its section instead): {found}"
    old = ("TrainerSettings(phase=name, steps=phase.steps, val_every_steps=config.logging.val_every_steps,\n"
           "    step_offset=config.phase1.steps, checkpoint=config.checkpoint, every=config.phase(name).every)\n"
           "StreamSettings(seed=config.run.seed, schedules=schedules, max_predictions=data.max_predictions)\n"
           "check_phase_shards(manifest, mask_probability=config.data.mask_probability)\n")
    assert key_copies(old, keys | {"every"}) == [("steps", 1), ("val_every_steps", 1), ("every", 2), ("seed", 3)]



def test_the_plan_hands_each_component_the_configs_own_section(tmp_path: Path) -> None:
    """The loop, the stream, the job and the monitors get the config's section objects themselves (typed as what
    each declares), so a key's value has one home from RUN.json to its use."""
    run_json = tiny_run_config(tmp_path / "run.json", build_shards(tmp_path / "shards", train=16, val=8),
                               tmp_path / "run")
    config = load_config(str(run_json), ["--checkpoint.every_minutes=7", "--failures.max_consecutive_nonfinite=9"])
    plan = plan_run(config, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                    verify_checksums=False)
    phase = plan.phases["phase1"]
    loop, stream = phase.trainer, phase.stream
    assert loop.section is config.phase1 and loop.run is config.run and loop.validation is config.logging
    assert loop.checkpoint is config.checkpoint and loop.failures is config.failures and loop.feed is config.data
    assert (loop.checkpoint.every_minutes, loop.failures.max_consecutive_nonfinite, loop.steps) == (7.0, 9, config.phase1.steps)
    assert stream.run is config.run and stream.parts is config.data and stream.layout is config.phase1
    assert plan.job.checkpoint is config.checkpoint and plan.job.quality.marks is config.logging
    slow = [m for m in loop.monitors if type(m).__name__ == "SlowRanks"]
    assert len(slow) == 1 and slow[0].settings is config.run
