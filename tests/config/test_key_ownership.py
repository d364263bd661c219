"""Each run-config key is declared once, by the component that reads it, and handed on as its section, never copied.

Two AST scans of pretrain/ (no code runs but the config's own classes, to see which section each declaration lands
in): every `name: type = setting(default, doc)` is a key of exactly one section of the run config (a second
declaration of `run.seed` in another class, or a declaration no section inherits, fails), and no module copies a key
out of the config into a field of the same name (`val_every_steps=config.logging.val_every_steps`: the plan once
copied about 30 keys so into *Settings classes that declared them again, and each new knob was spelled 4 to 9 times).
"""

from __future__ import annotations

import ast

from pretrain.config.doc import config_sections
from pretrain.config.sections import RunConfig
from tests.support.paths import REPO_ROOT

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

