"""The text a data or tokenizer step reads: the built-in synthetic corpus, or data files in plan
order, each document as (where, chunks of bytes). `where` names the file (and line or row group)
for error messages and never reaches a hash. Data files are read through `sources.py`, checked
against the plan as they are read. Needs no torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from buildtrain.config.steps import TextSettings
from buildtrain.steps.sources import Source
from buildtrain.steps.text import arithmetic_document


def corpus(text: TextSettings, sources: Sequence[Source | Path]) -> Iterator[tuple[str, Iterable[bytes]]]:
    """(where, chunks) of every document: the synthetic corpus, or the data files in plan order."""
    if text.source == "synthetic":
        synthetic = text.synthetic
        assert synthetic is not None, "the plan keeps the synthetic settings of a synthetic source"
        for index in range(synthetic.documents):
            yield (
                f"synthetic document {index}",
                (arithmetic_document(synthetic.seed, index, synthetic.lines),),
            )
        return
    from buildtrain.steps.formats import documents  # text, JSONL, Parquet

    yield from documents(text, list(sources))
