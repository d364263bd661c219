"""The merge's memory fixes keep every byte and hold no corpus-wide copy (docs/data_prep.md#memory).

Structural guards, not timed or measured ones: the token corpus is a view of the mapped files (no
allocation), a shard's gather opens only the instance parts its rows live in, shard files are streamed
with the same bytes and digest, and instances converted to Arrow in small batches give the recorded
shards. bench/data_prep_memory.py measures the bytes per token.
"""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import data_prep.instance_stage as instance_stage
import data_prep.shard_stage as shard_stage
from data_prep.batch_files import AtomicBatchWriter
from data_prep.corpus import TokenCorpus, nested_list_arrays, token_schema, token_table
from data_prep.shard_format.atomic_io import atomic_write_json
from data_prep.shard_format.shards import shard_schema, write_shard_table
from data_prep.work_layout import instances_path, instances_stage, marker_path
from tests.data_prep.segment_inputs import build, write_inputs
from tests.data_prep.test_nsp_unchanged import BUILDS, RECORDED


def _instance_table(first: int, rows: int) -> pa.Table:
    """Instances whose ids name their global row, so a gather's order can be read back."""
    ids = [[first + r, 7, first + r] for r in range(rows)]
    return pa.Table.from_pydict(
        {"input_ids": ids, "a_len": [2] * rows, "next_sentence_label": [r % 2 for r in range(rows)]},
        schema=shard_schema(100, static_masking=False),
    )


def _write_parts(out: Path, counts: list[int]) -> pa.Table:
    """One instance file per input shard, of two record batches each (as an instance task writes them),
    and the task's marker."""
    tables, first = [], 0
    for shard, count in enumerate(counts):
        tables.append(_instance_table(first, count))
        with AtomicBatchWriter(instances_path(out, 32, shard, "train"), tables[-1].schema) as writer:
            writer.write(tables[-1].slice(0, 2))
            writer.write(tables[-1].slice(2))
        labels = sum(r % 2 for r in range(count))
        atomic_write_json(marker_path(out, instances_stage(32), shard),
                          {"train_instances": count, "train_random_next": labels, "val_instances": 0,
                           "val_random_next": 0})
        first += count
    return pa.concat_tables(tables)


def write_token_file(path: Path, chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """A token file of one record batch per chunk: (tokens, sentence lengths, sentences per document)."""
    with AtomicBatchWriter(path, token_schema(100)) as writer:
        for tokens, lengths, per_doc in chunks:
            writer.write(token_table(tokens, lengths, per_doc, 100))


def test_shard_gather_reads_only_its_parts_and_keeps_the_order(tmp_path: Path, monkeypatch) -> None:
    whole = _write_parts(tmp_path, [5, 4, 6, 3])
    shard_stage.part_starts.cache_clear()
    # labels r % 2 within each part: 2 + 2 + 3 + 1 random-next
    assert shard_stage.count_instances(tmp_path, 32, "train", 4) == (18, 8)
    shard_stage.part_starts(tmp_path, 32, "train", 4)  # the row counts, once per worker
    opened: list[str] = []
    real_read = shard_stage.read_table
    def spy(path: Path) -> pa.Table:
        opened.append(Path(path).name)
        return real_read(path)

    monkeypatch.setattr(shard_stage, "read_table", spy)
    rows = np.array([16, 2, 15, 0, 4, 17])  # parts 0 and 3 only, out of order
    task = shard_stage.ShardTask(tmp_path, 32, "train", 4, 0, rows)
    gathered = shard_stage.gather_rows(task)
    assert sorted(opened) == ["shard-00000-train.arrow", "shard-00003-train.arrow"]
    assert gathered.equals(whole.take(pa.array(rows)))
    assert [ids[0] for ids in gathered.column("input_ids").to_pylist()] == rows.tolist()
    shard_stage.part_starts.cache_clear()


def test_shard_file_streamed_with_the_same_bytes_and_digest(tmp_path: Path) -> None:
    table = pa.concat_tables([_instance_table(0, 3), _instance_table(3, 4)])  # two chunks: one batch written
    sink = pa.BufferOutputStream()
    combined = table.combine_chunks()
    with ipc.new_file(sink, combined.schema) as writer:
        writer.write_table(combined, max_chunksize=combined.num_rows)
    expected = sink.getvalue().to_pybytes()
    count, digest = write_shard_table(tmp_path / "s.arrow", table)
    assert count == 7 and (tmp_path / "s.arrow").read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    assert not list(tmp_path.glob(".*.tmp"))


def test_token_corpus_maps_the_parts_without_copying(tmp_path: Path) -> None:
    chunks = [(np.arange(1000 * (c + 1), dtype=np.uint16) % 97, np.full(10 * (c + 1), 100), np.full(c + 1, 10))
              for c in range(3)]
    write_token_file(tmp_path / "a.arrow", chunks[:2])  # chunks 0 and 1 in one file: two batches
    write_token_file(tmp_path / "b.arrow", chunks[2:])
    before = pa.total_allocated_bytes()
    corpus = TokenCorpus([tmp_path / "a.arrow", tmp_path / "b.arrow"], first_document=7)
    assert pa.total_allocated_bytes() == before  # views of the mapped files, no copy in Arrow's pool
    assert len(corpus) == 6 and corpus.num_parts == 3
    assert [corpus.part_range(p) for p in range(3)] == [range(7, 8), range(8, 10), range(10, 13)]
    assert corpus.document(12)[9] == (np.arange(3000, dtype=np.uint16) % 97)[2900:3000].tolist()


def mapped_token_parts(folder: Path) -> int:
    """How many of `folder`'s token files this process has mapped now (/proc/self/maps)."""
    return len({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if line.endswith(".arrow") and str(folder) in line})


def test_token_corpus_keeps_a_bounded_number_of_files_mapped(tmp_path: Path) -> None:
    """Linux allows 65,530 maps a process: one per token file would end a corpus-scope build of many input
    shards. Random reads over 40 files (two chunks each) with a bound of 4 keep at most 4 mapped, and read
    what an unbounded corpus reads."""
    paths = [tmp_path / f"shard-{s:05d}.arrow" for s in range(40)]
    for shard, path in enumerate(paths):
        tokens = (np.arange(30, dtype=np.uint16) + shard) % 97
        write_token_file(path, [(tokens, np.full(3, 10), np.array([1, 2]))] * 2)
    bounded, unbounded = TokenCorpus(paths, max_mapped=4), TokenCorpus(paths, max_mapped=len(paths))
    gc.collect()  # once seen failing in a full data_prep run, never alone: a map held by garbage not yet collected
    assert mapped_token_parts(tmp_path) == 0 and len(bounded) == len(unbounded) == 160  # row counts, then unmapped
    rng = np.random.default_rng(0)
    for index in rng.integers(0, 160, 300).tolist():
        assert list(bounded.document(index)) == list(unbounded.document(index))
    assert mapped_token_parts(tmp_path) > 4  # the unbounded one keeps what it read
    del unbounded
    gc.collect()
    for index in rng.integers(0, 160, 300).tolist():
        bounded.document(index)
        assert mapped_token_parts(tmp_path) <= 4


def test_small_instance_batches_give_the_recorded_shards(tmp_path: Path, monkeypatch) -> None:
    """BATCH_ROWS far below a chunk's instance count (in-process worker, so the patch applies)."""
    monkeypatch.setattr(instance_stage, "BATCH_ROWS", 5)
    corpus = write_inputs(tmp_path / "inputs")
    out = tmp_path / "out"
    assert build(corpus, out, "--workers", "1", *BUILDS["static-whole-word"]) == 0
    for name, (file_sha, _rows) in RECORDED["static-whole-word"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == file_sha, name


@pytest.mark.parametrize("rows", [0, 4, 5, 11])
def test_row_batches_hold_every_row_once(rows: int, monkeypatch, tmp_path: Path) -> None:
    """Written as they fill: a batch of at most BATCH_ROWS rows (never fewer than one batch, so an empty split
    is still a readable file), every row once, in order."""
    monkeypatch.setattr(instance_stage, "BATCH_ROWS", 5)
    path = tmp_path / "split.arrow"
    with AtomicBatchWriter(path, shard_schema(100, static_masking=False)) as writer:
        batches = instance_stage._RowBatches(100, False, writer)
        for r in range(rows):
            batches.append(instance_stage.Instance([2, r, 3], 3, None))
        batches.flush()
    reader = ipc.open_file(pa.memory_map(str(path), "r"))
    assert [reader.get_batch(b).num_rows for b in range(reader.num_record_batches)] == (
        [5] * (rows // 5) + ([rows % 5] if rows % 5 or rows == 0 else []))
    table = reader.read_all()
    assert table.num_rows == rows
    assert [ids[1] for ids in table.column("input_ids").to_pylist()] == list(range(rows))


@pytest.mark.parametrize("ids", [pa.uint16(), pa.uint32()])
def test_nested_list_views_match_arrow_on_sliced_arrays(ids: pa.DataType) -> None:
    docs = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9], [10]], []]
    column = pa.array(docs, type=pa.list_(pa.list_(ids)))
    for array in (column, column.slice(1), column.slice(1, 2)):
        views = nested_list_arrays(array)
        expected = (array.offsets.to_numpy(), array.values.offsets.to_numpy(), array.values.values.to_numpy())
        for view, want in zip(views, expected, strict=True):
            assert view.dtype == want.dtype and view.tolist() == want.tolist()
    assert [v.tolist() for v in nested_list_arrays(pa.array([[]], type=column.type))] == [[0, 0], [0], []]
