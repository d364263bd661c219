"""data_prep test helpers: tiny inputs the tests write themselves (an XML dump, a books folder,
a text file, a vocab), and the checks every build output must pass."""

from __future__ import annotations

import bz2
import hashlib
import random
from pathlib import Path

from data_prep.shard_format.atomic_io import sha256_file
from data_prep.shard_format.shards import Manifest, ShardReader
from data_prep.shard_format.vocab import load_vocab

WORDS = (
    "river mountain city history language music science people empire north south ancient modern "
    "village council trade market harbour winter summer station railway bridge castle forest "
    "painter writer scholar museum library garden theatre festival island valley province"
).split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


ARTICLE_MARKUP = """{{Infobox settlement|name=%(title)s|population=12345}}
'''%(title)s''' is a [[city]] in the [[North Province|north]] of the country.<ref>{{cite web|url=http://x.org|title=Ref}}</ref> %(p1)s
[[File:Harbour.jpg|thumb|The harbour of %(title)s at dawn]]
== History ==
%(p2)s<ref name="a">A footnote that must vanish.</ref>
{| class="wikitable"
! Year !! Population
|-
| 1900 || 5000
|}
=== Trade ===
* %(p3)s
%(p4)s
[[Category:Cities]]
[[de:%(title)s]]
"""


def _page(title: str, ns: int, text: str, redirect: str | None = None) -> str:
    redirect_tag = f'<redirect title="{redirect}" />' if redirect else ""
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{redirect_tag}"
        f'<revision><id>2</id><text xml:space="preserve">{escaped}</text></revision></page>\n'
    )


def write_wiki_dump(path: Path, articles: int = 6, seed: int = 0) -> list[str]:
    """A pages-articles dump with `articles` real articles plus pages that must be dropped."""
    rng = random.Random(seed)
    pages, titles = [], []
    for index in range(articles):
        title = f"Town {index}"
        titles.append(title)
        parts = {f"p{k}": paragraph(rng, rng.randint(3, 7)) for k in range(1, 5)}
        pages.append(_page(title, 0, ARTICLE_MARKUP % {"title": title, **parts}))
    pages.append(_page("Old Town", 0, "#REDIRECT [[Town 0]]", redirect="Town 0"))
    pages.append(_page("Town (disambiguation)", 0, "'''Town''' may refer to:\n* [[Town 0]]\n{{disambiguation}}"))
    pages.append(_page("Mercury", 0, "'''Mercury''' may be:\n* a planet\n* an element\n{{Disambig}}"))
    pages.append(_page("Talk:Town 0", 1, paragraph(rng, 5)))
    pages.append(_page("Template:Infobox", 10, "{{{name}}} " + paragraph(rng, 3)))
    xml = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">\n'
        "<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n" + "".join(pages) + "</mediawiki>\n"
    )
    data = xml.encode("utf-8")
    if path.suffix == ".bz2":
        data = bz2.compress(data)
    path.write_bytes(data)
    return titles


def write_books(folder: Path, books: int = 3, seed: int = 1) -> None:
    """Hard-wrapped books, one with a Project Gutenberg header and footer."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(books):
        paragraphs = []
        for _ in range(rng.randint(8, 14)):
            text = paragraph(rng, rng.randint(3, 8))
            words, lines, line = text.split(), [], ""
            for word in words:  # wrap at ~60 columns like Gutenberg texts
                if len(line) + len(word) > 60:
                    lines.append(line)
                    line = word
                else:
                    line = f"{line} {word}".strip()
            lines.append(line)
            paragraphs.append("\n".join(lines))
        body = "\n\n".join(paragraphs)
        if index == 0:
            body = (
                "The Project Gutenberg EBook of Test, by Nobody\nLicense boilerplate LICENSEWORD here.\n"
                "*** START OF THIS PROJECT GUTENBERG EBOOK TEST ***\n\n" + body +
                "\n\n*** END OF THIS PROJECT GUTENBERG EBOOK TEST ***\nMore LICENSEWORD text.\n"
            )
        (folder / f"book{index}.txt").write_text(body, encoding="utf-8")


def write_sentence_file(path: Path, documents: int = 12, seed: int = 2) -> None:
    rng = random.Random(seed)
    docs = ["\n".join(sentence(rng) for _ in range(rng.randint(4, 12))) for _ in range(documents)]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")


def write_vocab(path: Path, extra: tuple[str, ...] = ()) -> None:
    """A small uncased vocab covering WORDS (plus letters so nothing is [UNK])."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", *letters, *(f"##{c}" for c in letters)]
    tokens += [w for w in WORDS if w not in tokens] + list(extra)
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")


def check_output(out: Path, min_instances: int = 1) -> Manifest:
    """Assert the BERT invariants of every instance and the manifest's promises about the files."""
    manifest = Manifest.load(out)
    vocab = load_vocab(manifest.vocab_path)
    assert manifest.vocab_sha256 == sha256_file(manifest.vocab_path)
    ids = vocab.special_ids
    cls, sep, mask = ids["[CLS]"], ids["[SEP]"], ids["[MASK]"]
    max_predictions = manifest.data["masking"]["max_predictions"]
    for seq_len in manifest.seq_lens:
        for split in ("train", "val"):
            entry = manifest.data["seq_lens"][str(seq_len)][split]
            manifest.verify(seq_len, split, checksums=True)
            counts = [s["num_instances"] for s in entry["shards"]]
            if counts:
                assert max(counts) - min(counts) <= 1, counts
            assert sum(counts) == entry["num_instances"]
            reader = ShardReader(manifest, seq_len, split)
            random_next = 0
            for index in range(len(reader)):
                row = reader[index]
                tokens = row["input_ids"]
                a_len = row["a_len"]
                assert 5 <= len(tokens) <= seq_len
                assert int(tokens.max()) < vocab.size
                assert tokens[0] == cls and tokens[-1] == sep
                assert 3 <= a_len <= len(tokens) - 2
                if manifest.static_masking:
                    positions = row["masked_positions"]
                    assert 1 <= len(positions) <= max_predictions[str(seq_len)]
                    assert all(0 < p < len(tokens) - 1 and p != a_len - 1 for p in positions)
                    original = tokens.copy()
                    original[positions] = row["masked_label_ids"]
                    assert original[a_len - 1] == sep and (original == cls).sum() == 1
                    assert (original == sep).sum() == 2 and (original == mask).sum() == 0
                else:
                    assert tokens[a_len - 1] == sep and (tokens == sep).sum() == 2 and (tokens == cls).sum() == 1
                random_next += row["next_sentence_label"]
            if split == "train":
                assert len(reader) >= min_instances
                assert abs(random_next / len(reader) - entry["nsp_random_fraction"]) < 1e-6
                assert 0.35 < random_next / len(reader) < 0.7
    return manifest


def tree_digest(out: Path) -> dict[str, str]:
    """sha256 of every output file (shards, vocab, manifest) — what byte-identity compares."""
    files = [p for p in out.rglob("*.arrow") if "work" not in p.parts]
    files += [out / "vocab.txt", out / "manifest.json"]
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}
