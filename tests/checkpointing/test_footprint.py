"""Disk: the size estimate against what DeepSpeed really writes, the free-space refusal, and saves on a real
full file system (a small tmpfs): a failed save costs no checkpoint, a later one succeeds once space is back.
An export that cannot be written stops the job with one line; the rerun redoes it alone.
Resume never trusts a tag that has no commit marker. A failed metrics write is one warning, not an ending.
One process, a real one-rank DeepSpeed engine (gloo); the multi-rank runs are in test_full_disk.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.checkpoint import CheckpointManager, SaveError
from pretrain.checkpointing.commit import ExportError, out_of_space
from pretrain.checkpointing.footprint import (
    CheckpointShape,
    Destination,
    check_free_space,
    checkpoint_bytes,
    parameter_tensors,
)
from pretrain.checkpointing.layout import LATEST, MANIFEST
from pretrain.checkpointing.manifest import manifest_bytes, resolve_resume_tag
from pretrain.errors import ConfigError
from pretrain.metrics.writer import MetricsWriter
from pretrain.model.bert import bert_config, build_model
from pretrain.model.presets import bert_parameter_count
from pretrain.plugin import TrainingPlugin
from pretrain.train import export_phase
from tests.checkpointing.test_elastic_units import fake_checkpoint
from tests.support.filesystems import fill, small_filesystem
from tests.support.launching import run_ranks
from tests.support.paths import SCRIPTS
from tests.support.trainer_fixtures import build_trainer


@pytest.mark.parametrize(("preset", "overrides"), [("tiny", {}), ("bert-mini", {"type_vocab_size": 3}),
                                                   ("tiny", {"intermediate_size": 100, "num_hidden_layers": 3})])
def test_the_parameter_count_is_the_built_models(preset: str, overrides: dict[str, int]) -> None:
    config = bert_config(preset, 48, 512, **overrides)
    model = build_model(config)
    assert bert_parameter_count(config.to_dict()) == sum(p.numel() for p in model.parameters())
    assert parameter_tensors(config.to_dict()) == len(list(model.parameters()))


def stage_override(stage: int) -> str:
    return "--phase1.ds_overrides=" + json.dumps({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("stage", [0, 3])
def test_the_estimate_is_what_a_checkpoint_takes(tmp_path: Path, stage: int) -> None:
    """After a real optimizer step (ZeRO-0 creates the moments there), one tag's bytes are within 5 % of the
    estimate. ZeRO-2 on 2 ranks is compared in test_full_disk.py."""
    trainer = build_trainer(tmp_path, [stage_override(stage)], steps=2)
    trainer.train_step()
    trainer.state.step = 1
    trainer.save()
    written = manifest_bytes(tmp_path / "ckpt" / "phase1-step0000001")
    model = trainer.engine.module
    shape = CheckpointShape(bert_parameter_count(model.config.to_dict()), parameter_tensors(model.config.to_dict()),
                            "fp32", stage, 1)
    assert written is not None and abs(checkpoint_bytes(shape) - written) <= 0.05 * written, (
        checkpoint_bytes(shape), written)


def test_a_folder_too_small_for_the_run_is_refused_in_one_line(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small", 256) as small:
        run_dir = small / "run"
        wanted = [Destination("run.dir", run_dir, run_dir / "checkpoints", 300 * 1024, "3 checkpoints x 100.0 KiB"),
                  Destination("run.dir", run_dir, run_dir / "export", 20 * 1024, "1 export x 20.0 KiB")]
        with pytest.raises(ConfigError) as refused:
            check_free_space(wanted)
        assert str(refused.value) == (
            f"run.dir {run_dir}: 256.0 KiB free on its file system, the run needs 320.0 KiB (3 checkpoints x "
            "100.0 KiB; 1 export x 20.0 KiB); free space, point the folder elsewhere or lower checkpoint.keep_last")
        smaller = [Destination("run.dir", run_dir, run_dir / "checkpoints", 220 * 1024, "2 checkpoints x 110.0 KiB"),
                   wanted[1]]
        (run_dir / "checkpoints").mkdir(parents=True)  # a resume: what the run folder holds is already paid for
        (run_dir / "checkpoints" / "old.pt").write_bytes(b"\0" * 100 * 1024)
        check_free_space(smaller)  # 156 KiB free, 240 - 100 needed
        (run_dir / "checkpoints" / "old.pt").rename(small / "someone_elses.pt")  # the same bytes, not the run's
        with pytest.raises(ConfigError, match="156.0 KiB free on its file system, the run needs 240.0 KiB"):
            check_free_space(smaller)


def test_a_save_on_a_full_disk_keeps_the_last_checkpoint_and_a_later_one_succeeds(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trainer = build_trainer(tmp_path, steps=4)
    with small_filesystem(tmp_path / "small", 4096) as small:
        manager = CheckpointManager(small / "checkpoints", keep_last=1, rank=0)
        trainer.checkpoints = manager
        trainer.train_step()
        trainer.state.step = 1
        trainer.save(routine=True)
        first = manager.root / "phase1-step0000001"
        size = manifest_bytes(first)
        assert (manager.root / LATEST).read_text() == first.name and size
        filler = fill(small, leave_kib=size // 2048)  # room for half a checkpoint
        capsys.readouterr()
        trainer.state.step = 2
        trainer.save(routine=True)  # a routine save: one line, training goes on
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"checkpoint error: could not write {manager.root / 'phase1-step0000002'} (rank 0: ")
        assert "No space left on device" in line and "a checkpoint needs about" in line
        assert line.endswith("latest still names phase1-step0000001; training on: the next checkpoint tries again")
        assert (manager.root / LATEST).read_text() == first.name and manifest_bytes(first) == size
        assert sorted(p.name for p in manager.root.iterdir()) == ["latest", first.name, "zero_to_fp32.py",
                                                                  "zero_to_torch.py"]  # nothing partial left
        with pytest.raises(SaveError, match="stopping: free space, then rerun the same command"):
            trainer.save(phase_end=True)  # a checkpoint the run cannot do without: SaveError (exit 4)
        filler.unlink()
        trainer.save(routine=True)  # space is back: the same save goes through, keep_last prunes step 1
        assert (manager.root / LATEST).read_text() == "phase1-step0000002" and not first.exists()
        assert resolve_resume_tag(manager.root, 0) == "phase1-step0000002"
        # The phase end's export on a full disk: one line and SaveError; nothing half-written is left.
        export = small / "export" / "phase1"
        filler = fill(small, leave_kib=64)
        capsys.readouterr()
        with pytest.raises(ExportError) as raised:
            export_phase(TrainingPlugin(), "phase1", manager.root, export, rank=0)
        line = raised.value.line()  # what the driver prints, once (the agent shows it from the rank's log)
        assert line.startswith(f"export error: could not write the export {export} (") and line.endswith(
            "free space, then rerun the same command (it redoes the export)"), line
        assert not export.exists() and [p.name for p in export.parent.iterdir()] == []
        filler.unlink()
        export_phase(TrainingPlugin(), "phase1", manager.root, export, rank=0, only_missing=True)
        assert (export / "model.safetensors").is_file() and (export / "README.md").is_file()  # with its card


def test_resume_ignores_tags_without_a_commit_marker(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A tag newer than `latest` (a save cut short) is deleted with one line; an older tag without a manifest
    is never a fallback, however whole its files look."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, f"phase1-step{step:07d}")
    (root / "phase1-step0000004" / MANIFEST).unlink()  # older than latest, no marker
    (root / LATEST).write_text("phase1-step0000006")
    unfinished = fake_checkpoint(root, "phase1-step0000008")
    (unfinished / MANIFEST).unlink()
    (root / LATEST).write_text("phase1-step0000006")
    newest = root / "phase1-step0000006" / "rng_rank00001.pt"
    newest.write_bytes(b"torn")
    capsys.readouterr()
    assert resolve_resume_tag(root, 0) == "phase1-step0000002"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"checkpoint.dir: ignored and deleted phase1-step0000008 in {root}: newer than latest "
                        "(phase1-step0000006), saves that did not finish")
    assert "phase1-step0000004 is damaged: no MANIFEST.json (a save that did not finish)" in lines[2]
    assert not unfinished.exists() and (root / LATEST).read_text() == "phase1-step0000002"


def test_a_failed_metrics_write_is_one_warning_and_training_goes_on(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    with small_filesystem(tmp_path / "small", 64) as small:
        writer = MetricsWriter(small / "tensorboard", enabled=True)
        values = {f"tag/{i}": float(i) for i in range(40)}
        for step in range(400):  # about 1 KiB of JSON a step: the 64 KiB fill up within the loop
            writer.scalars(step, values, extra={"phase": "phase1"})
            writer.histogram(step, "h", torch.arange(100.0))
        writer.flush()
        writer.close()
        out = capsys.readouterr()
        warnings = [line for line in out.out.splitlines() if line.startswith("warning: metrics:")]
        assert len(warnings) == 1 and "No space left on device" in warnings[0], out
        assert "Traceback" not in out.err


def test_only_a_full_disk_or_a_quota_is_out_of_space() -> None:
    """The one failure freeing space fixes, whichever writer words it (Python's OSError, safetensors' Rust error)."""
    assert out_of_space("rank 1: x.pt: [Errno 28] No space left on device: 'x.pt'")
    assert out_of_space("rank 0: y: [Errno 122] Disk quota exceeded") and out_of_space("I/O error (os error 28)")
    for other in ("rank 0: x.pt: [Errno 5] Input/output error", "[Errno 27] File too large", "[Errno 21] Is a directory",
                  "Could not send the FileTimerRequest because FileTimerServer is not available"):
        assert not out_of_space(other), other


@pytest.mark.multirank
def test_a_write_that_fails_on_one_rank_fails_the_save_on_both(tmp_path: Path) -> None:
    """2 ranks (tests/scripts/checkpoint_fault_ranks.py): rank 1's partition, then rank 0's copy of
    zero_to_fp32.py (DeepSpeed's one write outside its checkpoint engine) cannot be written. Nobody hangs."""
    finished = run_ranks(SCRIPTS / "checkpoint_fault_ranks.py", [str(tmp_path)], num_ranks=2, timeout=300)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    required = [ranks_view.pop("required") for ranks_view in seen]  # rank 0's has the whole line it printed
    assert seen[0] == seen[1], seen  # every rank saw the same outcome
    result = seen[0]
    assert result["first"] and not result["rank1_fails"] and not result["copy_fails"] and result["then"]
    assert result["latest_after_1"] == "phase1-step0000001" and not result["folder_after_1"]
    for message in required:
        assert message.startswith(f"could not write {tmp_path / 'checkpoints' / 'phase1-step0000003'} (rank 0: "
                                  "zero_to_fp32.py: [Errno 21] Is a directory"), required
    # not a full disk: no advice to free space (rank 0's whole line)
    assert required[0].endswith("latest still names phase1-step0000001; stopping: remove the cause of that error, "
                                "then rerun the same command (it resumes from there)"), required[0]
    assert result["latest"] == "phase1-step0000004" and result["folders"] == ["phase1-step0000004"]
    lines = [line for line in finished.stdout.splitlines() if line.startswith("checkpoint error:")]
    assert len(lines) == 2 and "(rank 1: zero_pp_rank_1_mp_rank_00_optim_states.pt: [Errno 21] Is a directory" in (
        lines[0]), lines  # the two routine saves; the required one's line is its SaveError's (above)
