"""Input shards as the unit of work (docs/data_prep.md#scale): the same bytes from every executor, NSP within its
shard's pool group, each input file read by one task, work/ files per shard and not per chunk, kills and relaunches that
cost only their task, and the refusals of a changed input.

One corpus serves every test: three `--text` files whose documents use disjoint words (file g only
`wG...` words), each file an input shard of its own (`--input-shard-mb` above a file, below two), cut with shuffle
buckets of 50 instances in the keyed order (data_prep/keyed_order.py: recorded in the folder before the build, as
a build over 2^24 instances of a length records its own before its instance tasks), so that the matrix crosses
several input shards and several buckets, and its instance files are grouped by bucket as they are made. One
build in the scatter order (the record an earlier version wrote) shows that a folder begun with it keeps it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import data_prep.instance_stage as instance_stage
import data_prep.keyed_order as keyed_order
import data_prep.sources as sources
from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.bucket_stage import bucket_sizes, keyed_orders
from data_prep.keyed_order import ORDER_KEYED
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.shards import Manifest
from data_prep.shard_stage import ShardTask, gather_rows, part_starts, shard_ends, shard_plan
from tests.data_prep.input_shard_corpus import (
    BUCKET,
    GROUPS,
    SEQ_LENS,
    python_m,
    rows,
    run,
    seed_folder,
    shard_digests,
    shard_of_tokens,
    submit,
    wait_for_jobs,
    write_corpus,
)
from tests.support.cluster.local_cluster import LocalSlurm, running_or_skip
from tests.support.data_prep_fixtures import tree_digest
from tests.support.paths import REPO_ROOT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], Path]:
    """The flags, and the reference: a plain build, one worker, in this process, its instance files written in
    runs of a few KB, 16 rows handed over at a time (keyed_order.RUN_BYTES: several runs of every bucket per file; the executors, in their own
    processes, write one run per file: no byte may depend on it)."""
    root = tmp_path_factory.mktemp("input_shards")
    flags = write_corpus(root / "inputs")
    identity = config_from_args(build_parser().parse_args(["build", *flags, "--out", "x"])).identity()
    atomic_write_json(root / "identity.json", identity)
    reference = root / "reference"
    seed_folder(reference, root / "identity.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keyed_order, "RUN_BYTES", 4096)
        patch.setattr(instance_stage, "BATCH_ROWS", 16)  # instances handed to the writer 16 at a time
        assert main(["build", *flags, "--out", str(reference), "--workers", "1"]) == 0
    return flags, reference


@pytest.fixture(scope="module")
def scatter_reference(corpus, tmp_path_factory) -> Path:
    """The same build in a folder holding the scatter order's record (begun by the version before the keyed
    order): it keeps that order, its instance files in the order made, its scatter files and markers."""
    flags, reference = corpus
    out = tmp_path_factory.mktemp("scatter_order") / "out"
    seed_folder(out, reference / "build_config.json", order=None)
    assert main(["build", *flags, "--out", str(out), "--workers", "1"]) == 0
    return out


def test_reference_crosses_shards_and_buckets(corpus) -> None:
    _, reference = corpus
    plan = json.loads((reference / "work" / "plan.json").read_text(encoding="utf-8"))
    assert len(plan["shards"]) == GROUPS
    manifest = Manifest.load(reference)
    for seq_len in SEQ_LENS:
        count = manifest.data["seq_lens"][seq_len]["train"]["num_instances"]
        assert count > 2 * BUCKET, "the matrix must cross buckets"


def test_scattered_buckets_give_the_bucketed_order(scatter_reference) -> None:
    """A folder begun with the scatter order keeps it: its train shards, made by scattering each input shard into
    buckets and gathering each output shard from the buckets it spans, equal that order computed whole
    (shard_stage.shard_plan) over the instance files: the same rows in the same order."""
    reference = scatter_reference
    manifest = Manifest.load(reference)
    for seq_len in SEQ_LENS:
        count = manifest.data["seq_lens"][seq_len]["train"]["num_instances"]
        plan = shard_plan(count, 3, 5, int(seq_len), "train", BUCKET)
        for k, shard_rows in enumerate(plan):
            expected = gather_rows(ShardTask(reference, int(seq_len), "train", GROUPS, k, shard_rows))
            built = ipc.open_file(pa.memory_map(str(reference / f"seq{seq_len}" / f"train-{k:05d}.arrow"))).read_all()
            assert built.equals(expected), (seq_len, k)
        sizes = bucket_sizes(reference, int(seq_len), "train", GROUPS)
        assert sizes.shape == (GROUPS, -(-count // BUCKET)) and sizes.sum() == count
    part_starts.cache_clear()


def test_keyed_buckets_give_the_keyed_order(corpus, scatter_reference) -> None:
    """The reference's train shards, gathered bucket by bucket from instance files grouped when they were made,
    equal the keyed order computed whole (bucket_stage.keyed_orders: the bucket of each (input shard, index) and
    each bucket's shuffle) applied to the same instances in the order made (the scatter-order build's files:
    the instances do not depend on the order). No scatter ran; the files hold several runs of every bucket."""
    _, reference = corpus
    manifest = Manifest.load(reference)
    assert not (reference / "work" / "buckets").exists() and not list((reference / "work" / "done").glob("scatter-*"))
    for seq_len in SEQ_LENS:
        count = manifest.data["seq_lens"][seq_len]["train"]["num_instances"]
        record = json.loads((reference / "work" / "shards" / f"seq{seq_len}-train-order.json").read_text())
        buckets = record["buckets"]
        assert record["order"] == ORDER_KEYED and buckets >= -(-count // BUCKET), record  # B from the estimate
        counts = [json.loads((reference / "work" / "done" / f"instances-seq{seq_len}-{s:05d}.json").read_text())
                  for s in range(GROUPS)]
        assert [sum(c["train_buckets"]) for c in counts] == [c["train_instances"] for c in counts]
        runs = ipc.open_file(pa.memory_map(str(reference / "work" / "instances" / f"seq{seq_len}"
                                               / "shard-00000-train.arrow"))).num_record_batches / buckets
        assert runs == int(runs) and runs > 1, runs
        order = np.concatenate(list(keyed_orders([c["train_instances"] for c in counts], 5, int(seq_len), "train",
                                                 buckets)))
        assert np.array_equal(np.sort(order), np.arange(count))
        ends = [0, *shard_ends(count, 3)]
        for k in range(3):
            expected = gather_rows(ShardTask(scatter_reference, int(seq_len), "train", GROUPS, k,
                                             order[ends[k] : ends[k + 1]]))
            built = ipc.open_file(pa.memory_map(str(reference / f"seq{seq_len}" / f"train-{k:05d}.arrow"))).read_all()
            assert built.equals(expected), (seq_len, k)
        assert not (reference / "work" / "shards" / f"seq{seq_len}-val-order.json").exists()  # val: one bucket
    part_starts.cache_clear()


@pytest.mark.parametrize("executor", ["3 workers", "2 nodes x 2 workers", "dead node finished by merge"])
def test_every_executor_gives_the_same_bytes(executor: str, corpus, tmp_path: Path) -> None:
    """Without --keep-work (unlike the reference): the same bytes, and work/ removed once the manifest is written.
    Two nodes started together run every stage's tasks between them (the merge only writes the manifest)."""
    flags, reference = corpus
    flags = [f for f in flags if f != "--keep-work"]
    out = tmp_path / "out"
    seed_folder(out, reference / "build_config.json")
    if executor == "3 workers":
        assert run(python_m("build", *flags, "--out", str(out), "--workers", "3")).returncode == 0
    elif executor.startswith("2 nodes"):  # started together: each runs its share of every stage
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        nodes = [subprocess.Popen(python_m("build", *flags, "--out", str(out), "--workers", "2", "--num-nodes", "2",
                                           "--node-rank", str(rank)), cwd=REPO_ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
        logs = [node.communicate(timeout=600)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], logs
        gathers = sorted(p.name for p in (out / "work" / "done").glob("gather-*.json"))
        assert len(gathers) == len(SEQ_LENS) * (3 + 1), gathers  # every output shard cut by a node, none left
        assert all("stage instances" in log and "stage shards" in log for log in logs), logs
        merged = run(python_m("merge", "--out", str(out), "--workers", "2"))
        assert merged.returncode == 0, merged.stderr
        assert "not done, running them here" not in merged.stdout
    else:  # node 1 never ran: node 0 does not wait for it, the merge does its shard (the middle one), and says so
        done = run(python_m("build", *flags, "--out", str(out), "--workers", "2", "--num-nodes", "2",
                            "--node-rank", "0", "--node-wait", "0"))
        assert done.returncode == 0, done.stderr
        assert "1 corpus task(s) not finished by other nodes" in done.stdout
        merged = run(python_m("merge", "--out", str(out), "--workers", "2"))
        assert merged.returncode == 0, merged.stderr
        assert "1 of 3 input shard(s) not done, running them here: [1]" in merged.stdout
    assert shard_digests(out) == shard_digests(reference)
    assert tree_digest(out) == tree_digest(reference)
    assert not list(out.rglob("*.tmp"))
    assert not (out / "work").exists()


def test_nsp_draws_within_the_pool_group(corpus, tmp_path: Path) -> None:
    """The default build draws within the input shard's pool, here widened (data_prep/nsp_pool.py): a shard holds
    ~36 train documents, under NSP_POOL_DOCUMENTS, so shard 0 draws from shards 0-1, shards 1 and 2 from 1-2;
    no instance mixes shards 0 and 2. `--nsp-scope corpus` mixes them all, with the same random-next fraction
    (+-0.02; ten passes, ~2,800 instances at 32, so that sampling noise stays ~0.01)."""
    flags, _ = corpus
    builds = {}
    for scope in ("shard", "corpus"):
        builds[scope] = tmp_path / scope
        assert main(["build", *flags, "--out", str(builds[scope]), "--workers", "1", "--nsp-scope", scope,
                     "--dupe-factor", "10"]) == 0
    for seq_len in SEQ_LENS:
        own = [shard_of_tokens(ids) for ids in rows(builds["shard"], seq_len)["input_ids"]]
        assert not any({0, 2} <= groups for groups in own)
        assert sum(groups == {0, 1} for groups in own) > 0  # the group is wider than the shard
        mixed = rows(builds["corpus"], seq_len)
        crossing = sum(len(shard_of_tokens(ids)) > 1 for ids in mixed["input_ids"])
        assert crossing > len(mixed["input_ids"]) // 4  # the test could fail: the corpus pool crosses shards
        fractions = [Manifest.load(out).data["seq_lens"][seq_len]["train"]["nsp_random_fraction"]
                     for out in builds.values()]
        assert abs(fractions[0] - fractions[1]) <= 0.02, fractions
    assert json.loads((builds["corpus"] / "build_config.json").read_text())["nsp_scope"] == "corpus"
    assert "nsp_scope" not in json.loads((builds["shard"] / "build_config.json").read_text())


def test_each_input_file_is_read_by_one_task(corpus, tmp_path: Path, monkeypatch) -> None:
    """In-process (one worker, so the readers run here; a spy where the reader opens its file): node 0 of 2 opens only its shards' files (0 and 2), the
    merge only the one it finishes, and over the build every file is read exactly once."""
    flags, _ = corpus
    opened: list[str] = []
    real_lines = sources.file_lines  # how the --text reader opens a file or a range of one
    monkeypatch.setattr(sources, "file_lines", lambda path, *span: (opened.append(Path(path).name),
                                                                      real_lines(path, *span))[1])
    out = tmp_path / "out"
    assert main(["build", *flags, "--out", str(out), "--workers", "1", "--num-nodes", "2", "--node-rank", "0",
                 "--node-wait", "0"]) == 0
    assert opened == ["part0.txt", "part2.txt"]
    assert main(["merge", "--out", str(out), "--workers", "1", "--keep-work"]) == 0
    assert opened == ["part0.txt", "part2.txt", "part1.txt"]
    clean = [json.loads((out / "work" / "done" / f"clean-{s:05d}.json").read_text()) for s in range(GROUPS)]
    assert [[Path(f).name for f in c["input_files"]] for c in clean] == [["part0.txt"], ["part1.txt"], ["part2.txt"]]


def test_work_files_follow_shards_not_chunks(corpus, tmp_path: Path) -> None:
    """A chunk of 2 documents instead of 8 (four times the chunks): the same files in work/, and as many as
    the input shards and lengths make."""
    flags, reference = corpus
    small = tmp_path / "small-chunks"
    at = flags.index("--docs-per-chunk") + 1
    assert main(["build", *flags[:at], "2", *flags[at + 1 :], "--out", str(small), "--workers", "1"]) == 0
    names = {p.relative_to(reference / "work").as_posix() for p in (reference / "work").rglob("*") if p.is_file()}
    small_names = {p.relative_to(small / "work").as_posix() for p in (small / "work").rglob("*") if p.is_file()}
    bucketed = {n for n in names if n.startswith(("buckets/", "done/scatter-", "shards/"))}  # the reference's buckets
    assert len(bucketed) == len(SEQ_LENS)  # an order record per length (train): no scatter file or marker
    assert small_names == names - bucketed
    per_shard = 2 + 2 + len(SEQ_LENS) * 3  # text + tokens, their markers; per length two splits + a marker
    gathers = len(SEQ_LENS) * (3 + 1)  # a marker per output shard (3 train, 1 val per length)
    assert len(small_names) == 1 + GROUPS * per_shard + gathers  # + the plan


def test_kill_in_each_stage_then_relaunch(corpus, tmp_path: Path) -> None:
    """SIGKILL when the first task of a stage has finished (corpus, instances, the last instance task, shards); the
    same command then finishes with the reference's bytes, no temp file, and one marker per task."""
    flags, reference = corpus
    waits = ["work/done/tokens-00000.json", "work/done/instances-seq32-00000.json",
             "work/done/instances-seq64-00002.json", "seq32/train-00000.arrow"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for stage, first_done in enumerate(waits):
        for attempt in range(3):  # the kill races the build's last steps: a build that won is tried again
            out = tmp_path / f"killed-{stage}-{attempt}"
            seed_folder(out, reference / "build_config.json")
            command = python_m("build", *flags, "--out", str(out), "--workers", "1")
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while not (out / first_done).exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            process.send_signal(signal.SIGKILL)
            process.wait()
            if process.returncode == -signal.SIGKILL and not (out / "manifest.json").exists():
                break
        else:
            pytest.fail(f"{first_done}: the build finished before the kill, three times")
        again = run(command)
        assert again.returncode == 0, again.stderr
        assert tree_digest(out) == tree_digest(reference)
        assert not list(out.rglob("*.tmp"))
        gathers = len(SEQ_LENS) * (3 + 1)  # a marker per output shard: 3 train, 1 val per length
        assert len(list((out / "work" / "done").glob("*.json"))) == GROUPS * (2 + len(SEQ_LENS)) + gathers


def test_a_changed_input_or_unit_is_refused_naming_it(corpus, tmp_path: Path, capsys) -> None:
    flags, reference = corpus
    out = tmp_path / "out"
    assert main(["build", *flags, "--out", str(out), "--workers", "1", "--num-nodes", "2", "--node-rank", "0",
                 "--node-wait", "0"]) == 0
    changed = Path(flags[flags.index("--text") + 1])
    stat = changed.stat()
    try:
        os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        capsys.readouterr()
        assert main(["merge", "--out", str(out), "--workers", "1"]) == 2
        assert f"--text {changed}: changed since the build began (mtime_ns" in capsys.readouterr().err
    finally:
        os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    other_unit = [*flags[: flags.index("--input-shard-mb") + 1], "0.5", *flags[flags.index("--input-shard-mb") + 2 :]]
    assert main(["build", *other_unit, "--out", str(out), "--workers", "1"]) == 2
    assert f"input_shard_mb: {float(flags[flags.index('--input-shard-mb') + 1])} -> 0.5" in capsys.readouterr().err
    old = tmp_path / "old"
    (old / "work" / "text").mkdir(parents=True)
    (old / "work" / "text" / "part-00000.arrow").write_bytes(b"")
    assert main(["build", *flags, "--out", str(old), "--workers", "1"]) == 2
    assert "begun by an earlier data_prep" in capsys.readouterr().err


@pytest.fixture(scope="module")
def slurm():
    yield from running_or_skip(LocalSlurm(), "local SLURM")


def test_slurm_arrays_give_the_same_bytes_and_rerun_only_what_is_missing(corpus, slurm, tmp_path: Path) -> None:
    """A real (local) SLURM: the corpus array, then the instances, scatter (nothing to do in the keyed order) and
    gather arrays, the merge last; the reference's bytes. A relaunch after completion submits nothing; one instance task lost (its files and
    marker, as a failed element leaves it) and the shards of its length are the only elements of the next
    submission, and the bytes come back."""
    flags, reference = corpus
    out = tmp_path / "out"
    seed_folder(out, reference / "build_config.json")
    first = submit(slurm, flags, out)
    assert first.returncode == 0, first.stderr
    assert [line.split(":")[0] for line in first.stdout.splitlines() if line.startswith("submitted")] == [
        "submitted corpus", "submitted instances", "submitted scatter", "submitted gather", "submitted merge"]
    elements = [line.split(" (", 1)[1] for line in first.stdout.splitlines() if line.startswith("submitted")]
    assert elements == ["3 element(s))", "6 element(s))", "6 element(s))", "8 element(s))", "one job)"]
    wait_for_jobs(slurm, out)
    assert tree_digest(out) == tree_digest(reference)
    again = submit(slurm, flags, out)
    assert again.returncode == 0 and "already complete (same config); nothing to submit" in again.stdout

    lost = 1 * len(SEQ_LENS) + 1  # task of shard 1 at the second length
    for path in [out / "manifest.json", *out.glob("seq64/*.arrow"), *out.glob("work/instances/seq64/shard-00001-*"),
                 out / "work" / "done" / "instances-seq64-00001.json"]:
        path.unlink()
    printed = submit(slurm, flags, out, "--print-sbatch")
    assert printed.returncode == 0 and "corpus.sbatch" not in printed.stdout
    assert f"#SBATCH --array={lost}\n" in printed.stdout and "merge.sbatch" in printed.stdout
    assert "gather.sbatch" in printed.stdout and "#SBATCH --array=4-7\n" in printed.stdout  # seq64's shards
    rerun = submit(slurm, flags, out)
    assert rerun.returncode == 0 and "submitted instances" in rerun.stdout and "(1 element(s))" in rerun.stdout
    wait_for_jobs(slurm, out)
    gathered = sorted(p.name for p in (out / "work" / "slurm").glob("gather-*.log"))
    assert gathered, "the gathers ran as array elements, not inside the merge job"
    assert tree_digest(out) == tree_digest(reference)
    assert not list(out.rglob("*.tmp"))


def test_relative_paths_and_a_touched_input_after_completion(corpus, tmp_path: Path, monkeypatch, capsys) -> None:
    """The merge rebuilds the config from build_config.json (paths resolved): a build given relative paths must
    plan the same files. A complete folder stays complete when an input is touched afterwards."""
    flags, reference = corpus
    below = tmp_path / "cwd"
    below.mkdir()
    monkeypatch.chdir(below)  # paths with `..`: absolute but not resolved, they would name other files
    relative = [os.path.relpath(f) if f.endswith(".txt") else f for f in flags]
    assert all(f.startswith("../") for f in relative if f.endswith(".txt"))
    out = tmp_path / "out"
    assert main(["build", *relative, "--out", str(out), "--workers", "1", "--num-nodes", "2", "--node-rank", "0",
                 "--node-wait", "0"]) == 0
    assert main(["merge", "--out", str(out), "--workers", "1"]) == 0
    touched = Path(flags[flags.index("--text") + 1])
    stat = touched.stat()
    try:
        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        capsys.readouterr()
        assert main(["build", *flags, "--out", str(reference), "--workers", "1"]) == 0
        assert "already complete (same config); nothing to do" in capsys.readouterr().out
    finally:
        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_cancelled_array_element_fails_its_stage_and_the_relaunch_runs_it(corpus, slurm, tmp_path: Path) -> None:
    """Submitted held; corpus element 1 cancelled, then everything released: the instances and merge jobs end
    with it (their dependency can never be met) instead of pending forever. The same command then submits
    corpus element 1 alone, every instance task and the merge, and the bytes are the reference's."""
    flags, reference = corpus
    out = tmp_path / "out"
    seed_folder(out, reference / "build_config.json")
    held = submit(slurm, flags, out, "--sbatch-arg=--hold")
    assert held.returncode == 0, held.stderr
    ids = dict(line.removeprefix("submitted ").split(": job ")[0:2] for line in held.stdout.splitlines()
               if line.startswith("submitted "))
    ids = {name: value.split()[0] for name, value in ids.items()}
    slurm.command("scancel", f"{ids['corpus']}_1")
    for name in ("corpus", "instances", "scatter", "gather", "merge"):
        slurm.command("scontrol", "release", ids[name])
    wait_for_jobs(slurm, out)
    done = out / "work" / "done"
    assert sorted(p.name for p in done.glob("tokens-*.json")) == ["tokens-00000.json", "tokens-00002.json"]
    assert not list(done.glob("instances-*.json")) and not (out / "manifest.json").exists()
    again = submit(slurm, flags, out)
    assert again.returncode == 0, again.stderr
    assert "submitted corpus" in again.stdout and "(1 element(s))" in again.stdout and "(6 element(s))" in again.stdout
    wait_for_jobs(slurm, out)
    assert tree_digest(out) == tree_digest(reference)
