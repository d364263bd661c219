"""The `--hf-dataset` reader: a Hugging Face dataset, streamed from the Hub or read from a saved folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from data_prep.documents import PARAGRAPH_LINES, RawDocument
from data_prep.source_files import SourceError


def read_hf_dataset(spec: str, text_field: str = "text", rows_per_doc: int = 1) -> Iterator[RawDocument]:
    """`NAME[:CONFIG]` through `datasets` (streaming from the Hub), or a `save_to_disk` folder.

    Each row is a document, or `rows_per_doc` consecutive rows are one (bookcorpus stores one
    sentence per row and no book boundaries).
    """
    import datasets  # imported here: it is slow to import and only this source needs it

    name, _, config = spec.partition(":")
    saved = Path(name)
    if saved.is_dir() and ((saved / "dataset_dict.json").is_file() or (saved / "state.json").is_file()):
        loaded = datasets.load_from_disk(name)
        dataset = loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        try:
            dataset = datasets.load_dataset(name, config or None, split="train", streaming=True)
        except Exception as err:  # datasets raises many types (hub, file, config errors)
            raise SourceError(f"--hf-dataset {spec}: cannot load ({type(err).__name__}: {err})") from err
    source = f"hf:{spec}"
    layout = PARAGRAPH_LINES  # a row is a paragraph (wikipedia, wikitext) or a sentence (bookcorpus)
    buffer: list[str] = []
    first_title = ""
    for index, row in enumerate(dataset):
        if text_field not in row:
            raise SourceError(f"--hf-dataset {spec}: rows have no {text_field!r} field (fields: {sorted(row)})")
        if not buffer:
            first_title = str(row.get("title") or f"{spec}#{index}")
        buffer.append(str(row[text_field]))
        if len(buffer) >= rows_per_doc:
            yield RawDocument(source, first_title, "\n".join(buffer), layout)
            buffer = []
    if buffer:
        yield RawDocument(source, first_title, "\n".join(buffer), layout)
