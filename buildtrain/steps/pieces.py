"""Text split into train and held-out before any tokenizer sees it.

A trained tokenizer must learn from the training text only, yet the byte tokenizer's split is made
in token space, after tokenization. So with a tokenizer step the split is made in text space, once,
the same way for the tokenizer step and the data step: every document is cut into pieces of at most
`split_block` bytes (after the last newline that fits, else at a character boundary), pieces are
numbered across the corpus, and piece `i` is held out when the keyed unit `derive_unit(split_seed,
"heldout", i)` is below `heldout_fraction`. Each document ends with an end-of-document token in the
split of its last piece. The assignment depends on the text alone, never on the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import StepFailed
from buildtrain.steps.seeds import derive_unit


@attrs.frozen
class Piece:
    text: str
    held_out: bool
    last: bool  # the document's last piece: its end-of-document token follows


def cut(chunks: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """One document as pieces of at most `limit` bytes; at least one (maybe empty) piece."""
    buffer, emitted = b"", False
    for chunk in chunks:
        buffer += chunk
        position = 0
        while len(buffer) - position > limit:
            end = position + limit
            newline = buffer.rfind(b"\n", position, end)
            if newline >= position:
                end = newline + 1
            else:  # never cut inside a UTF-8 sequence: back off over continuation bytes
                while end > position and buffer[end] & 0xC0 == 0x80:
                    end -= 1
                if end == position:
                    end = position + limit  # not UTF-8 at all; decoding reports it
            yield buffer[position:end]
            emitted = True
            position = end
        buffer = buffer[position:]  # less than one piece stays behind
    if buffer or not emitted:
        yield buffer


def pieces(config: dict[str, Any], documents: Iterable[tuple[str, Iterable[bytes]]]) -> Iterator[Piece]:
    """Every piece of the corpus, in order, with its split."""
    limit, fraction, seed = config["split_block"], config["heldout_fraction"], config["split_seed"]
    index = 0
    for where, chunks in documents:
        previous: bytes | None = None
        previous_start = start = 0
        for raw in cut(chunks, limit):
            if previous is not None:
                yield _piece(previous, where, previous_start, index, seed, fraction, last=False)
                index += 1
            previous, previous_start = raw, start
            start += len(raw)
        assert previous is not None  # cut yields at least one piece
        yield _piece(previous, where, previous_start, index, seed, fraction, last=True)
        index += 1


def _piece(raw: bytes, where: str, offset: int, index: int, seed: int, fraction: float, last: bool) -> Piece:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StepFailed(
            f"{where}: not UTF-8 text at byte {offset + exc.start}; a trained or given tokenizer reads UTF-8 "
            '(data.tokenizer = "bytes" reads any bytes)'
        ) from None
    return Piece(text=text, held_out=derive_unit(seed, "heldout", index) < fraction, last=last)


def corpus(config: dict[str, Any], sources: list[Path]) -> Iterator[tuple[str, Iterable[bytes]]]:
    """(where, chunks) of every document: the synthetic corpus, or the data files in plan order."""
    if config["source"] == "synthetic":
        from buildtrain.steps.data import arithmetic_document

        synthetic = config["synthetic"]
        for index in range(synthetic["documents"]):
            text = arithmetic_document(synthetic["seed"], index, synthetic["lines"])
            yield f"synthetic document {index}", (text,)
        return
    from buildtrain.steps.formats import documents

    yield from documents(config, sources)
