"""The shard stage as tasks outside `merge` (data_prep/shard_tasks.py, stage_runs.py, array_tasks.py,
slurm_settings.py): every task of every stage run by hand in shuffled order, as SLURM array elements would, cuts
every output shard before the merge, which then only writes the manifest (the reference's bytes, no shard written
again); a shard cut short after its gather is redone alone; the scripts carry the throttle and each stage's
resources; a node's barrier waits while other nodes finish tasks and gives up when none does; bad settings are one
line. In-process, on the small segment corpus cut into several input shards, with small shuffle buckets recorded
in the keyed order (the instance tasks group their files by bucket; the scatter tasks have nothing to do)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from data_prep.__main__ import main
from data_prep.keyed_order import ORDER_KEYED
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_stage import BUCKET_INSTANCES
from data_prep.shard_tasks import SplitOrder, StageSettings, gather_tasks, with_rows
from data_prep.stage_runs import Share, wait_for
from tests.data_prep.segment_inputs import build, write_inputs

FLAGS = ["--seq-lens", "48", "--num-shards", "3", "--val-fraction", "0.1", "--docs-per-chunk", "8",
         "--input-shard-mb", "0.01"]
BUCKET = 20  # instances per shuffle bucket, recorded before the instance stage (train; val stays one bucket)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("shard_tasks"))


def start(corpus: Path, out: Path, *extra: str) -> None:
    """The folder as `build --slurm --print-sbatch` leaves it (config, plan), small buckets recorded."""
    assert build(corpus, out, *FLAGS, "--slurm", "--print-sbatch", *extra) == 0
    atomic_write_json(out / "work" / "shards" / "seq48-train-order.json",
                      {"order": ORDER_KEYED, "bucket_instances": BUCKET})


def task(out: Path, stage: str, index: int) -> int:
    return main(["task", stage, "--out", str(out), "--index", str(index), "--workers", "1"])


def shard_files(out: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / "seq48").glob("*.arrow"))}


def test_array_tasks_cut_every_shard_before_the_merge(corpus: Path, tmp_path: Path, capsys) -> None:
    reference = tmp_path / "reference"
    start(corpus, reference)
    assert build(corpus, reference, *FLAGS, "--workers", "1") == 0

    out = tmp_path / "tasks"
    capsys.readouterr()
    start(corpus, out, "--array-throttle", "2", "--stage-mem", "gather=2G", "--stage-time", "instances=1:00:00",
          "--stage-cpus", "scatter=2")
    printed = capsys.readouterr().out
    scripts = {block.split(".sbatch")[0].rsplit("/", 1)[1]: block for block in printed.split("# ")[1:]}
    assert sorted(scripts) == ["corpus", "gather", "instances", "merge", "scatter"]
    assert "#SBATCH --array=0-3%2\n" in scripts["gather"] and "#SBATCH --mem=2G\n" in scripts["gather"]
    assert "#SBATCH --time=1:00:00\n" in scripts["instances"] and "--mem" not in scripts["instances"]
    assert "#SBATCH --cpus-per-task=2\n" in scripts["scatter"] and "%2\n" in scripts["corpus"]
    assert "#SBATCH --cpus-per-task=1\n" in scripts["merge"] and "merge --out" in scripts["merge"]  # the manifest only
    shards = len(json.loads((out / "work" / "plan.json").read_text(encoding="utf-8"))["shards"])
    assert shards >= 3, "the corpus must be several input shards"

    rng = random.Random(4)
    assert task(out, "gather", 0) == 2  # nothing to cut from yet: says which stage runs first
    assert "not cleaned and tokenized yet" in capsys.readouterr().err
    for stage, count in (("corpus", shards), ("instances", shards), ("scatter", shards), ("gather", 3 + 1)):
        for index in rng.sample(range(count), count):
            assert task(out, stage, index) == 0, (stage, index)
    assert not (out / "work" / "buckets").exists() and not list((out / "work" / "done").glob("scatter-*"))
    markers = [json.loads(p.read_text()) for p in sorted((out / "work" / "done").glob("instances-seq48-*.json"))]
    assert len(markers) == shards and all(len(m["train_buckets"]) > 1 and "val_buckets" not in m for m in markers)
    gathered = sorted(p.name for p in (out / "work" / "done").glob("gather-*.json"))
    assert gathered == [*(f"gather-seq48-train-{k:05d}.json" for k in range(3)), "gather-seq48-val-00000.json"]
    before = shard_files(out)
    assert len(before) == 4 and not (out / "manifest.json").exists()

    cut = out / "seq48" / "train-00001.arrow"  # cut short after its gather: the merge redoes it alone
    cut.write_bytes(cut.read_bytes()[:100])
    assert main(["merge", "--out", str(out), "--workers", "1"]) == 0
    assert "gather-seq48-train-00001.json" in capsys.readouterr().out  # its marker dropped, naming it
    after = shard_files(out)
    assert {name for name in before if after[name] != before[name]} == {"train-00001.arrow"}
    assert (out / "manifest.json").read_bytes() == (reference / "manifest.json").read_bytes()
    assert not (out / "work" / "done").exists()  # the gathers' markers removed with the rest of work/


def test_a_node_waits_while_others_finish_tasks(tmp_path: Path, capsys) -> None:
    markers = [tmp_path / f"m{i}.json" for i in range(3)]
    markers[0].write_text("{}")
    made = iter(markers[1:])

    def sleep(_: float) -> None:  # another node finishes one task per poll
        next(made).write_text("{}")

    assert wait_for(markers, 5, "instance", sleep=sleep)
    assert "waiting for 2 instance task(s)" in capsys.readouterr().out
    late = tmp_path / "never.json"
    assert not wait_for([late, markers[0]], 0, "scatter", sleep=lambda _: pytest.fail("no wait at 0"))
    assert "1 scatter task(s) not finished by other nodes (e.g. never.json)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--slurm", "--stage-cpus", "shards=2"], "--stage-cpus shards=...: unknown stage"),
    (["--slurm", "--stage-mem", "gather=lots"], "--stage-mem gather=lots: expected a size"),
    (["--slurm", "--stage-time", "merge=soon"], "--stage-time merge=soon: expected a SLURM time"),
    (["--slurm", "--stage-cpus", "corpus"], "--stage-cpus corpus: expected STAGE=VALUE"),
    (["--slurm", "--array-throttle", "0"], "--array-throttle 0: must be at least 1"),
    (["--array-throttle", "4"], "go with --slurm"),
    (["--node-wait", "-1"], "--node-wait -1.0: out of range"),
])
def test_bad_settings_are_one_line(flags: list[str], message: str, corpus: Path, tmp_path: Path, capsys) -> None:
    assert build(corpus, tmp_path / "out", *FLAGS, "--print-sbatch" if "--slurm" in flags else "--workers", *(
        [] if "--slurm" in flags else ["1"]), *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_planner_hands_each_share_its_rows_of_the_one_permutation() -> None:
    """Within one bucket the pool's planner cuts the split's permutation once and gives each task its rows
    (a task of an array element draws the permutation itself): node 1 of 2 gets shards 1 and 3 of 5, the rows
    of the single permutation every earlier build drew."""
    settings = StageSettings(Path("unused"), 1, (48,), 5, (("train", 5), ("val", 1)))
    orders = {(48, "train"): SplitOrder(1000, 0, BUCKET_INSTANCES), (48, "val"): SplitOrder(0, 0, BUCKET_INSTANCES)}
    tasks = list(with_rows(Share(2, 1).of(gather_tasks(settings, orders))))
    assert [(t.split, t.index) for t in tasks] == [("train", 1), ("train", 3)]  # val has no instances: no task
    expected = np.array_split(np.random.default_rng([5, 48, 0]).permutation(1000), 5)
    for task in tasks:
        assert task.rows is not None and np.array_equal(task.rows, expected[task.index])
