"""The ngrams step: one stage's text read again, document by document, its n-grams of normalised
words added to one Bloom filter per n the plan's suites count (`bloom.py`).

It reads exactly what the data step's document recorder reads (`documents.py`): each document's
bytes as the corpus yields them, or a chat record's turns joined, so a filter's bytes are those
the data step wrote when it recorded them inline (`tests/test_contamination.py` pins a digest
computed before the move). It writes only its filters; the token shards are the data step's.
Needs no torch and one thread: it is built beside training on the local engine
(`executor/loop/beside.py`), and at once with training on a cluster engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.canonical import digest
from buildtrain.config.steps import NgramsStep
from buildtrain.steps.corpus import corpus
from buildtrain.steps.ngrams.bloom import NgramFilter, NgramStream
from buildtrain.steps.sources import Source
from buildtrain.store.layout import ngram_file

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext

PROGRESS_EVERY = 10_000  # documents between two progress events


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    return record(NgramsStep.from_config(ctx.step.config), ctx.sources, out, ctx.log)


def record(step: NgramsStep, sources: Sequence[Source | Path], out: Path, log: Any) -> dict[str, str]:
    """Write a filter of each of `step.ngrams` into `out`; the digests the output declares (each
    file's, by name, and `ngrams` over them all)."""
    pairs = [(NgramStream(n), NgramFilter(n)) for n in step.ngrams]
    documents = 0
    for chunks in _documents(step, sources):
        for chunk in chunks:
            for stream, found in pairs:
                found.add(stream.update(chunk))
        for stream, found in pairs:
            found.add(stream.end())
        documents += 1
        if documents % PROGRESS_EVERY == 0:
            log.info("ngrams_progress", documents=documents)
    digests = {}
    for _, found in pairs:
        digests[ngram_file(found.n)] = found.write(out)
    log.info("ngrams_recorded", documents=documents, ngrams=list(step.ngrams))
    return {**digests, "ngrams": digest("ngrams-step", digests)}


def _documents(step: NgramsStep, sources: Sequence[Source | Path]) -> Iterator[Iterable[bytes]]:
    """Each document as its chunks of bytes, in the data step's order."""
    if step.text.format != "chat":
        for _, chunks in corpus(step.text, sources):
            yield chunks
        return
    from buildtrain.steps.data.chat import record_text, records  # a record's turns: one document

    for source in sources:
        for _, messages in records(source):
            yield [record_text(messages).encode("utf-8")]
