"""NSP negatives never from A's own document (data_prep/nsp_pool.py), checked on every negative of a build.

The corpus: DOCUMENTS text files of one document each, every document with words of its own (document g only
`dGxI` words), each file an input shard of its own; so each shard's pool of a split holds at most one
document, the case where BERT's draw took B from A's document every time. A row's words name its documents.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from data_prep.__main__ import main
from data_prep.corpus_index import CorpusIndex, ShardSpan
from data_prep.nsp_pool import NspPool, pool_group
from data_prep.shard_format.shards import Manifest

DOCUMENTS = 6
WORDS_PER_DOCUMENT = 20
FIRST_WORD_ID = 6  # after [PAD] [UNK] [CLS] [SEP] [MASK] and "."


def write_corpus(root: Path) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(3)
    flags = []
    for doc in range(DOCUMENTS):
        lines = [" ".join(f"d{doc}x{rng.randrange(WORDS_PER_DOCUMENT)}" for _ in range(rng.randint(4, 12))) + " ."
                 for _ in range(30)]
        (root / f"doc{doc}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        flags += ["--text", str(root / f"doc{doc}.txt")]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
    tokens += [f"d{doc}x{i}" for doc in range(DOCUMENTS) for i in range(WORDS_PER_DOCUMENT)]
    (root / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    budget = max((root / f"doc{d}.txt").stat().st_size for d in range(DOCUMENTS)) * 1.2 / (1 << 20)
    # A tiny --val-fraction: no draw falls below it, so exactly one document is held out (the smallest draw).
    return [*flags, "--vocab", str(root / "vocab.txt"), "--input-shard-mb", f"{budget:.6f}", "--seq-lens", "32",
            "--num-shards", "2", "--val-fraction", "0.0001", "--docs-per-chunk", "4", "--seed", "5", "--dupe-factor", "10", "--keep-work"]


def documents_of(ids: list[int]) -> set[int]:
    return {(i - FIRST_WORD_ID) // WORDS_PER_DOCUMENT for i in ids if i >= FIRST_WORD_ID}


def rows(out: Path, split: str) -> dict[str, list]:
    tables = [ipc.open_file(pa.memory_map(str(out / s.file), "r")).read_all()
              for s in Manifest.load(out).shards(32, split)]
    return pa.concat_tables(tables).to_pydict()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nsp_pools")
    flags = write_corpus(root / "inputs")
    out = root / "out"
    assert main(["build", *flags, "--out", str(out), "--workers", "1"]) == 0
    return out


def test_no_negative_from_its_own_document_when_shards_hold_one(built: Path) -> None:
    manifest = Manifest.load(built).data
    assert len(json.loads((built / "work" / "plan.json").read_text())["shards"]) == DOCUMENTS
    assert manifest["totals"]["val_documents"] == 1
    train = rows(built, "train")
    negatives = 0
    for ids, a_len, label in zip(train["input_ids"], train["a_len"], train["next_sentence_label"], strict=True):
        a, b = documents_of(ids[1 : a_len - 1]), documents_of(ids[a_len:-1])
        assert len(a) == 1 and len(b) == 1, "each segment is from one document"
        if label == 1:
            negatives += 1
            assert a != b, "a random next segment from A's own document"
        else:
            assert a == b
    assert negatives > 100  # the check could fail: every train negative was A's own text before
    pools = manifest["nsp_pools"]
    assert pools["min_documents"] == 64
    assert pools["shards_widened"]["train"] == DOCUMENTS - 1  # the held-out document's shard has no train pool
    assert pools["self_draws"]["32"]["train"] == 0


def test_a_split_of_one_document_is_counted(built: Path) -> None:
    """The one held-out document has no other to draw from: its negatives are A's own text, and counted."""
    val = rows(built, "val")
    own = sum(label == 1 for label in val["next_sentence_label"])
    assert own > 0
    assert all(len(documents_of(ids)) == 1 for ids in val["input_ids"])
    assert Manifest.load(built).data["nsp_pools"]["self_draws"]["32"] == {"train": 0, "val": own}


def corpus_of(documents: list[int]) -> CorpusIndex:
    spans, start = [], 0
    for count in documents:
        spans.append(ShardSpan(start, count, len(spans), (count,)))
        start += count
    return CorpusIndex(tuple(spans), {})


def test_groups_are_consecutive_shards_grown_after_then_before() -> None:
    index = corpus_of([100, 1, 1, 30, 40])
    groups = [pool_group(index, shard, "train", 0.0, 1) for shard in range(5)]
    assert groups == [range(0, 1), range(0, 3), range(1, 5), range(3, 5), range(3, 5)]
    assert pool_group(corpus_of([1, 1]), 0, "train", 0.0, 1) == range(0, 2)  # the corpus when it has too few


def test_the_last_resort_draw_is_never_a_itself() -> None:
    pool, rng = NspPool(np.array([3, 7, 9])), random.Random(0)
    assert {pool.other_than(7, rng) for _ in range(200)} == {3, 9}
    alone = NspPool(np.array([5]))
    assert alone.other_than(5, rng) == 5 and alone.self_draws == 1
