"""The default `--segments nsp` output is what it was before segment modes existed, byte for byte.

The digests below were recorded on commit 45044ec (main before issue 37, pyarrow 26.0.1, tokenizers
0.23.3) by running BUILDS on the inputs of `segment_inputs.py` with that code and printing, per shard,
`hashlib.sha256(file bytes)` and `row_digest(file)`, and the sha256 of the manifest without its
`config` and `tool_version` (`manifest_digest`). To re-record after an intended format change, run the
same builds on the new code and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from data_prep.shard_format.shards import Manifest
from tests.data_prep.segment_inputs import build, write_inputs

BUILDS = {
    "static-whole-word": ["--seq-lens", "64,128", "--masking", "static", "--whole-word", "--dupe-factor", "2",
                          "--val-fraction", "0.2", "--num-shards", "2", "--docs-per-chunk", "8"],
    "static": ["--seq-lens", "48", "--masking", "static", "--num-shards", "2", "--docs-per-chunk", "16"],
    "dynamic": ["--seq-lens", "48", "--num-shards", "2", "--docs-per-chunk", "16"],
}

# build -> shard -> (sha256 of the file, row_digest); then the manifest digest.
RECORDED = {
    "static-whole-word": {
        "seq128/train-00000.arrow": ("12f4781ab15cd8851a783c4bd0580ed9109c62087a9b2018803169cff8c5aa50", "0e2261c51c9bf97a"),
        "seq128/train-00001.arrow": ("284e82c3600333f44284f936d4d193e694964f594553ca3da5a02ca92c7f91a9", "95f5000ef98419a2"),
        "seq128/val-00000.arrow": ("001ed2018dd1806084d72cfcead49112a79fc62b3052ae4b33de9c797ae424c8", "7875eda39b10f26c"),
        "seq64/train-00000.arrow": ("63c156b0578b5801df447f2ea64597a23a6d7109afde51629b7fc5526b3ea11f", "75887247c2550d9e"),
        "seq64/train-00001.arrow": ("04ac7f9e83473471b7edb69878043ae11a8613841499fd21859b8d36bc9c6251", "90ca6f163b1c7585"),
        "seq64/val-00000.arrow": ("4367e2b880f0d2134c378076bf948fc4e89681d02dc4e4396514203796de66c1", "e7863305c783211b"),
    },
    "static": {
        "seq48/train-00000.arrow": ("c3da34ac01aaa892af904a93869dacae5303eca92ca98ddc677f98efa43b79fe", "6dc9c6ca82a08dbc"),
        "seq48/train-00001.arrow": ("c5b42d60b13f33573397273a4aa165f67ca5c8c37040a91482877359c112f33d", "6d9e2ca9016a9cba"),
    },
    "dynamic": {
        "seq48/train-00000.arrow": ("6cda52c0b126eccf4d218d5c67b333187abe0b50fb46164fc1ee85f813642f06", "ebc52fddf6628ef9"),
        "seq48/train-00001.arrow": ("388921b06581d5896528d2ce76624a7eb39c3eb332650d5b70bb145bccf170c5", "24c4f2f62172069c"),
    },
}
MANIFEST_DIGEST = {
    "static-whole-word": "a9ebc84a31b90f5f3af6725ddbf695fdb16f264ca4c8817e2520530584622678",
    "static": "6d6244ee96727254dc4271ddfa5b3588135778fdc17f4e06524f94006444ea73",
    "dynamic": "f6d82944a0c80ff3e3aba410668f3dba28a7fe9abff52264599a6ed98196a60b",
}
# The identity keys the old code wrote to build_config.json: a folder it started must resume.
OLD_IDENTITY_KEYS = [
    "books", "docs_per_chunk", "dupe_factor", "hf_datasets", "hf_rows_per_doc", "hf_text_field", "lowercase",
    "mask_prob", "masking", "min_doc_chars", "num_shards", "num_val_shards", "seed", "seq_lens", "short_seq_prob",
    "skip_bad_files", "texts", "val_fraction", "vocab", "vocab_size", "whole_word", "wiki_dumps", "wikiextractor",
]


def row_digest(path: Path) -> str:
    """The rows' values, independent of how Arrow lays out the file's bytes."""
    rows = ipc.open_file(pa.memory_map(str(path), "r")).read_all().to_pydict()
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def manifest_digest(manifest: dict) -> str:
    """Without `config` (absolute paths), `tool_version`, and the keys added since: `segments` (the mode),
    `tokenizer` (the files that record the tokenizer beside the shards; the shards are the same) and `nsp_pools`
    (where random next segments came from: these one-shard builds widen no pool and self-draw nothing)."""
    kept = {k: v for k, v in manifest.items()
            if k not in ("config", "tool_version", "segments", "tokenizer", "nsp_pools")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("nsp_inputs"))



@pytest.mark.parametrize("name", list(BUILDS))
def test_default_nsp_shards_are_byte_identical_to_before(name: str, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / name
    assert build(corpus, out, "--workers", "1", *BUILDS[name]) == 0
    shards = sorted(p for p in out.rglob("*.arrow") if "work" not in p.parts)
    assert [str(p.relative_to(out)) for p in shards] == sorted(RECORDED[name])
    for path in shards:
        file_sha, rows = RECORDED[name][str(path.relative_to(out))]
        assert row_digest(path) == rows, f"{path}: the instances changed"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == file_sha, (
            f"{path}: same rows, other bytes: Arrow's file layout changed ({pa.__version__}); re-record"
        )
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest_digest(manifest) == MANIFEST_DIGEST[name]
    assert manifest["nsp_pools"]["shards_widened"] == {"train": 0, "val": 0}
    assert all(n == 0 for by_split in manifest["nsp_pools"]["self_draws"].values() for n in by_split.values())
    assert sorted(json.loads((out / "build_config.json").read_text(encoding="utf-8"))) == OLD_IDENTITY_KEYS
    assert sorted(manifest["config"]) == OLD_IDENTITY_KEYS
    assert Manifest.load(out).data["masking"]["mode"] == ("dynamic" if name == "dynamic" else "static")
