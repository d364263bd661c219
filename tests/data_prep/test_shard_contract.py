"""The shard format as docs/data_prep.md promises it to a user who reads the shards without this toolkit.

Only pyarrow (the newest the project allows, as CI installs it), json and `tokenizers` are used to read: the
manifest lists every shard with its sha256 and instance count; each shard is an Arrow IPC *file* of one record
batch with the documented columns and types; the ids decode, through the `tokenizer.json` beside them, to the
corpus's words; and the documented token-type rule (`a_len`) and label conventions hold.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from tokenizers import Tokenizer

from tests.data_prep.segment_inputs import WORDS, build, write_inputs

COLUMNS = {"input_ids": pa.list_(pa.uint16()), "a_len": pa.uint16(), "next_sentence_label": pa.int8()}
STATIC = {"masked_positions": pa.list_(pa.uint16()), "masked_label_ids": pa.list_(pa.uint16())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("contract_inputs"))


@pytest.mark.parametrize(("segments", "masking"), [("nsp", "dynamic"), ("nsp", "static"), ("full-sentences", "static")])
def test_shards_read_with_plain_pyarrow_as_documented(corpus: Path, tmp_path: Path, segments: str,
                                                      masking: str) -> None:
    out = tmp_path / "shards"
    assert build(corpus, out, "--seq-lens", "48", "--segments", segments, "--masking", masking, "--num-shards", "2",
                 "--val-fraction", "0.1", "--docs-per-chunk", "16") == 0
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    vocab = (out / manifest["vocab"]["file"]).read_text(encoding="utf-8").split("\n")[:-1]
    tokenizer = Tokenizer.from_file(str(out / manifest["tokenizer"]["file"]))
    assert tokenizer.get_vocab_size() == manifest["vocab"]["size"] == len(vocab)
    special = {vocab.index(token) for token in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    expected = {**COLUMNS, **(STATIC if masking == "static" else {})}
    rows = 0
    for split, entry in manifest["seq_lens"]["48"].items():
        for shard in entry["shards"]:
            path = out / shard["file"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
            reader = ipc.open_file(pa.memory_map(str(path), "r"))
            assert reader.num_record_batches == 1
            table = reader.read_all()
            assert dict(zip(table.schema.names, table.schema.types, strict=True)) == expected, split
            assert table.num_rows == shard["num_instances"]
            for row in table.to_pylist():
                ids, a_len = row["input_ids"], row["a_len"]
                assert ids[0] == vocab.index("[CLS]") and ids[-1] == vocab.index("[SEP]") and len(ids) <= 48
                if segments == "nsp":  # [CLS] A [SEP] B [SEP]: token types 0 x a_len, then 1
                    assert ids[a_len - 1] == vocab.index("[SEP]") and row["next_sentence_label"] in (0, 1)
                else:  # one segment, no NSP label
                    assert a_len == len(ids) and row["next_sentence_label"] == -1
                if masking == "static":
                    assert len(row["masked_positions"]) == len(row["masked_label_ids"]) > 0
                    assert all(0 < p < len(ids) - 1 for p in row["masked_positions"])
            rows += table.num_rows
        assert sum(shard["num_instances"] for shard in entry["shards"]) == entry["num_instances"]
    assert rows > 0
    # The ids are the corpus's words, through the tokenizer beside them (unmasked shards: every word comes back).
    if masking == "dynamic":
        first = ipc.open_file(str(out / manifest["seq_lens"]["48"]["train"]["shards"][0]["file"])).read_all()
        text = tokenizer.decode([i for i in first.column("input_ids")[0].as_py() if i not in special])
        assert text.split() and set(text.replace(".", " ").split()) <= set(WORDS)
