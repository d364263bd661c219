"""The run folder has one layout: pretrain/run_folder.py spells every name, no other module does, and
docs/pretraining.md lists exactly those names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pretrain import run_folder
from tests.support.paths import REPO_ROOT

FILE_NAMES = (run_folder.RESOLVED_CONFIG, run_folder.CLOCK_FILE, run_folder.JOB_LOCK, run_folder.EXPORT_INFO,
              run_folder.METRICS_FILE, run_folder.REPORT_MD, run_folder.REPORT_PNG)
FOLDER_NAMES = (run_folder.CHECKPOINTS, run_folder.EXPORT, run_folder.TENSORBOARD, run_folder.EXCHANGE,
                run_folder.LOGS, run_folder.FAULTS)
# fine-tune output folders have a tensorboard/ of their own, the demo's output folder a logs/: not run folders
OTHER_FOLDERS = ("pretrain/finetune/", "pretrain/demo/")


def spellings(source: str, folder_names: bool) -> list[tuple[int, str]]:
    """(line, name) of each string literal that is a run-folder file name, or (with `folder_names`) a
    run-folder folder name joined onto a path with `/`. Docstrings and messages that mention a name
    among other words are not spellings."""
    tree = ast.parse(source)
    found = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in FILE_NAMES]
    if folder_names:
        found += [(node.lineno, node.right.value) for node in ast.walk(tree)
                  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                  and isinstance(node.right, ast.Constant) and node.right.value in FOLDER_NAMES]
    return found


def test_no_module_but_run_folder_spells_a_run_folder_name() -> None:
    offenders = {}
    for path in [*(REPO_ROOT / "pretrain").rglob("*.py"), *(REPO_ROOT / "bench").rglob("*.py")]:
        rel = path.relative_to(REPO_ROOT).as_posix()
        if rel == "pretrain/run_folder.py":
            continue
        if found := spellings(path.read_text(encoding="utf-8"), not rel.startswith(OTHER_FOLDERS)):
            offenders[rel] = found
    assert not offenders, f"import the name from pretrain/run_folder.py instead: {offenders}"
    assert spellings('p = run_dir / "tensorboard" / "metrics.jsonl"', True) == [(1, "metrics.jsonl"), (1, "tensorboard")]


def listed_in_docs() -> set[str]:
    """The paths under runs/NAME/ in docs/pretraining.md's "What a run folder holds", as run_folder.LISTED
    writes them (checkpoint tags and phase names become the folder they sit in)."""
    text = (REPO_ROOT / "docs" / "pretraining.md").read_text(encoding="utf-8")
    block = text[text.index("## What a run folder holds"):text.index("`keep_last` step checkpoints")]
    listed = set()
    for line in block.splitlines():
        match = re.match(r"^    runs/NAME/(\S+)", line)
        if not match:
            continue
        for entry in [match.group(1).rstrip(","), *re.findall(r",\s+(\w+\.\w+)(?=\s)", line[:40])]:
            parts = entry.split("/")
            if parts[0] == run_folder.CHECKPOINTS:
                entry = f"{run_folder.CHECKPOINTS}/"
            elif parts[0] == run_folder.EXPORT and len(parts) > 2 and parts[2]:
                entry = f"{run_folder.EXPORT}/<phase>/{parts[2]}"
            elif parts[0] == run_folder.EXPORT:
                entry = f"{run_folder.EXPORT}/"
            listed.add(entry)
    return listed


def test_the_docs_list_what_a_run_folder_holds_as_run_folder_spells_it() -> None:
    documented = listed_in_docs()
    assert documented == set(run_folder.LISTED), (documented ^ set(run_folder.LISTED))


def test_the_helpers_build_paths_inside_the_run_folder(tmp_path: Path) -> None:
    assert run_folder.metrics_path(tmp_path) == tmp_path / "tensorboard" / "metrics.jsonl"
    assert run_folder.export_dir(tmp_path, "phase2") == tmp_path / "export" / "phase2"
