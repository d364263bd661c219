"""The build: check inputs, plan the input shards, run the stages (tasks with markers), write the manifest last.

Every stage is a set of tasks over input shards (data_prep/input_plan.py); a task writes its files atomically
and then its marker (data_prep/work_layout.py), and whoever runs the build next runs only the tasks without
one. So the executors differ only in who runs which task:

* one machine: `build` runs every task in its pool;
* several machines: `build --num-nodes N --node-rank r` cleans and tokenizes the input shards s with
  s % N == r (reading only their files), then runs its share of the instance tasks, of the scatters and of the
  gathers, each after a barrier on the markers of the stage before (data_prep/stage_runs.py); `merge` runs
  whatever no node finished (a dead node's share) and writes the manifest;
* SLURM arrays (data_prep/slurm_arrays.py): one array element per task of every stage, then `merge`.

The output is the same bytes whichever runs it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from data_prep import __version__
from data_prep.build_errors import BuildError, FolderComplete
from data_prep.config import NSP, BuildConfig, ConfigError
from data_prep.corpus_index import corpus_index, count_held_out, missing_corpus_shards
from data_prep.corpus_stage import corpus_sentences, prepare_vocab, run_corpus_tasks
from data_prep.input_plan import InputPlan, PlanError, ensure_plan, load_plan, make_plan
from data_prep.instance_stage import nsp_pool_report
from data_prep.parallel import Workers
from data_prep.report import print_summary
from data_prep.shard_format.atomic_io import atomic_write_json, fsync_folder, sha256_file
from data_prep.shard_format.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from data_prep.shard_format.vocab import Vocab, load_vocab
from data_prep.shard_tasks import StageSettings, seq_entry
from data_prep.source_files import SourceError
from data_prep.sources import SOURCES
from data_prep.stage_runs import run_instances, run_node_share, run_shard_stage
from data_prep.task_markers import drop_broken_markers
from data_prep.tokenizer_files import write_tokenizer_files
from data_prep.work_cleanup import remove_stale_temp_files, remove_work, report_self_draws
from data_prep.work_layout import CONFIG_NAME, VOCAB_NAME, chunk_layout_files, plan_path, shard_file


def check_inputs(cfg: BuildConfig, remove_temp: bool = True) -> InputPlan:
    """Everything that can be checked before hours of work: files, source options, vocab, the output folder;
    then the plan of input shards (recorded, or checked against the inputs when the folder has one)."""
    unknown = sorted({name for name, _ in cfg.inputs} - {row.field for row in SOURCES})
    if unknown:
        raise BuildError(f"unknown input kind(s) {', '.join(unknown)}: not a row of data_prep/sources.py SOURCES")
    for row in SOURCES:
        values = cfg.input_values(row.field)
        for option in row.options:
            value = cfg.input_option(option.field, option.default)
            if values and option.valid is not None and not option.valid(value):
                raise ConfigError(f"{option.flag} {value}: out of range")
        for value in values:
            row.check(value, cfg.skip_bad_files)
    if cfg.vocab is not None:
        load_vocab(cfg.vocab)
    claim_output_folder(cfg, remove_temp)
    if (cfg.out_dir / MANIFEST_NAME).is_file():  # complete: reported so even if an input was touched since
        return load_plan(cfg.out_dir) if plan_path(cfg.out_dir).is_file() else make_plan(cfg)
    try:
        return ensure_plan(cfg)
    except PlanError as err:
        raise BuildError(str(err)) from err


def claim_output_folder(cfg: BuildConfig, remove_temp: bool = True) -> None:
    """Record the config in OUT, or refuse when OUT holds the output of another config. `remove_temp`: a
    single-node build removes the temp files a killed run left (not `--slurm`: its tasks may be running)."""
    out = cfg.out_dir
    identity = cfg.identity()
    recorded = out / CONFIG_NAME
    old_layout = chunk_layout_files(out)
    if old_layout and not (out / MANIFEST_NAME).is_file():
        raise BuildError(
            f"--out {out}: begun by an earlier data_prep, which cut the work into chunk parts ({old_layout[0]}); "
            "its chunks and NSP pool differ from this version's input shards: finish it with that version, or "
            "delete the folder to rebuild"
        )
    if recorded.is_file():
        previous = json.loads(recorded.read_text(encoding="utf-8"))
        if previous == identity and cfg.num_nodes == 1 and remove_temp:
            remove_stale_temp_files(out)
        if previous != identity:
            # An identity without `segments` is nsp (config.identity): name it so, not None.
            before, after = {"segments": NSP, **previous}, {"segments": NSP, **identity}
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            details = ", ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed)
            raise BuildError(
                f"--out {out}: holds shards of a different config ({details}); "
                "use another --out, or delete the folder to rebuild"
            )
        return
    # Nodes of a multi-node build start together on a shared OUT: they all write the same
    # config (atomically), so a folder that another node has just started is not foreign.
    if cfg.num_nodes == 1 and out.is_dir() and any(out.iterdir()):
        raise BuildError(f"--out {out}: not empty and not made by `data_prep build`; use an empty or new folder")
    atomic_write_json(recorded, identity)


def prepare_corpus(cfg: BuildConfig, plan: InputPlan, shards: list[int], workers: Workers) -> None:
    """Clean and tokenize `shards` (those not done) as corpus tasks, W at a time (corpus_stage.run_corpus_tasks).
    A vocab trained here needs every shard cleaned first (which is why several nodes need a given --vocab):
    then every shard's clean part runs first, then the vocab, then the tokenize parts."""
    trains_vocab = cfg.vocab is None and not (cfg.out_dir / VOCAB_NAME).is_file()
    if trains_vocab:
        started = time.perf_counter()
        cpu = run_corpus_tasks(cfg, plan, list(range(plan.num_shards)), None, workers)
        print(f"stage clean: {time.perf_counter() - started:.1f}s{cpu_seconds(cpu)}", flush=True)
    started = time.perf_counter()
    vocab = prepare_vocab(cfg, plan.num_shards)
    print(f"stage vocab: {time.perf_counter() - started:.1f}s", flush=True)
    started = time.perf_counter()
    cpu = run_corpus_tasks(cfg, plan, shards, vocab, workers)
    print(f"stage {'tokenize' if trains_vocab else 'corpus'}: {time.perf_counter() - started:.1f}s{cpu_seconds(cpu)}",
          flush=True)


def cpu_seconds(cpu: dict[str, float]) -> str:
    """The workers' CPU seconds per part of the corpus tasks, for the stage line (bench/data_prep_throughput.py
    reads it); nothing on the chunk path, whose parts are the stage's wall time."""
    if not cpu:
        return ""
    return f" (task CPU: clean {cpu['clean_cpu_s']:.2f}s, tokenize {cpu['tokenize_cpu_s']:.2f}s)"


def node_shards(plan: InputPlan, num_nodes: int, node_rank: int) -> list[int]:
    return [s for s in range(plan.num_shards) if s % num_nodes == node_rank]


def describe_inputs(cfg: BuildConfig) -> str:
    return ", ".join(f"{row.flag} {value}" for row in SOURCES for value in cfg.input_values(row.field))


def merge(cfg: BuildConfig, plan: InputPlan, workers: Workers) -> dict[str, Any]:
    """Every task no one finished (a dead node's share, or all of them), then the manifest from the markers."""
    out = cfg.out_dir
    missing = missing_corpus_shards(out, plan.num_shards)
    if missing:
        print(f"corpus stage: {len(missing)} of {plan.num_shards} input shard(s) not done, running them here: "
              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}", flush=True)
        prepare_corpus(cfg, plan, missing, workers)
    index = corpus_index(out, plan.num_shards)
    totals = dict(index.totals)
    if totals.get("documents", 0) == 0:
        raise BuildError(
            f"empty corpus: no document left after cleaning and dropping short ones "
            f"(--min-doc-chars {cfg.min_doc_chars}; inputs {describe_inputs(cfg)})"
        )
    vocab = load_vocab(out / VOCAB_NAME)
    lowercase = vocab.lowercase if cfg.vocab is not None else cfg.lowercase  # what the tokenize stage used
    tokenizer_entry = write_tokenizer_files(Vocab(vocab.path, vocab.tokens, lowercase),
                                            corpus_sentences(out, plan.num_shards), out)
    totals["val_documents"] = count_held_out(index.documents, cfg.val_fraction, cfg.seed)
    run_instances(cfg, plan.num_shards, workers)
    orders = run_shard_stage(cfg, plan.num_shards, workers)
    settings = StageSettings.of(cfg, plan.num_shards)
    seq_entries = {str(seq_len): seq_entry(cfg, settings, seq_len, orders) for seq_len in cfg.seq_lens}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "vocab": {
            "file": VOCAB_NAME,
            "sha256": sha256_file(out / VOCAB_NAME),
            "size": vocab.size,
            "lowercase": lowercase,
        },
        "tokenizer": tokenizer_entry,
        "masking": {
            "mode": cfg.masking,
            "mask_prob": cfg.mask_prob,
            "whole_word": cfg.whole_word,
            "dupe_factor": cfg.dupe_factor,
            "max_predictions": cfg.max_predictions(),
        },
        "segments": cfg.segments,
        "seed": cfg.seed,
        "config": cfg.identity(),
        "totals": totals,
        "seq_lens": seq_entries,
    }
    if cfg.segments == NSP:
        manifest["nsp_pools"] = nsp_pool_report(out, cfg.seq_lens, plan.num_shards)
        report_self_draws(manifest["nsp_pools"])
    for folder in sorted({(out / shard_file(int(seq_len), "train", 0)).parent for seq_len in seq_entries}):
        if folder.is_dir():
            fsync_folder(folder)  # the shards' renames are durable before the manifest that lists them
    atomic_write_json(out / MANIFEST_NAME, manifest)
    fsync_folder(out)
    remove_stale_temp_files(out)  # every task is done: a temp file left now belongs to a killed one
    if not cfg.keep_work:
        remove_work(out, plan.num_shards, cfg.seq_lens, dict(settings.outputs))
    return manifest


def run_build(cfg: BuildConfig) -> dict[str, Any] | None:
    """`python -m data_prep build`: returns the manifest, or None for a node of a multi-node build."""
    try:
        plan = check_inputs(cfg)
    except SourceError as err:
        raise BuildError(str(err)) from err
    if (cfg.out_dir / MANIFEST_NAME).is_file() and cfg.num_nodes == 1:
        manifest = json.loads((cfg.out_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        print(f"{cfg.out_dir}: already complete (same config); nothing to do")
        print_summary(manifest)
        return manifest
    drop_broken_markers(cfg.out_dir)
    started = time.perf_counter()
    print(f"{plan.num_shards} input shard(s) of up to {cfg.input_shard_mb:g} MiB", flush=True)
    with Workers(cfg.workers) as workers:
        if cfg.num_nodes > 1:
            prepare_corpus(cfg, plan, node_shards(plan, cfg.num_nodes, cfg.node_rank), workers)
            run_node_share(cfg, plan.num_shards, workers)
            print(f"node {cfg.node_rank}/{cfg.num_nodes} done; run `python -m data_prep merge --out {cfg.out}` "
                  "once every node has finished (it runs whatever a node left undone)")
            return None
        manifest = merge(cfg, plan, workers)
    print_summary(manifest, seconds=time.perf_counter() - started)
    return manifest


def recorded_config(out: Path, command: str, **runtime: Any) -> BuildConfig:
    """The config a folder was started with (for `merge` and `task`, which take no input flags)."""
    recorded = out / CONFIG_NAME
    if (out / MANIFEST_NAME).is_file() and recorded.is_file():  # finished (its work/ may be removed)
        raise FolderComplete(f"{out}: already complete; nothing to do")
    if not recorded.is_file() or not plan_path(out).is_file():
        raise BuildError(f"{command} --out {out}: no {CONFIG_NAME} and work/plan.json; run `build` first")
    return BuildConfig.from_identity(json.loads(recorded.read_text(encoding="utf-8")), out=str(out), **runtime)


def run_merge(out: Path, workers: int, keep_work: bool = False) -> dict[str, Any]:
    try:
        cfg = recorded_config(out, "merge", workers=workers, keep_work=keep_work)
    except FolderComplete as done:
        print(done)
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        print_summary(manifest)
        return manifest
    try:
        plan = ensure_plan(cfg)  # the inputs are still those the nodes read
    except PlanError as err:
        raise BuildError(str(err)) from err
    drop_broken_markers(out)
    started = time.perf_counter()
    with Workers(workers) as pool:
        manifest = merge(cfg, plan, pool)
    print_summary(manifest, seconds=time.perf_counter() - started)
    return manifest
