"""Codistillation is a one-way plug-in: the core never imports it, and a plain config never loads it.

The static check reads every core module's imports (an AST scan, no import); the runtime check loads
configs in a fresh interpreter, where no other test has imported anything yet. That a whole plain
*run* loads no codistillation module is checked on the 2-rank runs of tests/pretrain/test_multirank.py.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT
from tests.support.pretrain_fixtures import tiny_run_config

PLUGIN = "pretrain.codistill"
# Packages that may use the plug-in: the plug-in itself, and applications built on top of the core.
NOT_CORE = ("codistill", "demo", "finetune")


def core_modules() -> list[Path]:
    root = REPO_ROOT / "pretrain"
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in NOT_CORE)


def package_of(path: Path) -> str:
    """The dotted package a module file belongs to (what its relative imports start from)."""
    return ".".join(path.relative_to(REPO_ROOT).parts[:-1])  # a package's __init__.py included


def imported_names(source: str, package: str) -> list[str]:
    """Every module an `import`, `from ... import` (relative ones resolved against `package`) or
    `importlib.import_module("...")` / `__import__("...")` with a literal name names; `from X import y`
    counts as `X` and `X.y`."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
    return names


def computed_imports(source: str) -> list[int]:
    """The lines of every `import_module(...)` / `__import__(...)` whose name is not a literal string: an edge
    the scan above cannot see (an f-string, a variable), so none may exist in the project's modules."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            literal = bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            if func in ("import_module", "__import__") and not literal:
                lines.append(node.lineno)
    return lines


def names_plugin(name: str) -> bool:
    return name == PLUGIN or name.startswith(PLUGIN + ".")


def test_no_core_module_imports_the_codistillation_plugin() -> None:
    modules = core_modules()
    assert REPO_ROOT / "pretrain" / "train.py" in modules and REPO_ROOT / "pretrain" / "plugin.py" in modules
    offenders = {
        str(path.relative_to(REPO_ROOT)): name
        for path in modules
        for name in imported_names(path.read_text(encoding="utf-8"), package_of(path))
        if names_plugin(name)
    }
    assert not offenders, f"core modules import the plug-in (go through pretrain/plugin.py's hooks): {offenders}"


def test_the_scan_catches_every_import_form() -> None:
    forms = ["import pretrain.codistill.plugin", "from pretrain.codistill import spec", "from pretrain import codistill",
             "from .codistill.plugin import Codistillation", "from . import codistill",
             "importlib.import_module('pretrain.codistill.plugin')", "def f():\n    import pretrain.codistill"]
    for form in forms:  # as if written in a module of the `pretrain` package
        assert any(names_plugin(n) for n in imported_names(form, "pretrain")), form
    assert package_of(REPO_ROOT / "pretrain" / "checkpointing" / "manifest.py") == "pretrain.checkpointing"
    assert not any(names_plugin(n) for n in imported_names("from . import config", "pretrain.checkpointing"))


def test_a_plain_config_loads_no_plugin_module_and_a_codistill_section_only_its_light_spec(tmp_path: Path) -> None:
    run_json = tiny_run_config(tmp_path / "run.json", tmp_path / "shards", tmp_path / "run")
    code = (  # what pretrain.train.main does before a run: parse the command line, load the config
        "import json, sys\n"
        "import pretrain.trainer\n"
        "from pretrain.config.load import load_config\n"
        "from pretrain.train import parse_args\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('pretrain.codistill'))\n"
        f"plain = load_config(*parse_args(['--config', {str(run_json)!r}, '--phase1.steps=3']))\n"
        "after_plain = loaded()\n"
        f"on = load_config(*parse_args(['--config', {str(run_json)!r}, '--codistill.enabled=true']))\n"
        "print(json.dumps({'plain': after_plain, 'codistill': loaded(), 'keys': list(plain.to_dict()),\n"
        "                  'on_keys': list(on.to_dict())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["plain"] == [] and "codistill" not in seen["keys"]
    # the section's declaration and checks only; the process groups and teachers wait for a run that builds it
    assert seen["codistill"] == ["pretrain.codistill", "pretrain.codistill.config", "pretrain.codistill.spec"]
    assert seen["on_keys"][-1] == "codistill"  # serialised back under its own top-level key
