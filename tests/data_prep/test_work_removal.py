"""OUT/work/ is removed once the manifest is written (2-3x the output on disk), unless --keep-work; only the files
the build wrote there (data_prep/work_layout.py names them), and a finished folder stays finished without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.shard_format.atomic_io import atomic_write_json
from tests.data_prep.segment_inputs import build, write_inputs
from tests.support.data_prep_fixtures import tree_digest

FLAGS = ["--workers", "1", "--seq-lens", "48", "--num-shards", "2", "--docs-per-chunk", "16", "--seed", "7"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("work_removal"))


def test_work_is_removed_and_the_folder_stays_complete(corpus: Path, tmp_path: Path, capsys) -> None:
    kept, removed = tmp_path / "kept", tmp_path / "removed"
    assert build(corpus, kept, *FLAGS, "--keep-work") == 0
    assert build(corpus, removed, *FLAGS) == 0
    assert (kept / "work" / "tokens" / "shard-00000.arrow").is_file()  # the test could fail
    assert not (removed / "work").exists()
    assert tree_digest(removed) == tree_digest(kept)
    capsys.readouterr()
    assert build(corpus, removed, *FLAGS) == 0
    assert "already complete (same config); nothing to do" in capsys.readouterr().out
    assert main(["merge", "--out", str(removed), "--workers", "1"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert main(["task", "corpus", "--out", str(removed), "--index", "0", "--workers", "1"]) == 0
    assert not (removed / "work").exists()  # nothing was redone
    assert tree_digest(removed) == tree_digest(kept)


def test_a_file_the_build_did_not_write_stays(corpus: Path, tmp_path: Path) -> None:
    """A started folder (its config recorded) where someone put a file in work/ and one in work/tokens/: both
    stay, with their folders; everything the build wrote is gone."""
    out = tmp_path / "out"
    argv = ["build", "--text", str(corpus / "corpus.txt"), "--vocab", str(corpus / "vocab.txt"), "--out", str(out),
            *FLAGS]
    atomic_write_json(out / "build_config.json", config_from_args(build_parser().parse_args(argv)).identity())
    (out / "work" / "tokens").mkdir(parents=True)
    (out / "work" / "notes.txt").write_text("mine", encoding="utf-8")
    (out / "work" / "tokens" / "shard-00000.arrow.bak").write_text("mine too", encoding="utf-8")
    assert main(argv) == 0
    left = sorted(p.relative_to(out).as_posix() for p in (out / "work").rglob("*"))
    assert left == ["work/notes.txt", "work/tokens", "work/tokens/shard-00000.arrow.bak"]
