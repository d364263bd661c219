"""The slow tier's lists in tests/conftest.py name tests and fixtures that exist: an entry left behind by a rename
would silently move a slow test into the fast tier (`python -m pytest -m "not slow"`)."""

from __future__ import annotations

import ast

from tests.conftest import SLOW_FIXTURES, SLOW_TESTS
from tests.support.paths import REPO_ROOT


def functions_in(path: str) -> set[str]:
    tree = ast.parse((REPO_ROOT / path).read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_slow_entry_names_a_test_folder_file_or_a_test_in_it() -> None:
    for entry in SLOW_TESTS:
        path, _, name = entry.partition("::")
        assert (REPO_ROOT / path).is_dir() if path.endswith("/") else (REPO_ROOT / path).is_file(), entry
        if name:
            assert any(function.startswith(name) and function.startswith("test_") for function in functions_in(path)), entry


def test_every_slow_fixture_is_defined_in_its_file() -> None:
    for entry in SLOW_FIXTURES:
        path, fixture = entry.split("::")
        assert fixture in functions_in(path), entry
