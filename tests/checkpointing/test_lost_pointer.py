"""Resume never deletes a committed checkpoint because of `latest`: a missing, emptied or unreadable pointer (a
person, a `cp -r phase*`, a sync tool, a purge) used to make every tag folder "newer than latest", and resume
deleted them all, phase ends included, and started from step 0. Now the newest committed tag that verifies is
resumed and the run says so; a pointer outside the checkpoint folder is refused in one line; only tags without a
commit marker are deleted. The tags are real manifests over real files (tests/checkpointing/test_elastic_units.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pretrain.checkpointing.checkpoint import CheckpointManager, split_checkpoint_path
from pretrain.checkpointing.layout import LATEST, MANIFEST, PHASE_END
from pretrain.checkpointing.manifest import PointerError, resolve_resume_tag
from pretrain.errors import ResumeError
from tests.checkpointing.test_elastic_units import fake_checkpoint

TAGS = ("phase1-step0000006", "phase2-step0000002", "phase2-step0000004")


def committed_folder(root: Path) -> None:
    """Three committed tags, the first a phase end, `latest` naming the newest."""
    for tag in TAGS:
        fake_checkpoint(root, tag)
    (root / TAGS[0] / PHASE_END).write_bytes(b"")  # after its manifest: the marker is no listed file here


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


@pytest.mark.parametrize("vandal", ["removed", "emptied", "unreadable"])
def test_a_lost_latest_resumes_from_the_newest_committed_tag(tmp_path: Path, vandal: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    committed_folder(root)
    unfinished = root / "phase2-step0000006"  # a save cut short before its manifest
    unfinished.mkdir()
    (unfinished / "mp_rank_00_model_states.pt").write_bytes(b"half")
    if vandal == "removed":
        (root / LATEST).unlink()
    elif vandal == "emptied":
        (root / LATEST).write_text("\n")
    else:
        (root / LATEST).write_bytes(b"\xffphase2-step\xfe")  # a torn or foreign write: no text
    capsys.readouterr()
    assert resolve_resume_tag(root, 0) == TAGS[-1]
    assert folders(root) == sorted(TAGS)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"checkpoint.dir: ignored and deleted phase2-step0000006 in {root}: no {MANIFEST}, "
                               f"newer than the newest committed checkpoint ({TAGS[-1]}")
    assert lines[1].startswith(f"checkpoint.dir: {root / LATEST} is ") and lines[1].endswith(
        f"; resuming from {TAGS[-1]}, the newest committed checkpoint that verifies (latest now names it)")
    assert (root / LATEST).read_text() == TAGS[-1]
    assert CheckpointManager(root, 3, 0).latest_tag() == TAGS[-1]


def test_a_lost_latest_falls_back_past_a_damaged_newest_tag_and_deletes_nothing_committed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    committed_folder(root)
    (root / LATEST).unlink()
    (root / TAGS[-1] / "rng_rank00001.pt").write_bytes(b"torn")
    assert resolve_resume_tag(root, 0) == TAGS[1]
    assert folders(root) == [*sorted(TAGS[:2]), f"{TAGS[-1]}.damaged"]  # moved aside, never deleted


def test_a_committed_tag_newer_than_latest_is_kept_and_resumed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A crash between the manifest and `latest` (or an older `latest` copied back) leaves a committed tag newer
    than the pointer: it is whole, so it is the one resumed."""
    root = tmp_path / "checkpoints"
    committed_folder(root)
    (root / LATEST).write_text(TAGS[0])
    capsys.readouterr()
    assert resolve_resume_tag(root, 0) == TAGS[-1]
    assert folders(root) == sorted(TAGS) and (root / LATEST).read_text() == TAGS[-1]
    assert capsys.readouterr().out.splitlines()[0] == (
        f"checkpoint.dir: {TAGS[-1]} in {root} is committed (its {MANIFEST}) but newer than latest ({TAGS[0]}): "
        f"resuming from {TAGS[-1]} (latest now names it)")


@pytest.mark.parametrize("value", ["/abs/phase1-step0000006", "../elsewhere/phase1-step0000006", "../x",
                                   "phase1-step0000006/../../x", "phase1-step0000006\nphase1-step0000002"])
def test_a_latest_outside_the_folder_is_refused_in_one_line(tmp_path: Path, value: str) -> None:
    root = tmp_path / "checkpoints"
    committed_folder(root)
    outside = tmp_path / "elsewhere" / "phase1-step0000006"
    fake_checkpoint(tmp_path / "elsewhere", outside.name)  # what an absolute or ../ pointer would have loaded
    (root / LATEST).write_text(value)
    with pytest.raises(ResumeError) as raised:
        resolve_resume_tag(root, 0)
    assert str(raised.value) == (f"checkpoint.dir: {root / LATEST} names {value!r}: no checkpoint tag "
                                 f"(phaseN-stepNNNNNNN, a folder directly inside {root}); write the tag to resume "
                                 "from into it, or remove the file")
    assert "\n" not in raised.value.line() or "\\n" in repr(value)
    assert folders(root) == sorted(TAGS) and (root / LATEST).read_text() == value  # nothing moved or deleted
    with pytest.raises(PointerError):
        CheckpointManager(root, 3, 0).latest_tag()
    with pytest.raises(PointerError):  # export and init_from read the same pointer
        split_checkpoint_path(root)


def test_a_latest_naming_a_symlink_out_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    committed_folder(root)
    fake_checkpoint(tmp_path / "elsewhere", "phase3-step0000001")
    os.symlink(tmp_path / "elsewhere" / "phase3-step0000001", root / "phase3-step0000001")
    (root / LATEST).write_text("phase3-step0000001")
    with pytest.raises(ResumeError, match=r"names 'phase3-step0000001', a symbolic link \(to .*elsewhere"):
        resolve_resume_tag(root, 0)
    (root / LATEST).write_text(TAGS[-1])  # a fine pointer: the link is never a candidate, nor deleted
    assert resolve_resume_tag(root, 0) == TAGS[-1] and (root / "phase3-step0000001").is_symlink()


def test_a_folder_named_latest_is_refused_and_kept(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    committed_folder(root)
    (root / LATEST).unlink()
    (root / LATEST).mkdir()
    with pytest.raises(ResumeError, match=r"latest is a folder, not the file naming the newest checkpoint"):
        resolve_resume_tag(root, 0)
    assert folders(root) == sorted([*TAGS, LATEST])


def test_without_any_commit_the_unfinished_tags_go_and_the_run_starts_fresh(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, TAGS[0])
    (root / TAGS[0] / MANIFEST).unlink()
    (root / LATEST).unlink()
    assert resolve_resume_tag(root, 0) is None and folders(root) == []
    assert "no committed checkpoint beside them (latest is missing)" in capsys.readouterr().out
