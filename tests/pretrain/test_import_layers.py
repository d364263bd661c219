"""The project's modules import each other one way: no circle, deferred and type-only imports included.

An AST scan of every module of pretrain/ and data_prep/ (no import runs; tests/pretrain/module_map.py): each
`import`, `from ... import` (relative ones resolved), `import_module("...")`, inside functions and under
`if TYPE_CHECKING:` too, becomes an arrow to the project module it names. A circle is reported with its modules.
The packages, each taken as one node, form no circle either, nor do the folders at every depth (no import runs back
up to a folder that imports the importer); every import points to its own layer of docs/architecture.md or one
below; the doc's module map (each module's floor, 1 + the highest floor it imports) is what the code gives now;
the leaves named below stay on the ground floor; and below the plan no module takes a RunConfig.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.pretrain.module_map import (
    DOC,
    PACKAGES,
    documented_layers,
    documented_map,
    floors,
    import_graph,
    package_name,
    render_map,
)
from tests.pretrain.test_plugin_boundary import computed_imports
from tests.support.paths import REPO_ROOT

# modules every floor may use: they import nothing of the project but each other (plugin.py: the registry
# and types, from these; keys.py: how a component declares a run-config key)
GROUND = ("pretrain.errors", "pretrain.keys", "pretrain.distributed.info", "pretrain.checkpointing.layout",
          "pretrain.run_folder", "pretrain.plugin_registry", "pretrain.schedules.lr", "pretrain.schedules.masking",
          "pretrain.schedules.progress", "pretrain.schedules.batch")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_among_the_projects_modules() -> None:
    graph = import_graph()
    assert "pretrain.optimizer_step" in graph and "pretrain.plugin" in graph["pretrain.optimizer_step"]
    assert not circles(graph), f"import circles (break them by moving the shared piece down a floor): {circles(graph)}"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with each package one node (the imports inside a package left out)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = package_name(module)
        packages.setdefault(here, set()).update(p for t in targets if (p := package_name(t)) != here)
    return packages


def test_no_import_runs_back_up_to_a_package_that_imports_its_package() -> None:
    """Modules form no circle, and packages neither: a package's floor sits above every package it imports. The
    last import that ran back up was checkpointing/export.py's of report/'s model card (report/ reads metrics/,
    which reads checkpointing/); the export now takes its card from its caller (pretrain/export.py)."""
    packages = package_graph(import_graph())
    assert not circles(packages), f"packages importing each other (move the shared piece down): {circles(packages)}"
    assert "pretrain.report" not in packages["pretrain.checkpointing"] and "pretrain.plan" in packages["pretrain.launch"]
    assert circles(package_graph({"a.x": {"b.y"}, "b.y": {"c"}, "c": {"a.z"}, "a.z": set()})) == [["a", "b", "c"]]


def folder_name(module: str) -> str:
    """A module's folder, at every depth: pretrain.finetune.squad.command -> pretrain.finetune.squad; a package's
    __init__ is its own folder; a module at the root of pretrain/ or data_prep/ is its own node, as above."""
    parts = module.split(".")
    if len(parts) <= 2 or (REPO_ROOT / Path(*parts)).is_dir():
        return module
    return ".".join(parts[:-1])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with each folder one node, subfolders apart from their parent (package_graph merges them)."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = folder_name(module)
        folders.setdefault(here, set()).update(f for t in targets if (f := folder_name(t)) != here)
    return folders


def test_no_import_runs_back_up_between_a_folder_and_its_subfolders() -> None:
    """package_graph takes pretrain/finetune/ with squad/ and glue/ as one node, so a circle between a folder and
    its own subfolder hid there: squad/__main__.py and glue/__main__.py imported finetune/commands.py, which
    imported squad/ and glue/. Each task now declares its command line in its own folder (command.py)."""
    graph = import_graph()
    folders = folder_graph(graph)
    assert not circles(folders), f"folders importing each other (move the shared piece down): {circles(folders)}"
    assert "pretrain.finetune" in folders["pretrain.finetune.squad"]  # the scan sees squad/ -> finetune/common.py
    # the layout that circle had, in miniature: a table in the parent folder, read by an entry point in a child
    old = {"pretrain.finetune.commands": {"pretrain.finetune.squad.evaluate"},
           "pretrain.finetune.squad.__main__": {"pretrain.finetune.commands"}, "pretrain.finetune.squad.evaluate": set()}
    assert circles(folder_graph(old)) == [["pretrain.finetune", "pretrain.finetune.squad"]]
    assert not circles(package_graph(old))


def test_the_ground_floor_and_the_plugin_contract_import_nothing_above_them() -> None:
    graph = import_graph()
    for leaf in GROUND:
        assert graph[leaf] <= set(GROUND), f"{leaf} imports {graph[leaf] - set(GROUND)}"
    # the contract: types of the ground floor only, so no hook can hand back a core object from above
    assert graph["pretrain.plugin"] <= set(GROUND), graph["pretrain.plugin"]
    assert "pretrain.config.doc" not in {t for targets in graph.values() for t in targets} - {"pretrain.config.doc"}
    height = floors(graph)
    assert height["pretrain.train"] > height["pretrain.trainer"] > height["pretrain.plugin"] > height["pretrain.errors"]


def test_no_module_loads_project_code_by_a_computed_name() -> None:
    """The graph above reads literal names only: a computed one (`import_module(f"{package}.finetune")`) would
    hide an arrow, so callers hand callables down instead. Plug-ins load through the registry's entry
    points (pretrain/plugin_registry.py), which name their module in pyproject.toml, not in code."""
    found = {str(path.relative_to(REPO_ROOT)): lines for package in PACKAGES
             for path in (REPO_ROOT / package).rglob("*.py")
             if (lines := computed_imports(path.read_text(encoding="utf-8")))}
    assert not found, f"imports by a computed name (pass a callable instead): {found}"
    hidden = 'import importlib\ndef parser(package):\n    return importlib.import_module(f"{package}.finetune")\n'
    assert computed_imports(hidden) == [3] and computed_imports("__import__(name)") == [1]
    assert computed_imports("importlib.import_module('pretrain.trainer')") == []


def deferred_imports_without_a_reason(source: str) -> list[int]:
    """Lines of the imports of a project module inside a function with no comment saying why: none on the
    import's line, the imports just above it or the three lines above those, and no `except ImportError` around it."""
    lines = source.splitlines()
    tree = ast.parse(source)
    guarded = {node.lineno for handler in ast.walk(tree) if isinstance(handler, ast.Try)
               if any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in handler.handlers)
               for statement in handler.body for node in ast.walk(statement) if hasattr(node, "lineno")}
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if not any(name.split(".")[0] in PACKAGES for name in names) or node.lineno in guarded:
                continue
            first = node.lineno - 1  # a block of imports shares the comment above its first line
            while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
                first -= 1
            if not any("#" in line for line in lines[max(0, first - 3):node.lineno]):
                found.append(node.lineno)
    return found


def test_imports_of_project_modules_sit_at_the_top_unless_a_comment_says_why() -> None:
    """A light `--help`, a bare-python3 launch path, an optional plug-in: each deferred import says which."""
    found = {str(path.relative_to(REPO_ROOT)): lines for package in PACKAGES
             for path in (REPO_ROOT / package).rglob("*.py")
             if (lines := deferred_imports_without_a_reason(path.read_text(encoding="utf-8")))}
    assert not found, f"move these imports to the top, or say why they wait: {found}"
    assert deferred_imports_without_a_reason("def f():\n    from pretrain.errors import ConfigError\n") == [2]
    assert deferred_imports_without_a_reason("def f():\n    import torch\n") == []
    guarded = "def f():\n    try:\n        from pretrain.errors import ConfigError\n        x = 1\n    except ImportError:\n        pass\n"
    assert deferred_imports_without_a_reason(guarded) == []  # a Store context in the try has no line: skipped


def test_squad_and_glue_are_siblings_that_share_only_finetune_common() -> None:
    graph = import_graph()
    tasks = ("pretrain.finetune.squad", "pretrain.finetune.glue")
    for task, other in (tasks, tasks[::-1]):
        crossing = {m: sorted(t for t in targets if t.startswith(other + "."))
                    for m, targets in graph.items() if m.startswith(task + ".")}
        assert not any(crossing.values()), f"{task} imports {other}: {crossing}"
    assert "pretrain.finetune.common" in graph["pretrain.finetune.glue.finetune"]


def test_the_scan_finds_a_deferred_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_import_points_to_its_own_layer_or_one_below() -> None:
    """docs/architecture.md's layer table places every package (and every module at pretrain/'s root) in one of
    about a dozen layers; an import into a higher layer, or a package in none, fails here."""
    layers = documented_layers(DOC.read_text(encoding="utf-8"))
    graph = import_graph()
    unplaced = sorted({package_name(module) for module in graph} - set(layers))
    assert not unplaced, f"packages in no layer of docs/architecture.md's layer table (place them): {unplaced}"
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if layers[package_name(target)][0] > layers[package_name(module)][0])
    assert not upward, f"imports into a higher layer of docs/architecture.md: {upward}"
    assert 10 <= len({number for number, _ in layers.values()}) <= 15, "about a dozen layers"
    layer = {package: number for package, (number, _) in layers.items()}
    assert layer["pretrain.train"] > layer["pretrain.plan"] > layer["pretrain.trainer"] > layer["pretrain.errors"]
    assert layer["pretrain.launch"] == max(layer.values())  # the launcher is read last, imported by nothing


def test_the_doc_module_map_is_what_the_code_gives_now() -> None:
    """The map in docs/architecture.md (one row per module: its layer, its floor, its docstring's first line) is
    the generator's output for today's code: after adding or moving a module, run
    `python -m tests.pretrain.module_map --write`."""
    text = DOC.read_text(encoding="utf-8")
    documented, generated = documented_map(text), render_map(text)
    stale = sorted(set(documented.splitlines()) ^ set(generated.splitlines()))
    assert documented == generated, ("docs/architecture.md's module map is not the code's (run python -m "
                                     f"tests.pretrain.module_map --write); rows that differ: {stale[:20]}")
    rows = [line for line in generated.splitlines() if line.startswith("| `")]
    assert len(rows) == len(import_graph()) and "| `pretrain/train.py` | 13 driver |" in generated


def test_the_launcher_is_imported_by_nothing_else_of_pretrain() -> None:
    """pretrain/launch/ holds the launcher's processes; a rank's own place in the job is pretrain/distributed/."""
    graph = import_graph()
    upward = {m: sorted(t for t in targets if t.startswith("pretrain.launch."))
              for m, targets in graph.items() if m.startswith("pretrain.") and not m.startswith("pretrain.launch")}
    assert not any(upward.values()), {m: t for m, t in upward.items() if t}
    assert "pretrain.distributed.process_group" in graph["pretrain.engine"] or \
        "pretrain.distributed.process_group" in graph["pretrain.train"]


def phase_lookups(source: str, method: str = "phase") -> list[int]:
    """Lines that call `<something>.<method>(...)`; by default `.phase(`, RunConfig's lookup of a section."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == method]


# `.phases()` hands out every phase's section through RunConfig.phase: the same read, made where the scan for
# `.phase(` does not look. Outside config/ and plan/ only the launcher's check walks them (the node range, the
# line it prints), before any rank and plan exist; its count may fall, not rise, and a module not listed may not start.
PHASES_WALKS_OUTSIDE_THE_PLAN = {"pretrain/launch/preflight.py": 2}

# Who may take a RunConfig (a parameter or a class field annotated with it): config/ (it is the config), plan/ (it reads
# it once, going down: each phase's plain settings, the run's shards and disk), the driver that hands it to the plan,
# the launcher before any rank starts (preflight.py the run's check, scale.py the recipe tool, agent.py a failed
# rank's folder under a plug-in's share of the job), and the plug-in contract and its plug-ins
# (PluginSpec.build(config, world), JobShare.config_for: a plug-in reads its own section).
CONFIG_READERS = ("pretrain/config/", "pretrain/plan/", "pretrain/train.py", "pretrain/launch/preflight.py",
                  "pretrain/launch/scale.py", "pretrain/launch/agent.py", "pretrain/plugin.py", "pretrain/codistill/")


def run_config_takers(source: str) -> list[int]:
    """Lines of the function parameters and class fields whose annotation names RunConfig (in a union or a string
    too): how a function or an object is handed the run config."""

    def names_it(annotation: ast.expr | None) -> bool:
        return annotation is not None and any(
            (isinstance(n, ast.Name) and n.id == "RunConfig") or (isinstance(n, ast.Attribute) and n.attr == "RunConfig")
            or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "RunConfig" in n.value)
            for n in ast.walk(annotation))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            arguments = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]
            found += [arg.lineno for arg in arguments if names_it(arg.annotation)]
        elif isinstance(node, ast.ClassDef):
            found += [s.lineno for s in node.body if isinstance(s, ast.AnnAssign) and names_it(s.annotation)]
    return sorted(found)


def test_no_module_below_the_plan_takes_a_run_config() -> None:
    """data/, checkpointing/, model/, metrics/ and the trainer get plain values (a PhasePlan's, or the plan's sums):
    what they read is named at the call, and each is tested without a config. shard_checks.py and footprint.py
    once took one; their walks of the run's phases are plan/shard_plan.py and plan/footprint_plan.py."""
    found = {rel: lines for path in (REPO_ROOT / "pretrain").rglob("*.py")
             if not (rel := path.relative_to(REPO_ROOT).as_posix()).startswith(CONFIG_READERS)
             if (lines := run_config_takers(path.read_text(encoding="utf-8")))}
    assert not found, f"a RunConfig taken below the plan (hand it the plan's plain values instead): {found}"
    for reader in ("shard_plan.py", "footprint_plan.py"):
        assert run_config_takers((REPO_ROOT / "pretrain" / "plan" / reader).read_text(encoding="utf-8")), reader
    assert run_config_takers("def f(a: int, config: RunConfig | None = None) -> None: ...\n") == [1]
    assert run_config_takers("class A:\n    config: 'RunConfig'\n") == [2]
    assert run_config_takers("def f(config: dict) -> RunConfig: ...\n") == []


def test_the_config_is_read_going_down_once_into_the_plan() -> None:
    """RunConfig.phase is called in config/ and in the run plan only; the trainer and the driver's phase loop read
    their plan (the trainer module does not even name RunConfig). `.phases()` is counted too."""
    # launch/scale.py rewrites a recipe's phases for another batch (`./launch.sh scale`): a config tool that moved
    # beside the launch check so that config/ imports nothing of checkpointing/
    allowed = ("pretrain/config/", "pretrain/plan/", "pretrain/launch/scale.py")
    outside = [(rel, path.read_text(encoding="utf-8")) for path in (REPO_ROOT / "pretrain").rglob("*.py")
               if not (rel := path.relative_to(REPO_ROOT).as_posix()).startswith(allowed)]
    found = {rel: lines for rel, source in outside if (lines := phase_lookups(source))}
    assert not found, f"RunConfig.phase outside config/, plan/ and launch/scale.py: {found}"
    walks = {rel: lines for rel, source in outside if (lines := phase_lookups(source, "phases"))}
    more = {rel: lines for rel, lines in walks.items()
            if len(lines) > PHASES_WALKS_OUTSIDE_THE_PLAN.get(rel, 0)}
    assert not more, f"RunConfig.phases() outside config/ and plan/ (read the plan instead): {more}"
    assert phase_lookups("config.phase('phase1')\n") == [1]
    assert phase_lookups("for name, phase in config.phases():\n    pass\n", "phases") == [1]
    trainer = (REPO_ROOT / "pretrain" / "trainer.py").read_text(encoding="utf-8")
    assert "RunConfig" not in trainer
    assert "isinstance" not in trainer.split("def train(")[1]  # the loop asks no type (monitors report themselves)
