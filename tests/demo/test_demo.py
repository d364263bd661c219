"""The demo's data-source search order, its dry run through launch.sh, and its closing summary."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.demo import run as demo
from pretrain.demo import summary as demo_summary
from tests.support.paths import REPO_ROOT


def make_sample_data(root: Path, squad: bool = True, books: bool = True) -> Path:
    """A folder laid out like shared/data, with tiny real files."""
    (root / "wikipedia").mkdir(parents=True)
    (root / "wikipedia" / "enwiki-sample.xml.bz2").write_bytes(b"BZh9")
    (root / "wikipedia" / "notes.md").write_text("not a dump\n")
    if books:
        (root / "books" / "gutenberg").mkdir(parents=True)
        (root / "books" / "gutenberg" / "novel.txt").write_text("Call me Ishmael.\n")
        (root / "books" / "empty").mkdir()
        (root / "books" / "sample_text.txt").write_text("One sentence.\n")
    if squad:
        (root / "squad").mkdir()
        for name in (demo.SQUAD_TRAIN_NAME, demo.SQUAD_DEV_NAME):
            (root / "squad" / name).write_text(json.dumps({"version": "1.1", "data": []}))
    return root


def test_sample_data_comes_first(tmp_path: Path) -> None:
    sample = make_sample_data(tmp_path / "data")
    gensim = tmp_path / "gensim.bz2"
    source = demo.resolve_pretraining_source(sample, gensim_dump=gensim, network=True)
    assert source.kind == "sample-data"
    assert source.prep_args == (
        "--wiki-dump", str(sample / "wikipedia" / "enwiki-sample.xml.bz2"),
        "--books", str(sample / "books" / "gutenberg"),
        "--skip-bad-files",  # sample book sets may hold a non-UTF-8 book
    )  # fmt: skip
    no_books = demo.resolve_pretraining_source(sample, gensim_dump=gensim, network=True, use_books=False)
    assert "--books" not in no_books.prep_args


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: root / "absent", "is not a folder"),
        (lambda root: root, "no Wikipedia dump in"),
    ],
)
def test_a_wrong_sample_data_folder_is_an_error_not_a_fallback(tmp_path: Path, setup, message: str) -> None:
    folder = setup(tmp_path)
    with pytest.raises(demo.DemoDataError, match=message) as error:
        demo.resolve_pretraining_source(folder, gensim_dump=tmp_path / "g.bz2", network=True)
    assert str(folder) in str(error.value)


def test_then_gensim_then_hugging_face_then_a_message(tmp_path: Path) -> None:
    gensim = tmp_path / "gensim.bz2"
    assert demo.resolve_pretraining_source(None, gensim, network=True).prep_args == ("--wiki-dump", str(gensim))
    hub = demo.resolve_pretraining_source(None, None, network=True)
    assert hub.kind == "huggingface" and hub.prep_args[:2] == ("--hf-dataset", demo.HF_PRETRAINING_DATASET)
    with pytest.raises(demo.DemoDataError) as error:
        demo.resolve_pretraining_source(None, None, network=False)
    for hint in ("--sample-data", "gensim", "network"):
        assert hint in str(error.value)


def test_squad_source_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with_squad = make_sample_data(tmp_path / "a")
    local = demo.resolve_squad_source(with_squad, network=True, out_dir=out)
    assert local is not None and local.kind == "sample-data" and not local.needs_download
    assert local.dev == with_squad / "squad" / demo.SQUAD_DEV_NAME
    without_squad = make_sample_data(tmp_path / "b", squad=False)
    hub = demo.resolve_squad_source(without_squad, network=True, out_dir=out)
    assert hub is not None and hub.needs_download and hub.train.parent == out / "squad_data"
    assert demo.resolve_squad_source(without_squad, network=False, out_dir=out) is None


def test_gensim_dump_is_found_through_importlib() -> None:
    if importlib.util.find_spec("gensim") is None:  # importing gensim itself takes seconds (scipy)
        pytest.skip("gensim is not installed (pip install -e '.[demo]')")
    dump = demo.find_gensim_wiki_dump()
    assert dump is not None and dump.is_file() and dump.name.startswith("enwiki-latest-pages-articles1")


def test_offline_flags_mean_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert demo.network_available() is False


@pytest.mark.shared_data
def test_real_sample_data_layout(shared_data: Path, tmp_path: Path) -> None:
    source = demo.resolve_pretraining_source(shared_data, gensim_dump=None, network=False)
    assert source.prep_args[-1] == "--skip-bad-files"  # NLTK's Gutenberg set has a Latin-1 book
    pairs = source.prep_args[:-1]
    dumps = [Path(v) for flag, v in zip(pairs[::2], pairs[1::2], strict=True) if flag == "--wiki-dump"]
    assert any(d.name.startswith("enwiki-latest-pages-articles1") for d in dumps)
    assert ("--books", str(shared_data / "books" / "nltk_gutenberg")) == pairs[-2:]
    squad = demo.resolve_squad_source(shared_data, network=False, out_dir=tmp_path)
    assert squad is not None and squad.train.is_file() and squad.dev.is_file()


def test_demo_dry_run_prints_every_step_through_launch_sh(tmp_path: Path) -> None:
    sample = make_sample_data(tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "OMP_NUM_THREADS"}
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "demo", "--dry-run", "--sample-data", str(sample),
         "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    commands = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert any("-m data_prep build --wiki-dump" in c and "--vocab-size 8192" in c for c in commands)
    assert any("-m pretrain.launch.agent --nproc-per-node 2" in c and "--run.dir=" in c for c in commands)
    assert any("DS_ACCELERATOR=cpu" in c for c in commands)
    assert any("-m pretrain.export" in c and str(tmp_path / "out" / "run" / "checkpoints") in c for c in commands)
    finetunes = [c for c in commands if "-m pretrain.finetune.squad finetune" in c]
    assert len(finetunes) == 2 and sum("--random-init" in c for c in finetunes) == 1, finetunes
    random_out = str(tmp_path / "out" / demo_summary.RANDOM_SQUAD_DIR)
    assert all(("--random-init" in c) == (random_out in c) for c in finetunes), "the baseline writes apart"
    evaluates = [c for c in commands if "-m pretrain.finetune.squad evaluate" in c]
    assert len(evaluates) == 2 and any(random_out + "/predictions.json" in c for c in evaluates)
    reports = [c for c in commands if "-m pretrain.report" in c]
    assert len(reports) == 1 and reports[0] == commands[-1], "the demo ends with a report"
    assert reports[0].endswith(" " + str(tmp_path / "out" / "run")), reports
    exports = [c for c in commands if c.startswith("+ export")]
    assert exports and all("OMP_NUM_THREADS=1 " in c for c in exports), "the demo runs one thread per process"
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_no_data_anywhere_stops_with_a_message(tmp_path: Path) -> None:
    # `python -S` has no site-packages, so no gensim; offline; no --sample-data: nothing to use.
    env = {"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "pretrain.demo", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "no pretraining data found" in proc.stderr and "--sample-data DIR" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_summary_reads_manifest_tensorboard_and_scores(tmp_path: Path) -> None:
    # tensorboard's own writer: the same event files as torch's SummaryWriter, without importing torch.
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    manifest = {
        "vocab": {"size": 8192},
        "totals": {"documents": 120, "tokens": 50000, "documents_dropped_short": 3},
        "seq_lens": {"128": {"train": {"num_instances": 900}, "val": {"num_instances": 20}},
                     "64": {"train": {"num_instances": 1800}, "val": {"num_instances": 40}}},
    }  # fmt: skip
    (out / "data" / "manifest.json").write_text(json.dumps(manifest))
    # TensorBoard only: a phase restarts its step count, so values are taken in the order written.
    writer = EventFileWriter(str(out / "run" / "tensorboard"))
    for wall_time, (step, loss, rate) in enumerate([(1, 9.0, 5.0), (2, 7.5, 40.0), (1, 6.25, 42.0)]):
        values = [Summary.Value(tag="loss/mlm", simple_value=loss), Summary.Value(tag="perf/seq_per_s", simple_value=rate)]
        writer.add_event(Event(wall_time=1000.0 + wall_time, step=step, summary=Summary(value=values)))
    writer.close()
    evaluate = demo.Step("squad evaluate", list, output=["noise", '{"exact_match": 3.5, "f1": 7.25}'])
    rows = dict(demo_summary.summary_rows(out, [evaluate], "corpus X", "squad Y"))
    assert rows["corpus"] == "120 documents, 50,000 tokens"
    assert list(rows).index("instances @ seq 64") < list(rows).index("instances @ seq 128")
    assert rows["instances @ seq 64"] == "train 1,800, val 40"
    assert rows["tensorboard/loss/mlm"] == "9.000 (step 1) -> 6.250 (step 1)"
    assert rows["tensorboard/perf/seq_per_s (median)"] == "40"
    assert rows["SQuAD v1.1 dev"].startswith("EM 3.50  F1 7.25")
    assert "SQuAD from random weights" not in rows, "no baseline ran: no baseline row"
    published = rows["SQuAD published (full recipe)"]
    assert "90.9" in published and "90.58" in published
    table = demo_summary.render_table(list(rows.items()))
    assert "Demo summary" in table and "EM 3.50" in table
    # With the random-weights baseline: its scores and what pretraining bought, before the published figure.
    baseline = demo.Step(demo_summary.BASELINE_EVALUATE, list, output=['{"exact_match": 0.5, "f1": 2.0}'])
    names = [name for name, _ in demo_summary.summary_rows(out, [evaluate, baseline], "corpus X", "squad Y")]
    rows = dict(demo_summary.summary_rows(out, [evaluate, baseline], "corpus X", "squad Y"))
    assert rows["SQuAD from random weights"].startswith("EM 0.50  F1 2.00")
    assert "pretraining bought +5.25 F1" in rows["SQuAD from random weights"]
    assert names.index("SQuAD v1.1 dev") + 1 == names.index("SQuAD from random weights")
    assert names.index("SQuAD from random weights") + 1 == names.index("SQuAD published (full recipe)")
    worse = demo.Step(demo_summary.BASELINE_EVALUATE, list, output=['{"exact_match": 4.0, "f1": 9.0}'])
    rows = dict(demo_summary.summary_rows(out, [evaluate, worse], "corpus X", "squad Y"))
    assert "pretraining bought -1.75 F1" in rows["SQuAD from random weights"]
    assert demo_summary.squad_scores(["not json", "[1, 2]"]) is None
    # The driver's metrics.jsonl, when present, gives per-phase rows instead.
    lines = [
        {"phase": "phase1", "loss/total": 9.7, "loss/mlm": 9.0, "perf/seq_per_s": 10.0},
        {"phase": "phase1", "loss/total": 8.7, "loss/mlm": 8.0, "perf/seq_per_s": 30.0, "val/mlm_loss": 8.5},
        {"phase": "phase2", "loss/total": 8.6, "loss/mlm": 7.9, "perf/seq_per_s": 12.0},
        {"val/mlm_loss": 7.7},  # the validation after the last step carries no phase
    ]
    jsonl = "".join(json.dumps(line) + "\n" for line in lines) + '{"phase": "phase2", "loss'  # cut short
    (out / "run" / "tensorboard" / "metrics.jsonl").write_text(jsonl)
    rows = dict(demo_summary.summary_rows(out, [evaluate], "corpus X", "squad Y"))
    assert rows["phase1 steps"] == "2" and rows["phase2 steps"] == "1"
    assert rows["phase1 loss/mlm"] == "9.000 -> 8.000" and rows["phase1 val/mlm_loss"] == "8.500 (one evaluation)"
    assert rows["phase1 perf/seq_per_s (median)"] == "20.0"
    assert rows["phase2 val/mlm_loss"] == "7.700 (one evaluation)" and "run steps" not in rows
    assert "tensorboard/loss/mlm" not in rows
    # What the run trained, from its config.resolved.json (a run before the key trained MLM + NSP)
    assert "objective" not in rows
    resolved = {"resolved": {"objective": "mlm", "segments": "full-sentences", "mask_probability": {"phase1": 0.3}}}
    (out / "run" / "config.resolved.json").write_text(json.dumps(resolved))
    clock = {"format": 1, "targets": {}, "processes": [  # 4 steps of 2 s in a 10 s process, step 1 start-up
        {"started_at": 0.0, "ranks": 2, "seconds": 10.0, "first_step": 1, "last_step": 4, "steps": 4, "step_seconds": 8.0}]}
    (out / "run" / "run_clock.json").write_text(json.dumps(clock))
    rows = dict(demo_summary.summary_rows(out, [evaluate], "corpus X", "squad Y"))
    assert rows["objective"] == "masked-LM alone (no NSP) on full-sentences inputs, 30% of the tokens masked"
    assert rows["goodput"] == "60.0% over 1 process(es)"


@pytest.mark.shared_data
def test_launch_sh_runs_the_squad_scorer_and_the_demo_reads_its_output(shared_data: Path) -> None:
    squad = shared_data / "squad"
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "squad", "evaluate", str(squad / demo.SQUAD_DEV_NAME),
         str(squad / "predictions" / "BERT.dev-v1.1.predictions.json")],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("+ ") and "-m pretrain.finetune.squad evaluate" in proc.stdout.splitlines()[0]
    scores = demo_summary.squad_scores(proc.stdout.splitlines())
    assert scores is not None and 70.0 < scores["exact_match"] < scores["f1"] <= 100.0


def test_a_background_step_runs_beside_the_next_and_is_collected(tmp_path: Path) -> None:
    """The random-weights fine-tune runs on the core the other fine-tune leaves idle: started, not waited
    for, then collected with its output and time; a failure stops the demo naming the log."""
    from pretrain.demo.steps import Step, finish_background, run_step

    marker, release = tmp_path / "foreground-ran", tmp_path / "release"
    # The background step waits for an event only the test makes after run_step has returned: were
    # run_step to wait for it, the step would give up (after 120 s) and print so instead.
    waiter = (f"import os, time\nfor _ in range(1200):\n    if os.path.exists({str(release)!r}): break\n"
              f"    time.sleep(0.1)\nprint('released' if os.path.exists({str(release)!r}) else 'gave up')")
    slow = Step("slow", lambda: [sys.executable, "-c", waiter], background=True)
    run_step(slow, tmp_path / "logs", dry_run=False)
    assert slow.process is not None and slow.process.poll() is None, "it must not block"
    touch = f"open({str(marker)!r}, 'w').close()"
    run_step(Step("fast", lambda: [sys.executable, "-c", touch]), tmp_path / "logs", dry_run=False)
    assert marker.exists() and slow.process.poll() is None, "the next step ran while the background one did"
    release.touch()
    finish_background(slow, tmp_path / "logs")
    assert slow.output == ["released"] and slow.seconds > 0 and slow.process is None
    failing = Step("bad one", lambda: [sys.executable, "-c", "raise SystemExit(4)"], background=True)
    run_step(failing, tmp_path / "logs", dry_run=False)
    with pytest.raises(SystemExit, match=r"step 'bad one' failed \(exit 4\); its log: .*bad_one.log"):
        finish_background(failing, tmp_path / "logs")
