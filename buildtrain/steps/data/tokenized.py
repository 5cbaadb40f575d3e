"""The data step with a tokenizer step's tokenizer: split the text, encode in batches, write shards.

The text is split into train and held-out pieces exactly as the tokenizer step saw it (`pieces`),
then encoded a batch of pieces at a time with the library's batch encoder (parallel in Rust,
without offsets), so memory holds one batch, not the corpus. Encoding a piece does not depend on
the other pieces of its batch, so the batch size and the thread count cannot change the tokens;
encoding one batch overlaps reading the next.
Token ids go into uint16 shards while the vocabulary fits 65,536 ids, uint32 shards beyond.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain.config.steps import TextSettings
from buildtrain.steps.corpus import corpus
from buildtrain.steps.data.documents import Recorder
from buildtrain.steps.data.index import token_width
from buildtrain.steps.data.shards import ShardWriter, finish
from buildtrain.steps.sources import Source
from buildtrain.steps.tokenizer.files import load
from buildtrain.steps.tokenizer.pieces import Piece, pieces

ENCODE_BATCH_BYTES = 4 << 20  # text per batch encode call: large enough to keep every core busy


def _batches(cut: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Pieces in batches of about `ENCODE_BATCH_BYTES` of text, in order."""
    batch: list[Piece] = []
    size = 0
    for piece in cut:
        batch.append(piece)
        size += len(piece.text)
        if size >= ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def build_tokenized(
    text: TextSettings,
    shard_tokens: int,
    sources: Sequence[Source | Path],
    tokenizer_dir: Path,
    out: Path,
    log: Any,
) -> dict[str, str]:
    """Write shards of `shard_tokens` tokens and `data.json` into `out`; return the logical
    digests of the output."""
    tokenizer, description = load(tokenizer_dir)
    width = token_width(description["vocab_size"])
    dtype = np.uint16 if width == 2 else np.uint32
    end_of_document = description["end_of_document"]
    writers = {s: ShardWriter(out, s, shard_tokens, width) for s in ("train", "heldout")}
    counts = {"documents": 0, "pieces": 0}
    recorder = Recorder()

    def write(batch: list[Piece], encodings: list[Any]) -> None:
        ids: dict[bool, list[int]] = {False: [], True: []}
        for piece, encoding in zip(batch, encodings, strict=True):
            ids[piece.held_out].extend(encoding.ids)
            if piece.last:
                ids[piece.held_out].append(end_of_document)
                counts["documents"] += 1
        for held_out, split in ((False, "train"), (True, "heldout")):
            if ids[held_out]:
                writers[split].write(np.array(ids[held_out], dtype=dtype))
        counts["pieces"] += len(batch)
        log.info("data_progress", documents=counts["documents"], blocks=counts["pieces"])

    _encode_in_order(tokenizer, _batches(pieces(text, recorder.documents(corpus(text, sources)))), write)
    return finish(
        out,
        writers,
        tokenizer=description,
        documents=counts["documents"],
        blocks=counts["pieces"],
        units=f"{counts['pieces']} pieces of at most {text.split_block} bytes",
        log=log,
        recorder=recorder,
    )


def _encode_in_order(
    tokenizer: Any, batches: Iterable[list[Piece]], write: Callable[[list[Piece], list[Any]], None]
) -> None:
    """Encode each batch of pieces and `write` it with its encodings.

    The library releases the GIL while it encodes: batch k is encoded in a helper thread while
    this one reads and cuts the text of batch k + 1. Results are written in batch order."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: tuple[list[Piece], Future[Any]] | None = None

        def submit(batch: list[Piece]) -> None:
            nonlocal pending
            texts = [piece.text for piece in batch]
            future = pool.submit(tokenizer.encode_batch_fast, texts, add_special_tokens=False)
            if pending is not None:
                write(pending[0], pending[1].result())
            pending = (batch, future)

        for batch in batches:
            submit(batch)
        if pending is not None:
            write(pending[0], pending[1].result())
