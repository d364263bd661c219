"""The build: check inputs, run the stages (each resumable), write the manifest last.

Single node: `build` runs everything. Several nodes: each `build --num-nodes N --node-rank r`
cleans and tokenizes its chunks and records itself in OUT/work/nodes/; then `merge` (one
machine, same shared OUT) makes instances, shards and the manifest. A single-node build is
exactly "node 0 of 1, then merge", so both paths give the same bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_prep import __version__
from data_prep.atomic_io import atomic_write_json, sha256_file
from data_prep.config import NSP, BuildConfig, ConfigError
from data_prep.corpus import read_table, text_part_path
from data_prep.corpus_stage import VOCAB_NAME, clean_all, corpus_stats, prepare_vocab, tokenize_all
from data_prep.instance_stage import (
    InstanceTask,
    dropped_pieces,
    instance_chunk_done,
    make_instances,
    validation_documents,
)
from data_prep.parallel import Workers
from data_prep.report import print_summary
from data_prep.shard_stage import (
    ShardTask,
    count_instances,
    order_bucket,
    shard_file,
    shard_plan,
    write_one_shard,
)
from data_prep.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, SPLITS
from data_prep.source_files import SourceError
from data_prep.sources import SOURCES
from data_prep.tokenizer_files import write_tokenizer_files
from data_prep.vocab import Vocab, load_vocab

CONFIG_NAME = "build_config.json"


class BuildError(ValueError):
    """The build cannot go on (bad input, foreign output folder, too little data); names the cause."""


def check_inputs(cfg: BuildConfig) -> None:
    """Everything that can be checked before hours of work: files, source options, vocab, the output folder."""
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
    claim_output_folder(cfg)


def claim_output_folder(cfg: BuildConfig) -> None:
    """Record the config in OUT, or refuse when OUT holds the output of another config."""
    out = cfg.out_dir
    identity = cfg.identity()
    recorded = out / CONFIG_NAME
    if recorded.is_file():
        previous = json.loads(recorded.read_text(encoding="utf-8"))
        if previous == identity and cfg.num_nodes == 1:
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


def remove_stale_temp_files(out: Path) -> None:
    """Temp files a killed run left behind (atomic writes rename them when complete). Not done
    by nodes of a multi-node build: another node may be writing its own temp files right now."""
    for path in out.rglob(".*.tmp"):
        path.unlink(missing_ok=True)


def node_marker(out: Path, rank: int) -> Path:
    return out / "work" / "nodes" / f"node-{rank:04d}.json"


def build_node(cfg: BuildConfig, workers: Workers) -> int:
    """Stage 1 for this node's chunks; returns the number of chunks in the whole corpus."""
    started = time.perf_counter()
    num_chunks = clean_all(cfg, workers)
    if num_chunks == 0:
        raise BuildError(f"empty corpus: the inputs gave no documents ({describe_inputs(cfg)})")
    print(f"stage clean: {time.perf_counter() - started:.1f}s", flush=True)
    started = time.perf_counter()
    vocab = prepare_vocab(cfg, num_chunks)
    print(f"stage vocab: {time.perf_counter() - started:.1f}s", flush=True)
    started = time.perf_counter()
    tokenize_all(cfg, vocab, num_chunks)
    print(f"stage tokenize: {time.perf_counter() - started:.1f}s", flush=True)
    atomic_write_json(node_marker(cfg.out_dir, cfg.node_rank), {"num_chunks": num_chunks, "rank": cfg.node_rank, "num_nodes": cfg.num_nodes})
    return num_chunks


def describe_inputs(cfg: BuildConfig) -> str:
    return ", ".join(f"{row.flag} {value}" for row in SOURCES for value in cfg.input_values(row.field))


def merge(cfg: BuildConfig, workers: Workers) -> dict[str, Any]:
    """Stages 2 and 3 over all nodes' token parts, then the manifest."""
    out = cfg.out_dir
    markers = [node_marker(out, r) for r in range(cfg.num_nodes)]
    missing = [str(m) for m in markers if not m.is_file()]
    if missing:
        raise BuildError(f"merge: node(s) not finished yet, missing {', '.join(missing)}")
    num_chunks = json.loads(markers[0].read_text(encoding="utf-8"))["num_chunks"]
    totals = corpus_stats(out, num_chunks)
    if totals.get("documents", 0) == 0:
        raise BuildError(
            f"empty corpus: no document left after cleaning and dropping short ones "
            f"(--min-doc-chars {cfg.min_doc_chars}; inputs {describe_inputs(cfg)})"
        )
    vocab = load_vocab(out / VOCAB_NAME)
    lowercase = vocab.lowercase if cfg.vocab is not None else cfg.lowercase  # what the tokenize stage used
    tokenizer_entry = write_tokenizer_files(Vocab(vocab.path, vocab.tokens, lowercase), corpus_sentences(out, num_chunks),
                                            out)
    held_out = validation_documents(totals["documents"], cfg.val_fraction, cfg.seed)
    totals["val_documents"] = int(held_out.sum())
    make_all_instances(cfg, num_chunks, workers)
    seq_entries = {str(seq_len): make_shards(cfg, seq_len, num_chunks, workers) for seq_len in cfg.seq_lens}
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
    atomic_write_json(out / MANIFEST_NAME, manifest)
    return manifest


def corpus_sentences(out: Path, num_chunks: int) -> Iterator[str]:
    """The cleaned sentences in corpus order, read chunk by chunk only as far as the caller asks."""
    for chunk in range(num_chunks):
        for document in read_table(text_part_path(out, chunk)).column("sentences").to_pylist():
            yield from document


def make_all_instances(cfg: BuildConfig, num_chunks: int, workers: Workers) -> None:
    """Instance parts of every (sequence length, chunk) still missing, all lengths in one pool
    pass so that a corpus of few, long documents (books) still keeps every worker busy."""
    out = cfg.out_dir
    tasks = [
        InstanceTask(
            out, num_chunks, c, seq_len, cfg.seed, cfg.short_seq_prob, cfg.val_fraction, cfg.dupe_factor,
            cfg.static_masking, cfg.mask_prob, cfg.max_predictions()[str(seq_len)], cfg.whole_word, cfg.segments,
        )
        for c in range(num_chunks)
        for seq_len in cfg.seq_lens
        if not instance_chunk_done(out, seq_len, c, packed=cfg.segments != NSP)
    ]
    started = time.perf_counter()
    for _ in workers.map(make_instances, tasks):
        pass
    print(f"stage instances: {time.perf_counter() - started:.1f}s", flush=True)


def make_shards(cfg: BuildConfig, seq_len: int, num_chunks: int, workers: Workers) -> dict[str, Any]:
    out = cfg.out_dir
    started = time.perf_counter()
    entry: dict[str, Any] = {}
    for split in SPLITS:
        count, random_next = count_instances(out, seq_len, split, num_chunks)
        num_shards = cfg.num_shards if split == "train" else cfg.num_val_shards
        # Packed modes only: what the packing dropped (nsp manifests keep their keys, and their bytes).
        dropped = dropped_pieces(out, seq_len, split, num_chunks) if cfg.segments != NSP else {}
        if count == 0:
            entry[split] = {"num_instances": 0, "nsp_random_fraction": None, "shards": [], **dropped}
            continue
        if count < num_shards:
            flag = "--num-shards" if split == "train" else "--num-val-shards"
            raise BuildError(
                f"{flag} {num_shards}: only {count} {split} instances at sequence length {seq_len}; "
                "lower it or add data"
            )
        # Lazy: one bucket of the order at a time (shard_stage.bucket_orders).
        bucket = order_bucket(out, seq_len, split, count)
        plan = shard_plan(count, num_shards, cfg.seed, seq_len, split, bucket)
        shards = list(workers.map(write_shard_if_needed, (
            ShardTask(out, seq_len, split, num_chunks, k, rows) for k, rows in enumerate(plan)
        )))
        entry[split] = {
            "num_instances": count,
            "nsp_random_fraction": round(random_next / count, 6) if cfg.segments == NSP else None,
            "shards": shards,
            **dropped,
        }
    print(f"stage shards seq {seq_len}: {time.perf_counter() - started:.1f}s", flush=True)
    return entry


def write_shard_if_needed(task: ShardTask) -> dict[str, object]:
    """Resume: a shard file exists only when complete (atomic rename), so it is reused as is."""
    path = task.out / shard_file(task.seq_len, task.split, task.index)
    if path.is_file():
        return {"file": shard_file(task.seq_len, task.split, task.index), "num_instances": len(task.rows),
                "sha256": sha256_file(path)}
    return write_one_shard(task)


def run_build(cfg: BuildConfig) -> dict[str, Any] | None:
    """`python -m data_prep build`: returns the manifest, or None for a node of a multi-node build."""
    try:
        check_inputs(cfg)
    except SourceError as err:
        raise BuildError(str(err)) from err
    if (cfg.out_dir / MANIFEST_NAME).is_file() and cfg.num_nodes == 1:
        manifest = json.loads((cfg.out_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        print(f"{cfg.out_dir}: already complete (same config); nothing to do")
        print_summary(manifest)
        return manifest
    started = time.perf_counter()
    with Workers(cfg.workers) as workers:
        build_node(cfg, workers)
        if cfg.num_nodes > 1:
            print(f"node {cfg.node_rank}/{cfg.num_nodes} done; run `python -m data_prep merge --out {cfg.out}` "
                  "once every node has finished")
            return None
        manifest = merge(cfg, workers)
    print_summary(manifest, seconds=time.perf_counter() - started)
    return manifest


def run_merge(out: Path, workers: int) -> dict[str, Any]:
    recorded = out / CONFIG_NAME
    if not recorded.is_file():
        raise BuildError(f"merge --out {out}: no {CONFIG_NAME}; run the node builds first")
    nodes = sorted((out / "work" / "nodes").glob("node-*.json"))
    if not nodes:
        raise BuildError(f"merge --out {out}: no node has finished yet (no {out}/work/nodes/node-*.json)")
    num_nodes = int(json.loads(nodes[0].read_text(encoding="utf-8"))["num_nodes"])
    cfg = BuildConfig.from_identity(
        json.loads(recorded.read_text(encoding="utf-8")), out=str(out), workers=workers, num_nodes=num_nodes
    )
    started = time.perf_counter()
    with Workers(workers) as pool:
        manifest = merge(cfg, pool)
    print_summary(manifest, seconds=time.perf_counter() - started)
    return manifest

