"""A corpus in which facts repeat among varied sentences and filler, and the probes that ask for them.

The learning test (tests/pretrain/test_learns_facts.py) prepares it with data prep, pretrains on it and asks the
export, through `pipeline("fill-mask")`, for each fact's last word. A model that learned nothing (random weights)
cannot name them; one whose tokenizer, masking, labels, loss, weights or heads were wrong could not have learned them.
"""

from __future__ import annotations

import random
from pathlib import Path

CAPITALS = {
    "france": "paris", "italy": "rome", "spain": "madrid", "japan": "tokyo", "egypt": "cairo", "kenya": "nairobi",
    "peru": "lima", "chile": "santiago",
}
# Each fact is stated in one phrasing, the one the probe asks in, amid varied sentences that name the country. A
# two-layer model learns that within a few hundred steps; stated in five phrasings it needed several times as many
# (measured with a plain transformers training loop on the same corpus), too long for a test.
PROBE = "the capital of {country} is {mask} ."
FACT = "the capital of {country} is {capital} ."
COUNTRY_SENTENCES = (
    "{country} is a country with a long history .", "the people of {country} are proud of it .",
    "we travelled to {country} last summer .", "the flag of {country} has bright colours .",
    "{country} has mountains , rivers and farms .",
)
FILLERS = (
    "the old man walked to the market with his dog .", "she said that it was a long day .",
    "they would go home soon after the rain .", "a small red bag of bread lay on the table .",
    "the children played in the garden all afternoon .", "he read the letter twice before he answered .",
    "the train was late again this morning .", "we had soup and bread for dinner .",
)


def write_facts_corpus(path: Path, documents: int = 480, seed: int = 0) -> Path:
    """One sentence per line, a blank line between documents (data prep's --text format). Each document is about one
    country: its capital once (the fact sentence), the country named again in two other sentences, and filler, in
    shuffled order. The capital is never elsewhere in the document to be copied: it can only be predicted
    from the country, as in a probe."""
    rng = random.Random(seed)
    countries = sorted(CAPITALS)
    lines: list[str] = []
    for index in range(documents):
        country = countries[index % len(countries)]
        sentences = [FACT.format(country=country, capital=CAPITALS[country]),
                     *(template.format(country=country) for template in rng.sample(COUNTRY_SENTENCES, 2)),
                     rng.choice(FILLERS)]
        rng.shuffle(sentences)
        lines += [sentence[0].upper() + sentence[1:] for sentence in sentences]  # the uncased tokenizer lower-cases
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def probes(mask_token: str) -> dict[str, str]:
    """Probe text -> the word the model should put in the mask."""
    return {PROBE.format(country=country, mask=mask_token): capital for country, capital in CAPITALS.items()}
