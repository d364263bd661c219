"""Markers that vouch for their outputs (data_prep/task_markers.py): a relaunch redoes a task whose output a
crash or a person left truncated, and ends at the same bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_prep.shard_format.atomic_io import sha256_file
from tests.data_prep.segment_inputs import build, write_inputs

FLAGS = ["--workers", "1", "--seq-lens", "48", "--num-shards", "2", "--docs-per-chunk", "16", "--keep-work"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("markers")
    corpus = write_inputs(root / "inputs")
    out = root / "reference"
    assert build(corpus, out, *FLAGS) == 0
    return corpus, out


def shard_digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): sha256_file(p) for p in sorted(out.glob("seq*/*.arrow"))}


def test_markers_record_size_and_sha256(reference) -> None:
    _, out = reference
    marker = json.loads((out / "work" / "done" / "tokens-00000.json").read_text(encoding="utf-8"))
    tokens = out / "work" / "tokens" / "shard-00000.arrow"
    assert marker["outputs"] == {"work/tokens/shard-00000.arrow": {"size": tokens.stat().st_size,
                                                                   "sha256": sha256_file(tokens)}}
    instances = json.loads((out / "work" / "done" / "instances-seq48-00000.json").read_text(encoding="utf-8"))
    assert sorted(instances["outputs"]) == ["work/instances/seq48/shard-00000-train.arrow",
                                            "work/instances/seq48/shard-00000-val.arrow"]


def test_a_truncated_output_is_redone(reference, tmp_path: Path, capsys) -> None:
    """A build cut short before its shards (no manifest, no shard), whose token and instance files lost their
    tails: the relaunch names both markers, redoes their tasks and writes the reference's shards."""
    corpus, ref = reference
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    (out / "manifest.json").unlink()
    for shard in out.glob("seq*/*.arrow"):
        shard.unlink()
    for name in ("work/tokens/shard-00000.arrow", "work/instances/seq48/shard-00000-train.arrow"):
        path = out / name
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert build(corpus, out, *FLAGS) == 0
    said = capsys.readouterr().out
    assert "tokens-00000.json: work/tokens/shard-00000.arrow is" in said and "the task runs again" in said
    assert "instances-seq48-00000.json: work/instances/seq48/shard-00000-train.arrow is" in said
    assert shard_digests(out) == shard_digests(ref)
    assert (out / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()
