"""`python -m pretrain.config.rehearsal --out DIR`: run.json names what the rehearsal launch loads, so whoever can
write DIR could swap it. An --out someone else owns or can write is refused in one line before anything is
written; run.json is written through a temp file renamed over the name, never through a link standing there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pretrain.config.rehearsal import main
from tests.support.paths import REPO_ROOT

RECIPE = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"


def rehearse(tmp_path: Path, out: Path) -> int:
    shards = tmp_path / "shards"
    shards.mkdir(exist_ok=True)
    (shards / "manifest.json").write_text("{}")
    return main([str(RECIPE), "--shards", str(shards), "--out", str(out), "--seq-lens", "32,64"])


def test_run_json_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    (out / "run.json").symlink_to(victim)
    assert rehearse(tmp_path, out) == 0
    assert victim.read_text() == "untouched\n" and not (out / "run.json").is_symlink()
    assert json.loads((out / "run.json").read_text())["run"]["dir"] == str(out.resolve() / "run")
    assert rehearse(tmp_path, tmp_path / "new" / "folder") == 0, "an --out not there yet is made"
    os.chmod(out, 0o770)
    assert rehearse(tmp_path, out) == 0, "a folder of yours your group may write: your umask's choice"


@pytest.mark.parametrize("kind", ["world-writable", "foreign", "link"])
def test_an_out_others_can_write_is_refused_in_one_line(tmp_path: Path, kind: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rehearse"
    if kind == "link":
        (tmp_path / "real").mkdir(mode=0o700)
        out.symlink_to(tmp_path / "real")
    elif kind == "foreign":
        if os.geteuid() != 0:
            out = Path("/usr/share")  # root's: not this user's
        else:
            out.mkdir(mode=0o755)
            os.chown(out, 65534, 65534)
    else:
        out.mkdir()
        os.chmod(out, 0o777)
    assert rehearse(tmp_path, out) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --out {out}: ") and "mktemp -d" in line
    assert not (out / "run.json").exists() and not (tmp_path / "real" / "run.json").exists()
