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
from data_prep.corpus import TokenCorpus, nested_list_arrays, token_part_path, write_token_part
from data_prep.instance_stage import instance_part_path
from data_prep.shards import shard_schema, write_shard_table
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
    tables, first = [], 0
    for chunk, count in enumerate(counts):
        tables.append(_instance_table(first, count))
        write_shard_table(instance_part_path(out, 32, chunk, "train"), tables[-1])
        first += count
    return pa.concat_tables(tables)


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
    assert sorted(opened) == ["part-00000-train.arrow", "part-00003-train.arrow"]
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
    for chunk in range(3):
        tokens = np.arange(1000 * (chunk + 1), dtype=np.uint16) % 97
        write_token_part(token_part_path(tmp_path, chunk), tokens, np.full(10 * (chunk + 1), 100),
                         np.full(chunk + 1, 10), 100, {"documents": chunk + 1})
    before = pa.total_allocated_bytes()
    corpus = TokenCorpus([token_part_path(tmp_path, c) for c in range(3)])
    assert pa.total_allocated_bytes() == before  # views of the mapped files, no copy in Arrow's pool
    assert len(corpus) == 6
    assert corpus.document(5)[9] == (np.arange(3000, dtype=np.uint16) % 97)[2900:3000].tolist()


def mapped_token_parts(folder: Path) -> int:
    """How many of `folder`'s token parts this process has mapped now (/proc/self/maps)."""
    return len({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if line.endswith(".arrow") and str(folder) in line})


def test_token_corpus_keeps_a_bounded_number_of_parts_mapped(tmp_path: Path) -> None:
    """Linux allows 65,530 maps a process: one per token part would end a C4-sized build. Random reads over 40
    parts with a bound of 4 keep at most 4 mapped, and read what an unbounded corpus reads."""
    for chunk in range(40):
        tokens = (np.arange(60, dtype=np.uint16) + chunk) % 97
        write_token_part(token_part_path(tmp_path, chunk), tokens, np.full(6, 10), np.full(3, 2), 100,
                         {"documents": 3})
    paths = [token_part_path(tmp_path, c) for c in range(40)]
    bounded, unbounded = TokenCorpus(paths, max_mapped=4), TokenCorpus(paths, max_mapped=len(paths))
    assert mapped_token_parts(tmp_path) == 0 and len(bounded) == len(unbounded) == 120  # row counts, then unmapped
    rng = np.random.default_rng(0)
    for index in rng.integers(0, 120, 300).tolist():
        assert list(bounded.document(index)) == list(unbounded.document(index))
    assert mapped_token_parts(tmp_path) > 4  # the unbounded one keeps what it read
    del unbounded
    gc.collect()
    for index in rng.integers(0, 120, 300).tolist():
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
def test_row_batches_hold_every_row_once(rows: int, monkeypatch) -> None:
    monkeypatch.setattr(instance_stage, "BATCH_ROWS", 5)
    batches = instance_stage._RowBatches(100, static=False)
    for r in range(rows):
        batches.append(instance_stage.Instance([2, r, 3], 3, None))
    table = batches.table()
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
