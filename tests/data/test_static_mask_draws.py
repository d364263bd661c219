"""`--mask-draws numpy`: static masking drawn by the ranks' masker (data_prep/shard_format/masking.py `mask_ids`).

The same rule as the default (google-research/bert's `random.Random` draws, whose bytes
tests/data_prep/test_nsp_unchanged.py pins), other bytes: the instances are exactly a dynamic build's (the masks
draw from a generator of their own), each carries BERT's count of predictions, never on [CLS] or [SEP], and the
choice is recorded in the build's identity only when it is not the default.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.shard_format.masking import prediction_count
from data_prep.shard_format.modes import max_predictions_for
from data_prep.shard_format.shards import Manifest, read_table
from tests.data_prep.segment_inputs import build, write_inputs

FLAGS = ("--seq-lens", "48", "--num-shards", "1", "--docs-per-chunk", "16", "--mask-prob", "0.3", "--workers", "1")


def rows(out: Path) -> dict[str, list]:
    manifest = Manifest.load(out)
    shard = manifest.data["seq_lens"]["48"]["train"]["shards"][0]["file"]
    return read_table(out / shard).to_pydict()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draws")
    corpus = write_inputs(root / "inputs")
    outs = {"dynamic": root / "dynamic", "numpy": root / "numpy"}
    assert build(corpus, outs["dynamic"], *FLAGS) == 0
    assert build(corpus, outs["numpy"], *FLAGS, "--masking", "static", "--mask-draws", "numpy") == 0
    return outs


def test_numpy_draws_mask_a_dynamic_builds_instances(builds: dict[str, Path]) -> None:
    dynamic, static = rows(builds["dynamic"]), rows(builds["numpy"])
    assert len(static["input_ids"]) == len(dynamic["input_ids"]) > 20
    assert static["a_len"] == dynamic["a_len"] and static["next_sentence_label"] == dynamic["next_sentence_label"]
    vocab = Manifest.load(builds["numpy"]).vocab_path.read_text(encoding="utf-8").split("\n")
    cls, sep, mask = vocab.index("[CLS]"), vocab.index("[SEP]"), vocab.index("[MASK]")
    changed = total = 0
    for ids, positions, labels, original in zip(static["input_ids"], static["masked_positions"],
                                                static["masked_label_ids"], dynamic["input_ids"], strict=True):
        restored = np.array(ids)
        restored[positions] = labels
        assert restored.tolist() == original  # the labels are the dynamic instance's ids at those positions
        assert len(positions) == prediction_count(len(ids), 0.3, max_predictions_for(48, 0.3))
        assert positions == sorted(positions)
        assert not {original[p] for p in positions} & {cls, sep}
        changed += sum(ids[p] != original[p] for p in positions)
        total += len(positions)
    assert 0.85 < changed / total < 0.95  # [MASK] (80 %) or a random id (10 %); the other 10 % kept
    assert sum(ids.count(mask) for ids in static["input_ids"]) > 0.7 * total


def test_the_identity_names_numpy_draws_only_when_chosen(builds: dict[str, Path]) -> None:
    assert Manifest.load(builds["numpy"]).data["config"]["mask_draws"] == "numpy"
    assert Manifest.load(builds["numpy"]).data["masking"]["mode"] == "static"  # the ranks read static shards
    recorded = json.loads((builds["dynamic"] / "manifest.json").read_text(encoding="utf-8"))["config"]
    assert "mask_draws" not in recorded  # a default build's identity, and so its folder, is what it was


def test_numpy_draws_go_with_static_masking(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    corpus = write_inputs(tmp_path / "inputs")
    assert build(corpus, tmp_path / "out", *FLAGS, "--mask-draws", "numpy") == 2
    assert capsys.readouterr().err == ("error: --mask-draws numpy: goes with --masking static (dynamic shards are "
                                       "masked by the ranks)\n")
