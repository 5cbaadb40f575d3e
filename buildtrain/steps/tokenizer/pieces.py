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

import attrs
import blake3

from buildtrain.canonical import canonical_bytes
from buildtrain.config.steps import TextSettings
from buildtrain.errors import StepFailed
from buildtrain.steps.seeds import MASK_63, derive_unit


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


def pieces(text: TextSettings, documents: Iterable[tuple[str, Iterable[bytes]]]) -> Iterator[Piece]:
    """Every piece of the corpus, in order, with its split."""
    limit, fraction = text.split_block, text.heldout_fraction
    unit = HeldOutUnit(text.split_seed)
    index = 0
    for where, chunks in documents:
        previous: bytes | None = None
        previous_start = start = 0
        for raw in cut(chunks, limit):
            if previous is not None:
                yield _piece(previous, where, previous_start, unit(index) < fraction, last=False)
                index += 1
            previous, previous_start = raw, start
            start += len(raw)
        assert previous is not None  # cut yields at least one piece
        yield _piece(previous, where, previous_start, unit(index) < fraction, last=True)
        index += 1


class HeldOutUnit:
    """`derive_unit(seed, "heldout", index)` without re-encoding the constant part for every piece
    (a tenth of the data step's time at 1 KB pieces): the canonical bytes of `[seed, "heldout",
    [index]]` are a fixed prefix, the index in decimal and `]]`. Checked against derive_unit here
    and in tests/test_tokenizer.py."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        encoded = canonical_bytes([seed, "heldout", [0]])
        assert encoded.endswith(b"0]]"), encoded
        self.prefix = encoded[:-3]
        assert self(12345) == derive_unit(seed, "heldout", 12345)

    def __call__(self, index: int) -> float:
        raw = blake3.blake3(self.prefix + str(index).encode() + b"]]").digest()[:8]
        return (int.from_bytes(raw, "little") & MASK_63) / (MASK_63 + 1)


def _piece(raw: bytes, where: str, offset: int, held_out: bool, last: bool) -> Piece:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StepFailed(
            f"{where}: not UTF-8 text at byte {offset + exc.start}; a trained or given tokenizer reads UTF-8 "
            '(data.tokenizer = "bytes" reads any bytes)'
        ) from None
    return Piece(text=text, held_out=held_out, last=last)
