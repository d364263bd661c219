"""The SOURCES table: every input of the config, the CLI and the docs has its row; folders started
before the table still resume; the JSON-lines source, the table's proof, reads and refuses as documented.

The recorded identities below were written by the code before the table (main before issue 43's
sources item), with the same arguments: if they change, every output folder built so far refuses to resume.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from data_prep.__main__ import build_parser, config_from_args, main
from data_prep.build import BuildError, check_inputs, claim_output_folder, describe_inputs
from data_prep.config import NAMED_INPUTS, BuildConfig, ConfigError
from data_prep.input_plan import make_plan, read_shard
from data_prep.source_files import SourceError
from data_prep.sources import PARAGRAPH_LINES, SOURCES, read_jsonl
from tests.support.data_prep_fixtures import check_output, tree_digest, write_sentence_file, write_vocab
from tests.support.paths import REPO_ROOT

OLD_SOURCES = {  # row field -> the flag and value each old-source case passes
    "wiki_dumps": ["--wiki-dump", "/corpora/enwiki.xml.bz2"],
    "wikiextractor": ["--wikiextractor", "/corpora/extracted"],
    "books": ["--books", "/corpora/books"],
    "texts": ["--text", "/corpora/sample.txt"],
    "hf_datasets": ["--hf-dataset", "wikimedia/wikipedia:20231101.en"],
}
# sha256 of build_config.json (json.dumps(identity, indent=2, sort_keys=True)) as the old code wrote it,
# for `build --out /tmp/x --vocab /corpora/vocab.txt` plus one source
OLD_DIGESTS = {
    "wiki_dumps": "f647ba8026252048a0c0d289e8ac813320ed256e29f9da85287d04ecca2f0615",
    "wikiextractor": "719a292a2bdc984165588da7c22a99e894f42b80e59732ebe1fa35896e2961d1",
    "books": "07274b75ca28c08a4f2323b11ec5439914d9a4c63916f5a5aeb129aaf1d503e8",
    "texts": "88f2cf23c8bf601ced81d5f418b0ab6bd067530d0d34d0f4824d134433219b6f",
    "hf_datasets": "088b00107e11bf85d0f7dc947f525cf8c16a1a68cecc8696b279f290f784d2f9",
}
ALL_OLD_FLAGS = [
    "--wiki-dump", "/corpora/a.xml", "--wiki-dump", "/corpora/b.xml.bz2", "--wikiextractor", "/corpora/extracted",
    "--books", "/corpora/books", "--text", "/corpora/sample.txt", "--hf-dataset", "bookcorpus",
    "--hf-text-field", "sentence", "--hf-rows-per-doc", "50", "--skip-bad-files", "--segments", "full-sentences",
]
# build_config.json as the old code wrote it for ALL_OLD_FLAGS (every old source and option, not defaults)
ALL_OLD_IDENTITY = {
    "books": ["/corpora/books"], "docs_per_chunk": 256, "dupe_factor": 1, "hf_datasets": ["bookcorpus"],
    "hf_rows_per_doc": 50, "hf_text_field": "sentence", "lowercase": True, "mask_prob": 0.15, "masking": "dynamic",
    "min_doc_chars": 100, "num_shards": 8, "num_val_shards": 1, "seed": 12345, "segments": "full-sentences",
    "seq_lens": [128, 512], "short_seq_prob": 0.1, "skip_bad_files": True, "texts": ["/corpora/sample.txt"],
    "val_fraction": 0.0, "vocab": "/corpora/vocab.txt", "vocab_size": None, "whole_word": False,
    "wiki_dumps": ["/corpora/a.xml", "/corpora/b.xml.bz2"], "wikiextractor": ["/corpora/extracted"],
}
ALL_OLD_DIGEST = "a912f3522b0a3d6f987e9414d67b0b7397a3da56461f6a12fb942ab03bb54726"


def config(*flags: str, out: str = "/tmp/x") -> BuildConfig:
    return config_from_args(build_parser().parse_args(["build", "--out", out, *flags, "--workers", "1"]))


def digest(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, indent=2, sort_keys=True).encode()).hexdigest()


def build_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build", "--help"])
    return capsys.readouterr().out


def test_every_input_field_has_a_row_and_every_row_a_flag_and_a_doc_line(capsys) -> None:
    rows = {row.field: row for row in SOURCES}
    assert len(rows) == len(SOURCES) and len({row.flag for row in SOURCES}) == len(SOURCES)
    config_fields = {f.name: f for f in fields(BuildConfig)}
    # every tuple-of-paths field of the config is a source with a row; a newer row has no field of its own
    assert {name for name, f in config_fields.items() if f.type == "tuple[str, ...]"} == set(NAMED_INPUTS)
    assert set(NAMED_INPUTS) <= set(rows)
    assert all(name in NAMED_INPUTS or name not in config_fields for name in rows)
    options = [option for row in SOURCES for option in row.options]
    assert {o.field for o in options} >= {"hf_text_field", "hf_rows_per_doc"}
    help_text = build_help(capsys)
    doc = (REPO_ROOT / "docs" / "data_prep.md").read_text(encoding="utf-8")
    for flag in [row.flag for row in SOURCES] + [o.flag for o in options]:
        assert flag in help_text, flag
        assert f"`{flag}" in doc, f"docs/data_prep.md does not document {flag}"
    assert "--jsonl" in help_text.split("--skip-bad-files", 2)[2]  # its help names the rows that honour it


def test_an_older_output_folder_still_resumes(tmp_path) -> None:
    for name, flags in OLD_SOURCES.items():
        identity = config(*flags, "--vocab", "/corpora/vocab.txt").identity()
        assert digest(identity) == OLD_DIGESTS[name], name
    cfg = config(*ALL_OLD_FLAGS, "--vocab", "/corpora/vocab.txt", out=str(tmp_path / "out"))
    assert cfg.identity() == ALL_OLD_IDENTITY and digest(cfg.identity()) == ALL_OLD_DIGEST
    # the folder the old code started: build_config.json as it wrote it, resumed by the new code
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "build_config.json").write_text(json.dumps(ALL_OLD_IDENTITY, indent=2, sort_keys=True))
    claim_output_folder(cfg)
    # merge reads the recorded identity back: the same config
    assert BuildConfig.from_identity(ALL_OLD_IDENTITY, out=cfg.out, workers=1) == cfg
    # and a folder of another config is still refused
    with pytest.raises(BuildError, match=r"hf_rows_per_doc: 50 -> 2"):
        claim_output_folder(config(*ALL_OLD_FLAGS, "--hf-rows-per-doc", "2", "--vocab", "/corpora/vocab.txt",
                                   out=str(tmp_path / "out")))


def write_jsonl(folder: Path) -> None:
    (folder / "sub").mkdir(parents=True)
    rows = [{"title": "Ada", "text": "Ada wrote notes. She was first.\n\nShe lived in London."},
            {"id": 7, "text": "An id names this one."}]
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n", encoding="utf-8")
    (folder / "sub" / "a.jsonl").write_text(json.dumps({"text": "Untitled.\r\nTwo lines."}) + "\n", encoding="utf-8")
    (folder / "notes.txt").write_text("not read", encoding="utf-8")


def test_jsonl_reads_sorted_files_one_document_per_line(tmp_path) -> None:
    write_jsonl(tmp_path / "j")
    cfg = config("--jsonl", str(tmp_path / "j"), "--vocab-size", "100")
    assert cfg.identity()["inputs"] == {"jsonl": [str((tmp_path / "j").resolve())]}
    assert "input_options" not in cfg.identity()
    assert BuildConfig.from_identity(cfg.identity(), out=cfg.out, workers=1) == cfg
    assert describe_inputs(cfg) == f"--jsonl {(tmp_path / 'j').resolve()}"
    plan = make_plan(cfg)
    assert plan.num_shards == 1 and [Path(u.file).name for u in plan.shards[0]] == ["b.jsonl", "a.jsonl"]
    docs = list(read_shard(cfg, plan.shards[0]))
    assert [(d.source, d.title) for d in docs] == [("jsonl:b.jsonl", "Ada"), ("jsonl:b.jsonl", "7"),
                                                  ("jsonl:sub/a.jsonl", "a.jsonl#1")]
    assert docs[2].text == "Untitled.\nTwo lines." and {d.layout for d in docs} == {PARAGRAPH_LINES}
    with pytest.raises(SourceError, match=r"^--jsonl .*: 1 file\(s\) of no known kind .*: notes.txt; "):
        check_inputs(replace(cfg, out=str(tmp_path / "out")))  # a file it would leave out is named, never passed over
    check_inputs(replace(cfg, out=str(tmp_path / "out"), skip_bad_files=True))  # files fine, the folder claimed
    claim_output_folder(replace(cfg, out=str(tmp_path / "out"), skip_bad_files=True))  # and it resumes


@pytest.mark.parametrize(("line", "message"), [
    (b"{not json}", r"line 2: not JSON"),
    (b'{"title": "x"}', r'line 2: not an object with a string "text" field'),
    (b'["text"]', r'line 2: not an object with a string "text" field'),
    (b'{"text": "caf\xe9"}', r"line 2: not UTF-8"),
])
def test_a_bad_jsonl_line_is_named_or_skipped_and_counted(line: bytes, message: str, tmp_path, capsys) -> None:
    folder = tmp_path / "j"
    folder.mkdir()
    good = json.dumps({"text": "Fine."}).encode()
    (folder / "x.jsonl").write_bytes(good + b"\n" + line + b"\n" + good + b"\n" + line + b"\n")
    with pytest.raises(SourceError, match=rf"^--jsonl .*x.jsonl: {message}"):
        list(read_jsonl(folder))
    assert len(list(read_jsonl(folder, skip_bad_files=True))) == 2
    assert re.search(rf"warning: skipped \(--skip-bad-files\): --jsonl .*x.jsonl: 2 bad line\(s\) left out "
                     rf"\(first: {message}", capsys.readouterr().err)


def test_input_checks_name_the_file_before_work(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"^--jsonl .*empty: no text files in it"):
        check_inputs(config("--jsonl", str(tmp_path / "empty"), "--vocab-size", "100", out=str(tmp_path / "o")))
    with pytest.raises(ConfigError, match=r"^--hf-rows-per-doc 0: out of range"):
        check_inputs(config("--hf-dataset", "x", "--hf-rows-per-doc", "0", "--vocab-size", "100"))
    with pytest.raises(ConfigError, match="no input: give at least one of --wiki-dump, .*--jsonl, --hf-dataset"):
        config("--vocab-size", "100")


def test_a_jsonl_build_gives_the_shards_of_the_same_documents_from_wikiextractor(tmp_path) -> None:
    """End to end through the table: the same paragraphs as JSON lines or as WikiExtractor <doc>s (both a
    paragraph per line) make the same shards, and a rerun of the --jsonl build resumes its folder."""
    write_vocab(tmp_path / "vocab.txt")
    write_sentence_file(tmp_path / "corpus.txt", documents=20)
    documents = [t.split("\n") for t in (tmp_path / "corpus.txt").read_text(encoding="utf-8").strip().split("\n\n")]
    texts = [" ".join(d[: len(d) // 2]) + "\n" + " ".join(d[len(d) // 2 :]) for d in documents]  # 2 paragraphs
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "docs.jsonl").write_text(
        "".join(json.dumps({"title": f"Doc {i}", "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "wiki_00").write_text(
        "".join(f'<doc id="{i}" url="u" title="Doc {i}">\nDoc {i}\n{t}\n</doc>\n' for i, t in enumerate(texts)),
        encoding="utf-8")
    flags = ["--vocab", str(tmp_path / "vocab.txt"), "--seq-lens", "64", "--num-shards", "1", "--workers", "1"]
    for source in ("jsonl", "wikiextractor"):
        folder = tmp_path / ("wiki" if source == "wikiextractor" else source)
        assert main(["build", "--out", str(tmp_path / f"out_{source}"), f"--{source}", str(folder), *flags]) == 0
        assert check_output(tmp_path / f"out_{source}").data["totals"]["documents"] == 20
    jsonl, wiki = tree_digest(tmp_path / "out_jsonl"), tree_digest(tmp_path / "out_wikiextractor")
    assert jsonl["seq64/train-00000.arrow"] == wiki["seq64/train-00000.arrow"]
    assert main(["build", "--out", str(tmp_path / "out_jsonl"), "--jsonl", str(tmp_path / "jsonl"), *flags]) == 0
