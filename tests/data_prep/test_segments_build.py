"""`python -m data_prep build --segments ...` end to end: the packed shards equal the re-stated rule chunk
by chunk, the masking rate and its 80/10/10 split measured on static shards, byte-identity across
workers, the manifest's record of the mode, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from data_prep.__main__ import main
from data_prep.corpus import TokenCorpus
from data_prep.corpus_index import held_out as held_out_documents
from data_prep.shard_format.shards import NO_NEXT_SENTENCE_LABEL, Manifest, ShardFormatError
from data_prep.shard_format.vocab import load_vocab
from data_prep.work_layout import tokens_path
from tests.data_prep.segment_inputs import build, write_inputs
from tests.data_prep.test_segments import restated_packing
from tests.support.data_prep_fixtures import tree_digest
from tests.support.paths import REPO_ROOT

SEED = 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("segment_inputs"))



def rows(out: Path, seq_len: int, split: str) -> dict[str, list]:
    """Every row of one (length, split), all shards, as Python lists by column."""
    manifest = Manifest.load(out)
    tables = [ipc.open_file(pa.memory_map(str(out / s.file), "r")).read_all() for s in manifest.shards(seq_len, split)]
    return pa.concat_tables(tables).to_pydict() if tables else {}


@pytest.mark.parametrize("segments", ["full-sentences", "doc-sentences"])
def test_packed_shards_equal_the_restated_rule_chunk_by_chunk(segments: str, corpus: Path, tmp_path: Path) -> None:
    """The stage packs the documents of each (chunk, split) in corpus order, afresh at every chunk."""
    out = tmp_path / "out"
    assert build(corpus, out, "--segments", segments, "--seq-lens", "64", "--val-fraction", "0.2",
                 "--num-shards", "2", "--docs-per-chunk", "8", "--workers", "1", "--keep-work") == 0
    vocab = load_vocab(out / "vocab.txt")
    special = vocab.special_ids
    assert (special["[CLS]"], special["[SEP]"]) == (2, 3)  # the ids restated_packing writes
    tokens = TokenCorpus([tokens_path(out, 0)])  # one input shard, a record batch per chunk
    num_chunks = tokens.num_parts
    assert num_chunks == 5
    held_out = held_out_documents(0, len(tokens), len(tokens), 0.2, SEED)
    manifest = Manifest.load(out)
    for split in ("train", "val"):
        expected, dropped = [], []
        for chunk in range(num_chunks):
            docs = [[list(s) for s in tokens.document(d)] for d in tokens.part_range(chunk) if held_out[d] == (split == "val")]
            instances, pieces = restated_packing(docs, 64, segments == "full-sentences", vocab.continuation_mask())
            expected += instances
            dropped += pieces
        got = rows(out, 64, split)
        assert sorted(got["input_ids"]) == sorted(expected), split  # shards are a shuffle of the instances
        assert got["a_len"] == [len(ids) for ids in got["input_ids"]]  # one segment: token types all 0
        assert set(got["next_sentence_label"]) == {NO_NEXT_SENTENCE_LABEL}
        entry = manifest.data["seq_lens"]["64"][split]
        assert (entry["pieces_dropped_short"], entry["tokens_dropped_short"]) == (len(dropped), sum(map(len, dropped)))
    assert manifest.segments == segments and not manifest.next_sentence_labels
    assert manifest.data["segments"] == segments and manifest.data["config"]["segments"] == segments
    assert manifest.data["seq_lens"]["64"]["train"]["nsp_random_fraction"] is None


@pytest.mark.parametrize(("segments", "mask_prob"), [("full-sentences", 0.30), ("doc-sentences", 0.30),
                                                     ("nsp", 0.30), ("nsp", 0.15)])
def test_static_masking_rate_and_80_10_10_on_shards(segments: str, mask_prob: float, corpus: Path,
                                                    tmp_path: Path) -> None:
    """Rate = masked positions / all tokens of the instance ([CLS] and [SEP] included, BERT's count),
    over ~100k tokens (4 maskings of the corpus at two lengths)."""
    out = tmp_path / "out"
    assert build(corpus, out, "--segments", segments, "--masking", "static", "--mask-prob", str(mask_prob),
                 "--seq-lens", "64,128", "--dupe-factor", "4", "--num-shards", "2", "--docs-per-chunk", "16",
                 "--workers", "1") == 0
    manifest = Manifest.load(out)
    caps = manifest.data["masking"]["max_predictions"]
    assert caps == ({"64": 20, "128": 40} if mask_prob == 0.30 else {"64": 10, "128": 20})
    mask_id = load_vocab(out / "vocab.txt").special_ids["[MASK]"]
    masked = tokens = 0
    kinds = {"mask": 0, "kept": 0, "random": 0}
    for seq_len in (64, 128):
        got = rows(out, seq_len, "train")
        for ids, positions, labels in zip(got["input_ids"], got["masked_positions"], got["masked_label_ids"],
                                          strict=True):
            assert 1 <= len(positions) <= caps[str(seq_len)] and len(ids) <= seq_len
            masked += len(positions)
            tokens += len(ids)
            for pos, label in zip(positions, labels, strict=True):
                kinds["mask" if ids[pos] == mask_id else "kept" if ids[pos] == label else "random"] += 1
        if segments != "nsp":
            assert got["a_len"] == [len(ids) for ids in got["input_ids"]]
            assert set(got["next_sentence_label"]) == {NO_NEXT_SENTENCE_LABEL}
    assert tokens > 90_000
    assert abs(masked / tokens - mask_prob) <= 0.005, masked / tokens
    # A random replacement may draw the original id (1 in ~80 here): "kept" ~0.101, "random" ~0.099.
    assert abs(kinds["mask"] / masked - 0.8) < 0.01
    assert abs(kinds["kept"] / masked - 0.1) < 0.01
    assert abs(kinds["random"] / masked - 0.1) < 0.01


def test_full_sentences_one_and_two_workers_give_identical_bytes(corpus: Path, tmp_path: Path) -> None:
    """Across documents, yet chunk by chunk: 8 chunks over 2 processes give the bytes of one."""
    flags = ["--segments", "full-sentences", "--masking", "static", "--mask-prob", "0.3", "--seq-lens", "32,64",
             "--val-fraction", "0.2", "--num-shards", "3", "--docs-per-chunk", "5"]
    assert build(corpus, tmp_path / "one", *flags, "--workers", "1") == 0
    assert build(corpus, tmp_path / "two", *flags, "--workers", "2") == 0
    one, two = tree_digest(tmp_path / "one"), tree_digest(tmp_path / "two")
    assert len(one) == 2 * (3 + 1) + 2 and one == two  # per length 3 train + 1 val shard; vocab, manifest


def test_full_sentences_node_builds_then_merge_equal_single_node(corpus: Path, tmp_path: Path) -> None:
    """merge rebuilds the config from build_config.json: the mode must travel with it."""
    flags = ["--segments", "full-sentences", "--seq-lens", "48", "--num-shards", "2", "--docs-per-chunk", "6",
             "--workers", "1"]
    assert build(corpus, tmp_path / "single", *flags) == 0
    shared = tmp_path / "multi"
    for rank in (1, 0):
        assert build(corpus, shared, *flags, "--num-nodes", "2", "--node-rank", str(rank), "--node-wait", "0") == 0
    assert main(["merge", "--out", str(shared), "--workers", "1"]) == 0
    assert Manifest.load(shared).segments == "full-sentences"
    assert tree_digest(shared) == tree_digest(tmp_path / "single")


def test_mode_is_part_of_the_folder_identity_and_old_folders_resume(corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    flags = ["--seq-lens", "64", "--num-shards", "2", "--workers", "1"]
    assert build(corpus, out, *flags) == 0
    before = tree_digest(out)
    assert "segments" not in json.loads((out / "build_config.json").read_text(encoding="utf-8"))
    # Interrupted before the shards, as a folder started by the code before segment modes could be: resumes.
    (out / "manifest.json").unlink()
    shutil.rmtree(out / "seq64")
    assert build(corpus, out, *flags, "--segments", "nsp") == 0
    assert tree_digest(out) == before
    capsys.readouterr()
    assert build(corpus, out, *flags, "--segments", "doc-sentences") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --out ") and "(segments: 'nsp' -> 'doc-sentences')" in error


def test_manifest_reads_segments_and_inspect_shows_them(corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert build(corpus, out, "--segments", "full-sentences", "--seq-lens", "64", "--num-shards", "1",
                 "--workers", "1") == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--num-examples", "2"]) == 0
    shown = capsys.readouterr().out
    assert "segments: full-sentences" in shown and shown.count("one segment, no NSP label") == 2
    assert "short pieces dropped" in shown  # the packed modes' count, per length and split
    data = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    data.pop("segments")  # as a manifest written before the key existed
    (out / "manifest.json").write_text(json.dumps(data), encoding="utf-8")
    assert Manifest.load(out).segments == "nsp" and Manifest.load(out).next_sentence_labels
    data["segments"] = "pairs"
    (out / "manifest.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ShardFormatError, match="segments 'pairs', expected one of nsp, full-sentences"):
        Manifest.load(out)


def test_bad_segments_is_one_line_naming_the_flag(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "data_prep", "build", "--text", str(corpus / "corpus.txt"), "--vocab",
         str(corpus / "vocab.txt"), "--out", str(out), "--segments", "foo"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: --segments 'foo': expected one of nsp, full-sentences, doc-sentences"
    ]
    assert not out.exists()  # refused before any work


def test_dupe_rounds_of_a_packed_mode_repeat_instances_with_new_masks(corpus: Path, tmp_path: Path) -> None:
    """Dupe rounds of a packed mode repeat the instances and mask each round afresh."""
    out = tmp_path / "out"
    assert build(corpus, out, "--segments", "doc-sentences", "--masking", "static", "--dupe-factor", "2",
                 "--seq-lens", "64", "--num-shards", "1", "--workers", "1") == 0
    got = rows(out, 64, "train")
    originals = []
    for ids, positions, labels in zip(got["input_ids"], got["masked_positions"], got["masked_label_ids"], strict=True):
        restored = np.array(ids)
        restored[positions] = labels
        originals.append((tuple(restored.tolist()), tuple(positions)))
    unmasked = sorted(o for o, _ in originals)
    assert unmasked[0::2] == unmasked[1::2]  # every instance twice
    assert len(set(originals)) > 0.9 * len(originals)  # with (mostly) different masks
