"""The step monitors' tag table in docs/pretraining.md is what pretrain/metrics/tag_doc.py generates now from the
registered monitors' `Tags:` lines: a monitor added, or a tag renamed, fails here until the table is regenerated
(`python -m pretrain.metrics.tag_doc --write`)."""

from __future__ import annotations

from pretrain.metrics.monitor_contract import TagDoc, documented_tags
from pretrain.metrics.monitor_registry import step_monitors
from pretrain.metrics.tag_doc import DOC_FILE, documented_table, logged_cell, markdown_table


def test_the_docs_monitor_tag_table_is_the_generated_one() -> None:
    documented, generated = documented_table(DOC_FILE.read_text(encoding="utf-8")), markdown_table()
    stale = sorted(set(documented.splitlines()) ^ set(generated.splitlines()))
    assert documented == generated, f"run python -m pretrain.metrics.tag_doc --write; rows that differ: {stale}"


def test_every_tag_of_every_registered_monitor_has_one_row() -> None:
    table = markdown_table().splitlines()
    tags = [tag.tag for monitor in step_monitors(128) for tag in documented_tags(monitor)]
    assert len(tags) >= 15 and len(set(tags)) == len(tags)
    for tag in tags:
        assert sum(row.startswith(f"| `{tag}`") for row in table) == 1, tag
    assert "| `lamb/trust_ratio` (histogram) | every step, ExactLamb |" in "\n".join(table)
    assert logged_cell(TagDoc("a", frozenset(), "b")) == "every step"
    assert logged_cell(TagDoc("a", frozenset({"cuda"}), "b")) == "every step, CUDA"
    assert logged_cell(TagDoc("a", frozenset({"window", "histogram"}), "b")) == "each slow-rank window's end"
