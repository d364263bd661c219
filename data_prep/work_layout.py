"""Every name the build writes under OUT, in one place: its own files (CONFIG_NAME, VOCAB_NAME, the shards'
`shard_file`) and, under OUT/work/, its intermediate files and completion markers. (manifest.json is named by
the format's reader, data_prep/shard_format/shards.py, and tokenizer.json with its probe by data_prep/tokenizer_files.py:
both are read by pretrain/ too.)

    work/plan.json                                   the input shards: the input files each one reads
    work/text/shard-NNNNN.arrow                      input shard N cleaned: one record batch per chunk
    work/tokens/shard-NNNNN.arrow                    input shard N tokenized: one record batch per chunk
    work/instances/seqL/shard-NNNNN-SPLIT.arrow      its instances at length L, per split
    work/buckets/seqL/shard-NNNNN-SPLIT.arrow        over one bucket: its instances grouped by shuffle bucket
    work/shards/seqL-SPLIT-order.json                the bucket size the shards are cut with
    work/done/STAGE-NNNNN.json                       a finished task: its statistics, and the size and sha256 of
                                                     each output it vouches for (data_prep/task_markers.py);
                                                     a gather's (gather-seqL-SPLIT-KKKKK) is output shard K's
    work/slurm/                                      the batch scripts of a SLURM build, and their logs

The unit of work is an input shard (data_prep/input_plan.py), so work/ holds a few files per input shard
and sequence length, never one per chunk of documents. A task writes its files atomically and then its
marker; a relaunch runs exactly the tasks without a marker.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_NAME = "build_config.json"  # the identity of the config that started the folder (data_prep/build.py)
VOCAB_NAME = "vocab.txt"


def shard_file(seq_len: int, split: str, index: int) -> str:
    """An output shard, relative to OUT (as the manifest lists it)."""
    return f"seq{seq_len}/{split}-{index:05d}.arrow"

# The marker stages of the corpus task (clean, then tokenize one input shard); the others are computed below.
CLEAN_STAGE, TOKENS_STAGE = "clean", "tokens"


def work_dir(out: Path) -> Path:
    return out / "work"


def plan_path(out: Path) -> Path:
    return work_dir(out) / "plan.json"


def text_path(out: Path, shard: int) -> Path:
    return work_dir(out) / "text" / f"shard-{shard:05d}.arrow"


def tokens_path(out: Path, shard: int) -> Path:
    return work_dir(out) / "tokens" / f"shard-{shard:05d}.arrow"


def instances_path(out: Path, seq_len: int, shard: int, split: str) -> Path:
    return work_dir(out) / "instances" / f"seq{seq_len}" / f"shard-{shard:05d}-{split}.arrow"


def scattered_path(out: Path, seq_len: int, shard: int, split: str) -> Path:
    """An input shard's instances of one (length, split), stably grouped by shuffle bucket: batch b is bucket b."""
    return work_dir(out) / "buckets" / f"seq{seq_len}" / f"shard-{shard:05d}-{split}.arrow"


def scatter_stage(seq_len: int) -> str:
    return f"scatter-seq{seq_len}"


def instances_stage(seq_len: int) -> str:
    return f"instances-seq{seq_len}"


def gather_stage(seq_len: int, split: str) -> str:
    """The marker stage of the gathers of (seq_len, split): their index is the output shard's, not an input shard's."""
    return f"gather-seq{seq_len}-{split}"


def done_dir(out: Path) -> Path:
    return work_dir(out) / "done"


def marker_path(out: Path, stage: str, shard: int) -> Path:
    """`stage`: CLEAN_STAGE, TOKENS_STAGE, instances_stage(seq_len), scatter_stage(seq_len) (index: the input
    shard) or gather_stage(seq_len, split) (index: the output shard)."""
    return done_dir(out) / f"{stage}-{shard:05d}.json"


def shard_order_path(out: Path, seq_len: int, split: str) -> Path:
    """The bucket size the shards of (seq_len, split) are cut with, recorded before the first (shard_stage.py)."""
    return work_dir(out) / "shards" / f"seq{seq_len}-{split}-order.json"


def slurm_dir(out: Path) -> Path:
    return work_dir(out) / "slurm"


def chunk_layout_files(out: Path) -> list[Path]:
    """Files of the layout before input shards (one part per chunk of 256 documents): a folder holding
    them was begun by an earlier version, whose chunks and NSP pool differ, so it is not resumed here."""
    work = work_dir(out)
    found = [*work.glob("text/part-*.arrow"), *work.glob("tokens/part-*.arrow"), *work.glob("instances/seq*/part-*")]
    return sorted(found)[:3]


def stage_names(seq_lens: tuple[int, ...] | list[int]) -> list[str]:
    """Every marker stage of a build with these lengths."""
    return [CLEAN_STAGE, TOKENS_STAGE, *(f(s) for s in seq_lens for f in (instances_stage, scatter_stage))]


def work_files(out: Path, num_shards: int, seq_lens: tuple[int, ...] | list[int],
               output_shards: dict[str, int]) -> list[Path]:
    """Every file a build writes under work/ but work/slurm/ (its scripts and logs, kept), in the order a
    finished build removes them: the markers first (no marker outlives what it vouches for), then the data,
    the plan last. `output_shards`: the output shards per split (the gathers' markers). Only these names: a
    file someone else put in work/ is never among them."""
    splits = ("train", "val")
    markers = [marker_path(out, stage, s) for stage in stage_names(seq_lens) for s in range(num_shards)]
    markers += [marker_path(out, gather_stage(seq_len, split), k) for seq_len in seq_lens for split in splits
                for k in range(output_shards[split])]
    data = [path for s in range(num_shards) for path in (text_path(out, s), tokens_path(out, s))]
    data += [f(out, seq_len, s, split) for seq_len in seq_lens for s in range(num_shards) for split in splits
             for f in (instances_path, scattered_path)]
    orders = [shard_order_path(out, seq_len, split) for seq_len in seq_lens for split in splits]
    return [*markers, *data, *orders, plan_path(out)]


def work_folders(out: Path, seq_lens: tuple[int, ...] | list[int]) -> list[Path]:
    """The folders `work_files` lie in, deepest first, work/ last: removed when left empty."""
    work = work_dir(out)
    per_length = [work / kind / f"seq{s}" for s in seq_lens for kind in ("instances", "buckets")]
    return [*per_length, *(work / name for name in ("instances", "buckets", "text", "tokens", "done", "shards")), work]
