"""Nothing committed is deleted because of a typo or a shared folder, on a real run of the driver (in this process,
one rank, a real DeepSpeed engine, a real phase-end checkpoint and export):

- `export CKPT OUT` deleted OUT recursively whatever it held: `export runs/x/checkpoints runs/x` deleted the whole
  run. OUT is now replaced only when it is an earlier export (export_info.json) or empty; anything else, or a
  folder that holds or lies inside the checkpoint, is refused in one line before any work; an earlier export is
  renamed aside and deleted only once the new one is in place;
- two runs that name one `checkpoint.dir` resumed from and pruned each other's checkpoints: the second is refused
  in one line, unless it adopts the folder (checkpoint.adopt=true).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from pretrain.checkpointing.layout import OWNER
from pretrain.errors import ConfigError
from pretrain.export import main as export_main
from pretrain.launch.preflight import LaunchShape, check_command_line
from pretrain.train import main as train_main
from tests.support.pretrain_fixtures import build_shards, tiny_run_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-phase run (2 steps): its checkpoints and its phase-end export. Tests work on copies."""
    work = tmp_path_factory.mktemp("foreign_folders")
    shards = build_shards(work / "shards", seq_lens=(32,), train=32, val=8)
    run_json = tiny_run_config(work / "run.json", shards, work / "run")
    assert train_main(["--config", str(run_json), '--run.phases=["phase1"]', "--phase1.steps=2",
                       "--logging.val_every_steps=0", "--logging.tensorboard=false"]) == 0
    return work / "run"


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(run: Path, where: Path) -> Path:
    shutil.copytree(run, where, symlinks=True)
    (where / "notes.txt").write_text("a week of notes")
    return where


def refused_line(capsys: pytest.CaptureFixture) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_export_over_the_run_folder_or_into_the_checkpoint_is_refused(run: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    victim = copy_run(run, tmp_path / "victim_run")
    before = tree(victim)
    checkpoints = victim / "checkpoints"
    assert export_main([str(checkpoints), str(victim)]) == 2  # the typo that deleted a whole run
    assert refused_line(capsys) == (f"error: export to {victim} refused, nothing written: it holds the checkpoint "
                                    f"being exported ({checkpoints}); choose a new folder, e.g. "
                                    "<run.dir>/export/<name>")
    tag = (checkpoints / "latest").read_text()
    assert export_main([str(checkpoints / tag), str(checkpoints / "out")]) == 2
    assert "it lies inside the checkpoint folder" in refused_line(capsys)
    assert export_main([str(checkpoints), str(checkpoints)]) == 2
    assert "it holds the checkpoint being exported" in refused_line(capsys)
    assert tree(victim) == before


def test_export_over_a_folder_of_other_files_is_refused(run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".bashrc").write_text("export PATH")
    (home / ".ssh" / "id_ed25519").write_text("key")
    before = tree(home)
    assert export_main([str(run / "checkpoints"), str(home)]) == 2
    assert refused_line(capsys) == (f"error: export to {home} refused, nothing written: it holds files that are no "
                                    "earlier export (.bashrc, .ssh; no export_info.json); choose a new or empty folder")
    assert tree(home) == before and sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no staging left


def test_export_over_an_earlier_export_replaces_it_after_the_new_one_is_in_place(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "export"
    shutil.copytree(run / "export" / "phase1", out)
    (out / "stale_file.bin").write_bytes(b"from the earlier export")
    seen: list[tuple[str, bool]] = []
    real_rmtree = shutil.rmtree

    def rmtree(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:  # pass-through spy
        seen.append((Path(path).name, (out / "export_info.json").is_file() and not (out / "stale_file.bin").exists()))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    os.umask(saved := os.umask(0o022))
    assert export_main([str(run / "checkpoints"), str(out)]) == 0
    monkeypatch.undo()
    old = [name for name, _ in seen if name.startswith(".export.replaced.")]
    assert len(old) == 1 and dict(seen)[old[0]], "the earlier export is deleted only once the new one is in place"
    assert not (out / "stale_file.bin").exists() and json.loads((out / "export_info.json").read_text())["source"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~saved  # an export is handed on: not mkdtemp's 0700
    assert stat.S_IMODE((out / "export_info.json").stat().st_mode) == 0o666 & ~saved


def test_a_second_run_on_one_checkpoint_dir_is_refused_unless_it_adopts_it(run: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    first = copy_run(run, tmp_path / "first")
    checkpoints = first / "checkpoints"
    config = json.loads((run.parent / "run.json").read_text())
    second_json = tmp_path / "second.json"
    config["run"]["dir"] = str(tmp_path / "second")
    config["checkpoint"]["dir"] = str(checkpoints)
    second_json.write_text(json.dumps(config))
    before = tree(checkpoints)
    args = ["--config", str(second_json), '--run.phases=["phase1"]', "--phase1.steps=2",
            "--logging.val_every_steps=0", "--logging.tensorboard=false"]
    with pytest.raises(ConfigError, match=r"^checkpoint.dir .* belongs to run "):  # ./launch.sh, before any rank
        check_command_line(args, LaunchShape(1, "cpu"))
    capsys.readouterr()
    assert train_main(args) == 2
    assert refused_line(capsys) == (
        f"config error: checkpoint.dir {checkpoints.resolve()} belongs to run {run.resolve()} (its {OWNER}): this run "
        "would resume from and prune that run's checkpoints; use another checkpoint.dir, or set "
        "checkpoint.adopt=true to take it over")
    assert tree(checkpoints) == before
    owner = json.loads((checkpoints / OWNER).read_text())  # the first run's record, copied with its folder
    assert owner == {"run_dir": str(run.resolve()), "place_in_run_dir": "checkpoints"}
    assert train_main([*args, "--checkpoint.adopt=true"]) == 0
    assert (f"checkpoint.dir {checkpoints.resolve()}: taken over from run {run.resolve()} by run "
            f"{(tmp_path / 'second').resolve()} (checkpoint.adopt)") in capsys.readouterr().out
    assert json.loads((checkpoints / OWNER).read_text())["run_dir"] == str((tmp_path / "second").resolve())
