"""The ranks import the data-prep tool through one door: data_prep/shard_format/ (the format, the manifest, atomic
writes, the vocab, BERT's masking rule). An AST scan (no import runs), deferred and type-only imports included:

- no module of pretrain/ imports a part of data_prep/ outside data_prep.shard_format;
- nothing in data_prep/shard_format/ imports the rest of data_prep/ (a rank never loads the build's readers),
  nor pretrain/ (both packages stand on it);
- one Vocab, one masking rule and one ConfigError, whichever side names them.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import REPO_ROOT

DOOR = "data_prep.shard_format"


def data_prep_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every data_prep module `source` imports: `import data_prep.x`, `from data_prep.x import y`
    (as data_prep.x.y when y is a module: both spellings land in the same place), `from data_prep import x`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "data_prep":
                found += [(node.lineno, f"data_prep.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name == "data_prep" or name.startswith("data_prep.")]


def through_the_door(name: str) -> bool:
    return name == DOOR or name.startswith(DOOR + ".")


def offenders(folder: str, through: list[str] | None = None) -> dict[str, list[str]]:
    """{file: ["line: module"]} of the data_prep imports in `folder` outside the door; those through it are
    appended to `through`."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO_ROOT / folder).rglob("*.py")):
        imports = data_prep_imports(path.read_text(encoding="utf-8"))
        if through is not None:
            through += [name for _, name in imports if through_the_door(name)]
        bad = [f"{line}: {name}" for line, name in imports if not through_the_door(name)]
        if bad:
            found[path.relative_to(REPO_ROOT).as_posix()] = bad
    return found


def test_pretrain_imports_data_prep_only_through_the_shard_format() -> None:
    through: list[str] = []
    found = offenders("pretrain", through)
    assert len(through) >= 20, f"the scan saw only {len(through)} imports of {DOOR} in pretrain/: is it reading?"
    assert not found, f"pretrain/ imports data_prep/ outside {DOOR} (move what the ranks need there): {found}"


def test_the_shard_format_imports_nothing_else_of_data_prep_nor_pretrain() -> None:
    found = offenders("data_prep/shard_format")
    assert not found, f"{DOOR} imports the rest of data_prep (a rank would load the build): {found}"
    upward = [f"{path.name}: {node.module}" for path in sorted((REPO_ROOT / "data_prep" / "shard_format").glob("*.py"))
              for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pretrain"]
    assert not upward, f"{DOOR} is the floor both packages stand on; it imports pretrain: {upward}"


@pytest.mark.parametrize("planted", [
    "from data_prep.config import max_predictions_for\n",
    "def later():\n    import data_prep.build\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from data_prep import instances\n",
])
def test_the_scan_sees_every_spelling_of_an_import(planted: str) -> None:
    assert [name for _, name in data_prep_imports(planted) if not through_the_door(name)]
    assert not [name for _, name in data_prep_imports(planted.replace("data_prep", DOOR)) if not through_the_door(name)]


def test_one_vocab_one_config_error() -> None:
    """One class of each name in the product, where the layers expect it: the vocab in the shard format (the
    ranks' collate and the build's tokenizer read the same class), the ConfigError on pretrain's ground floor
    (data_prep/config.py raises that one)."""
    homes: dict[str, list[str]] = {"Vocab": [], "ConfigError": []}
    for folder in ("pretrain", "data_prep", "bench"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.name in homes:
                    homes[node.name].append(path.relative_to(REPO_ROOT).as_posix())
    assert homes == {"Vocab": ["data_prep/shard_format/vocab.py"], "ConfigError": ["pretrain/errors.py"]}
    from data_prep import config as build_config
    from pretrain import errors

    assert build_config.ConfigError is errors.ConfigError


def test_the_build_cli_prints_its_config_error_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from data_prep.__main__ import main

    text = tmp_path / "a.txt"
    text.write_text("One sentence. Another one.\n", encoding="utf-8")
    assert main(["build", "--text", str(text), "--out", str(tmp_path / "out"), "--vocab-size", "100",
                 "--dupe-factor", "0"]) == 2
    assert capsys.readouterr().err == "error: --dupe-factor 0: out of range\n"


class _Vocab:
    """Ten ordinary ids after the five specials, as `mask_ids` reads a vocab."""

    def __init__(self) -> None:
        from data_prep.shard_format.masking import SpecialIds, replacement_ids

        self.special = SpecialIds(cls=2, sep=3, mask=4, pad=0, unk=1)
        self.is_continuation = np.zeros(15, dtype=bool)
        self.replacements = replacement_ids(15, self.special)


@pytest.mark.parametrize("engine", ["random", "numpy"])
def test_both_draw_engines_follow_one_rule(engine: str) -> None:
    """Static masking (`random.Random`; numpy with --mask-draws numpy) and dynamic masking (numpy) mask the same
    number of positions, never a [CLS], [SEP] or [PAD] (a [PAD] inside an instance was a candidate
    of dynamic masking alone before the two shared one module), and split the chosen ones 80/10/10 in one order."""
    from data_prep.shard_format.masking import mask_ids, mask_instance, prediction_count

    vocab = _Vocab()
    special = vocab.special
    body = np.random.default_rng(0).integers(5, 15, size=(3000, 40))
    counts = {"mask": 0, "kept": 0, "random": 0}
    instances = [np.concatenate([[special.cls], row[:18], [special.pad] * 4, [special.sep], row[18:], [special.sep]])
                 for row in body]
    chosen = np.zeros(len(instances[0]), dtype=np.int64)  # how often each position was masked
    for i, ids in enumerate(instances):
        if engine == "random":
            out = mask_instance(ids.tolist(), 0.15, 20, special, 15, random.Random(i))
            masked, positions = np.array(out.input_ids), np.array(out.masked_positions)
        else:
            masked, positions, _ = mask_ids(ids, vocab, 0.15, 20, False, np.random.default_rng(i))
        assert len(positions) == prediction_count(len(ids), 0.15, 20)
        assert not np.isin(ids[positions], [special.cls, special.sep, special.pad]).any()
        assert np.all(np.diff(positions) > 0) and np.array_equal(np.delete(masked, positions), np.delete(ids, positions))
        chosen[positions] += 1
        after = masked[positions]
        counts["mask"] += int((after == special.mask).sum())
        counts["kept"] += int((after == ids[positions]).sum())
        counts["random"] += int(((after != special.mask) & (after != ids[positions])).sum())
    total = sum(counts.values())
    candidates = np.flatnonzero(~np.isin(instances[0], [special.cls, special.sep, special.pad]))
    share = chosen[candidates] / len(instances)  # 7 of 40 candidates: 0.175 each, when the order is uniform
    assert chosen.sum() == chosen[candidates].sum() and 0.14 < share.min() and share.max() < 0.21
    assert abs(counts["mask"] / total - 0.8) < 0.015
    assert abs(counts["kept"] / total - 0.1 - 0.01) < 0.015  # a random draw of the same id (1 in 10) counts as kept
    assert abs(counts["random"] / total - 0.09) < 0.015
