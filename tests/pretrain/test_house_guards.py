"""House rules that held by discipline alone until these scans: nothing here imports the code it reads.

- A module fits one read: no product module over MAX_LINES lines (past it, a module holds two things).
- The docstrings point at files that exist: every repository path a product docstring names (a module,
  a doc, a test, a DeepSpeed JSON) is there, so a rename or a move cannot leave the prose pointing nowhere.
- ConfigError has one home, pretrain/errors.py (the ground floor): a module that needs only the error does
  not import config/ for it, so importing the error never loads the config code.
- No two names in one folder are one letter apart (metrics/monitor.py beside metrics/monitors.py, schedule.py
  beside schedules/): a reader cannot tell from such names which holds what.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO_ROOT

MAX_LINES = 400
# Folders of product code: what the line limit and the docstring scan read (tests/ are not product code).
PRODUCT = ("data_prep", "pretrain", "bench", "launch")
# A repository path in prose: one of the repository's top folders, a slash, then path characters. Not preceded
# by a path character, so `OUT/docs/x.md`, `<run.dir>/tests/` and `runs/bench/...` (run folders) are not taken
# for the repository's own; a placeholder (`<name>`, `{task}`) or a glob (`*`, `?`, `[...]`) is read whole and
# then skipped (it names many files or none).
REPO_PATH = re.compile(r"(?<![\w./<>{}*-])"
                       r"((?:bench|data_prep|docs|ds_configs|launch|pretrain|tests)/[\w./<>{}*?\[\]-]*)")
NOT_ONE_FILE = re.compile(r"[<>{}*?\[\]]")
# Enough references that a pattern which silently stopped matching cannot pass (about 300 when written).
AT_LEAST_REFERENCES = 250


def product_modules() -> Iterator[Path]:
    for folder in PRODUCT:
        yield from sorted((REPO_ROOT / folder).rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def test_no_product_module_is_over_the_line_limit() -> None:
    """A module past the limit holds two things; split it where they part rather than raise the limit."""
    lengths = {relative(path): len(path.read_text(encoding="utf-8").splitlines())
               for path in product_modules()}
    assert len(lengths) > 100, "the scan found too few modules: is REPO_ROOT right?"
    over = {path: lines for path, lines in sorted(lengths.items()) if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them): {over}"


def docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of the module's docstring and of each function's and class's, nested ones included;
    the text as written (not dedented), so a match's offset in it gives its line."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield (node.body[0].lineno, text)


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line within `text`, path) for the repository paths `text` names, each as written minus the sentence's
    punctuation after it (a path never ends with `.`, `,`, `:` or `)`); placeholders and globs left out."""
    found = ((text.count("\n", 0, match.start()), match.group(1).rstrip(".,:;)"))
             for match in REPO_PATH.finditer(text))
    return [(line, path) for line, path in found if not NOT_ONE_FILE.search(path)]


def docstring_references() -> list[tuple[str, int, str]]:
    """(module, line, path) for every repository path named in a product docstring."""
    return [(relative(module), first + line, path) for module in product_modules()
            for first, text in docstrings(module.read_text(encoding="utf-8"))
            for line, path in named_paths(text)]


def test_every_path_a_product_docstring_names_exists() -> None:
    references = docstring_references()
    assert len(references) >= AT_LEAST_REFERENCES, f"{len(references)} paths found: has REPO_PATH gone wrong?"
    dead = [f"{module}:{line} names {path}" for module, line, path in references
            if not (REPO_ROOT / path).exists()]
    assert not dead, "docstrings name paths that do not exist (write them from the repository root):\n" + \
        "\n".join(dead)


def test_the_path_pattern_takes_paths_and_leaves_placeholders_globs_and_run_folders() -> None:
    text = ("By pretrain/trainer.py (see docs/faults.md.) and tests/launch/, into <run.dir>/docs/x.md,"
            "\nOUT/tests/a.py, runs/bench/b.json; all ds_configs/recipes/*.json, pretrain/finetune/{task}/,"
            "\nds_configs/deepspeed/<name>.json; pretrain.config.load is a module name, launch.sh no folder.")
    assert named_paths(text) == [(0, "pretrain/trainer.py"), (0, "docs/faults.md"), (0, "tests/launch/")]
    assert named_paths("one\ntwo names docs/lamb.md,\nthree") == [(1, "docs/lamb.md")]
    assert list(docstrings('"""Module."""\nclass A:\n    def f(self):\n        """Method."""\n')) == \
        [(1, "Module."), (4, "Method.")]


def config_error_homes(source: str) -> list[str]:
    """The pretrain modules other than pretrain.errors that `source` imports ConfigError from (an import from
    outside pretrain/, such as data_prep's re-export of the same class, is not counted)."""
    return [node.module or "" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("pretrain.") and node.module != "pretrain.errors"
            and any(alias.name == "ConfigError" for alias in node.names)]


def test_config_error_is_imported_from_its_one_home() -> None:
    found = {relative(path): homes for folder in ("pretrain", "bench", "tests")
             for path in sorted((REPO_ROOT / folder).rglob("*.py"))
             if (homes := config_error_homes(path.read_text(encoding="utf-8")))}
    assert not found, f"import ConfigError from pretrain.errors, where it is declared: {found}"
    deferred = "def f():\n    from pretrain.config.load import ConfigError, load_config\n"
    assert config_error_homes(deferred) == ["pretrain.config.load"]
    both = "from pretrain.errors import ConfigError\nfrom data_prep.config import ConfigError\n"
    assert config_error_homes(both) == []


def one_letter_apart(a: str, b: str) -> bool:
    """Whether `b` is `a` with one letter added, removed or changed."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def near_names(folder: Path) -> list[tuple[str, str]]:
    """Pairs of a folder's module stems and subfolder names (its own, and in every folder under it) that are one
    letter apart."""
    found = []
    for here in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        if here.name == "__pycache__":
            continue
        names = sorted({p.stem for p in here.glob("*.py")} | {p.name for p in here.iterdir()
                                                               if p.is_dir() and p.name != "__pycache__"})
        found += [(f"{relative(here)}/{a}", b) for i, a in enumerate(names) for b in names[i + 1:]
                  if one_letter_apart(a, b)]
    return found


def test_no_two_names_in_a_folder_are_one_letter_apart() -> None:
    found = [pair for folder in PRODUCT if (REPO_ROOT / folder).is_dir() for pair in near_names(REPO_ROOT / folder)]
    assert not found, f"names one letter apart (rename one to say what it holds): {found}"
    assert one_letter_apart("monitor", "monitors") and one_letter_apart("schedules", "schedule")
    assert not one_letter_apart("monitor_contract", "monitor_registry") and not one_letter_apart("data", "data")
