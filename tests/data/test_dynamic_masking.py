"""Dynamic masking (data_prep/shard_format/masking.py `mask_ids`, what collate runs on unmasked shards) over ~250k
tokens: BERT's rate, its 80/10/10 split, and random replacements that are never a special token, the same set
of ids static masking (`mask_instance`, the same module) draws from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_prep.shard_format.masking import SpecialIds, mask_ids, never_replacements, replacement_ids
from data_prep.shard_format.vocab import Vocab, load_vocab

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = 300  # ordinary tokens, a third of them '##' pieces


def write_vocab(path: Path, specials_last: bool = False) -> Path:
    """Specials first (as data_prep writes them) or scattered between ordinary tokens (as a foreign vocab may)."""
    words = [f"##w{i}" if i % 3 == 2 else f"w{i}" for i in range(WORDS)]
    tokens = [*SPECIALS, *words]
    if specials_last:
        tokens = words[:100] + SPECIALS[:2] + words[100:200] + SPECIALS[2:] + words[200:]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("specials_last", [False, True])
@pytest.mark.parametrize(("mask_prob", "whole_word"), [(0.15, False), (0.30, True)])
def test_dynamic_masking_rate_split_and_no_special_replacements(tmp_path: Path, specials_last: bool,
                                                                 mask_prob: float, whole_word: bool) -> None:
    vocab = Vocab.load(write_vocab(tmp_path / "vocab.txt", specials_last))
    index = {token: i for i, token in enumerate((tmp_path / "vocab.txt").read_text().splitlines())}
    special_ids = {index[t] for t in SPECIALS}
    ordinary = np.array(sorted(set(range(vocab.size)) - special_ids))
    lengths = np.random.default_rng(0).integers(64, 447, 1000)  # ~255k tokens
    cap = 160
    masked_total = tokens = mask = kept = random_ = 0
    drawn: list[np.ndarray] = []
    for i, n in enumerate(lengths):
        body = ordinary[np.random.default_rng([1, i]).integers(0, len(ordinary), n - 2)]
        ids = np.concatenate([[vocab.cls_id], body, [vocab.sep_id]])
        masked, positions, labels = mask_ids(ids, vocab, mask_prob, cap, whole_word, np.random.default_rng([7, i]))
        assert np.array_equal(labels, ids[positions]) and np.array_equal(np.delete(masked, positions),
                                                                          np.delete(ids, positions))
        after = masked[positions]
        replaced = (after != vocab.mask_id) & (after != labels)
        drawn.append(after[replaced])
        masked_total += len(positions)
        tokens += n
        mask += int((after == vocab.mask_id).sum())
        kept += int((after == labels).sum())
        random_ += int(replaced.sum())
    drawn_ids = np.concatenate(drawn)
    assert tokens > 200_000 and len(drawn_ids) > 2_000
    # Old behaviour drew one of the 5 specials for 5 / 305 of the replacements: ~60 here, never 0 by chance.
    assert not set(drawn_ids.tolist()) & special_ids
    assert len(set(drawn_ids.tolist())) > 0.95 * len(ordinary)  # and every ordinary id can be drawn
    # The rate: BERT's count per instance (whole words may leave a slot or two of the target unfilled).
    target = sum(min(cap, max(1, round(int(n) * mask_prob))) for n in lengths)
    assert target * (0.99 if whole_word else 1.0) <= masked_total <= target
    assert abs(masked_total / tokens - mask_prob) < 0.005
    # 80 / 10 / 10 (a random draw of the original id, 1 in 300, counts as kept).
    assert abs(mask / masked_total - 0.8) < 0.01
    assert abs(kept / masked_total - 0.1) < 0.006
    assert abs(random_ / masked_total - 0.1) < 0.006


def test_dynamic_and_static_masking_share_the_replacement_ids(tmp_path: Path) -> None:
    """The loader's Vocab takes its ids from data_prep's one definition: every id but [CLS], [SEP], [PAD],
    [MASK] and [UNK]; a vocab without [UNK] (the loader does not require it) keeps out the other four."""
    path = write_vocab(tmp_path / "vocab.txt", specials_last=True)
    ids = load_vocab(path).special_ids
    special = SpecialIds(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"], ids["[UNK]"])
    assert np.array_equal(Vocab.load(path).replacements, replacement_ids(len(SPECIALS) + WORDS, special))
    assert set(Vocab.load(path).replacements.tolist()) == set(range(len(SPECIALS) + WORDS)) - set(ids.values())
    assert never_replacements(special) == set(ids.values())
    without_unk = tmp_path / "no_unk.txt"
    without_unk.write_text("\n".join(t for t in path.read_text().splitlines() if t != "[UNK]") + "\n")
    vocab = Vocab.load(without_unk)
    assert len(vocab.replacements) == WORDS
    assert {vocab.cls_id, vocab.sep_id, vocab.pad_id, vocab.mask_id}.isdisjoint(vocab.replacements.tolist())
