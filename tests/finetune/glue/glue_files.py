"""Small GLUE files in each task's real format, written literally (not from pretrain/finetune/glue/tasks.py).

The headers and column orders below are copied from the official GLUE download (glue_data/TASK)
so that a mistake in the reader's layout table shows up as a failing test instead of being
repeated by the fixture. The sentences are ours, short, and use words the tiny tokenizer knows.
"""

from __future__ import annotations

import random
from pathlib import Path

SENTENCES = [
    "The lighthouse was built in 1871.", "The tower is painted with red and white bands.",
    "Bread is baked every morning.", "The bakery uses rye flour from the mill.",
    "The rowing race starts at the old stone bridge.", "The boats are made of carbon fibre.",
    "Sailors can see the tower during the day.", "The bakers make cardamom buns on Saturdays.",
    "The first race was held in 1902.", "The lamp was first lit with whale oil.",
    "The most popular loaf is a dark sourdough.", "The race ends at the boathouse.",
]

HEADERS = {
    "SST-2": "sentence\tlabel",
    "MRPC": "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
    "MRPC-test": "index\t#1 ID\t#2 ID\t#1 String\t#2 String",
    "STS-B": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
    "STS-B-test": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2",
    "QQP": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
    "QQP-test": "id\tquestion1\tquestion2",
    "MNLI-train": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
                  "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label",
    "MNLI-dev": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
                "sentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
    "MNLI-test": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
                 "sentence2_parse\tsentence1\tsentence2",
    "QNLI": "index\tquestion\tsentence\tlabel",
    "QNLI-test": "index\tquestion\tsentence",
    "PAIR": "index\tsentence1\tsentence2\tlabel",  # RTE and WNLI
    "PAIR-test": "index\tsentence1\tsentence2",
}
NLI = ("entailment", "neutral", "contradiction")
ENTAIL = ("entailment", "not_entailment")


def _pair(rng: random.Random) -> tuple[str, str]:
    return rng.choice(SENTENCES), rng.choice(SENTENCES)


def _parse(sentence: str) -> str:
    return "( " + " ".join(f"( {word} )" for word in sentence.rstrip(".").split()) + " . )"


def rows(title: str, split: str, count: int, rng: random.Random) -> list[str]:
    """`count` lines of `title`'s `split` (train, dev, test), in the official layout, header first."""
    test = split == "test"
    lines: list[str] = []
    for i in range(count):
        a, b = _pair(rng)
        binary = str(i % 2)
        if title == "CoLA":
            lines.append(f"{i}\t{a}" if test else f"gj04\t{binary}\t{'' if i % 2 else '*'}\t{a}")
        elif title == "SST-2":
            lines.append(f"{i}\t{a}" if test else f"{a.lower()} \t{binary}")
        elif title == "MRPC":
            ids = f"{700000 + 2 * i}\t{700001 + 2 * i}"
            lines.append(f"{i}\t{ids}\t{a}\t{b}" if test else f"{binary}\t{ids}\t{a}\t{b}")
        elif title == "STS-B":
            meta = f"{i}\tmain-captions\tMSRvid\t2012test\t{i + 1:04d}\tnone\tnone\t{a}\t{b}"
            lines.append(meta if test else f"{meta}\t{(i * 0.7) % 5:.3f}")
        elif title == "QQP":
            lines.append(f"{400000 + i}\t{a}\t{b}" if test else f"{133273 + i}\t{2 * i + 1}\t{2 * i + 2}\t{a}\t{b}\t{binary}")
        elif title == "MNLI":
            meta = f"{i}\t{31193 + i}\t{31193 + i}n\tfiction\t{_parse(a)}\t{_parse(b)}\t(ROOT {_parse(a)})\t(ROOT {_parse(b)})\t{a}\t{b}"
            label = NLI[i % 3]
            lines.append(meta if test else f"{meta}\t{label}\t{label}" if split == "train"
                         else f"{meta}\t{label}\t{label}\t{NLI[(i + 1) % 3]}\t{label}\t{label}\t{label}")
        elif title == "QNLI":
            question = a.rstrip(".") + "?"
            lines.append(f"{i}\t{question}\t{b}" if test else f"{i}\t{question}\t{b}\t{ENTAIL[i % 2]}")
        elif title in ("RTE", "WNLI"):
            label = ENTAIL[i % 2] if title == "RTE" else binary
            lines.append(f"{i}\t{a}\t{b}" if test else f"{i}\t{a}\t{b}\t{label}")
    header = {"CoLA": "index\tsentence" if test else None, "SST-2": "index\tsentence" if test else HEADERS["SST-2"],
              "MRPC": HEADERS["MRPC-test" if test else "MRPC"], "STS-B": HEADERS["STS-B-test" if test else "STS-B"],
              "QQP": HEADERS["QQP-test" if test else "QQP"],
              "MNLI": HEADERS["MNLI-test" if test else "MNLI-train" if split == "train" else "MNLI-dev"],
              "QNLI": HEADERS["QNLI-test" if test else "QNLI"], "RTE": HEADERS["PAIR-test" if test else "PAIR"],
              "WNLI": HEADERS["PAIR-test" if test else "PAIR"]}[title]
    return ([header] if header is not None else []) + lines


FILES = {"MNLI": (("train.tsv", "train"), ("dev_matched.tsv", "dev"), ("dev_mismatched.tsv", "dev"),
                  ("test_matched.tsv", "test"), ("test_mismatched.tsv", "test"))}
TITLES = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI")


def write_task(folder: Path, title: str, train: int = 8, dev: int = 6, test: int = 4, seed: int = 0) -> Path:
    """An official-layout GLUE folder for `title`: train.tsv, dev file(s), test file(s)."""
    rng = random.Random(f"{title}-{seed}")
    folder.mkdir(parents=True, exist_ok=True)
    counts = {"train": train, "dev": dev, "test": test}
    for name, split in FILES.get(title, (("train.tsv", "train"), ("dev.tsv", "dev"), ("test.tsv", "test"))):
        (folder / name).write_text("\n".join(rows(title, split, counts[split], rng)) + "\n", encoding="utf-8")
    return folder
