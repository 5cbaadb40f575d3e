"""Digests of documents, for the contamination check: which suite questions a model was trained on.

Every data step records the digest of each document it read (`documents.u64`: sorted, distinct,
little-endian 64-bit digests, one per document), and an eval step digests each suite question the
same way; the overlap is the intersection. Normalisation, applied to the bytes as they stream by:
ASCII letters lowercased, each run of ASCII whitespace made one space, whitespace at either end
dropped. The digest is the first 8 bytes of the blake3 of the normalised bytes: a false match
between two different documents has a chance of about n / 2**64 per question for n documents.

The cost on a large corpus: one extra pass of `translate` and `replace` over each document's chunks (up
to `MAX_DOCUMENT` bytes: a longer document is not digested, since no question is that long),
blake3, and 8 bytes of memory and disk per document (800 MB for 10**8 documents, sorted once at
the end).
A data step reads both splits, so its digests cover the held-out documents too: the check
over-reports what the weights saw, never under-reports it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import blake3
import numpy as np

from buildtrain.canonical import digest
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.store.layout import DOCUMENTS

# A question is never this long: a longer document is not digested (it cannot equal one), which
# bounds the cost of a corpus of huge documents. 80 MB of plain text as one document took the byte
# data step from 99 ms to 820 ms when every byte was normalised (benchmarks/data_step.py --quick).
MAX_DOCUMENT = 1 << 20
# ASCII letters to lower case, ASCII whitespace (what bytes.split() splits on) to a space: one
# translate and a few replaces: 138 MB/s over 1 KB documents where split and join gave 79 MB/s.
NORMAL = bytes(32 if b in b" \t\n\r\x0b\x0c" else b + 32 if 65 <= b <= 90 else b for b in range(256))
TOO_LONG = -1  # the value of a document past MAX_DOCUMENT (never recorded)


class DocumentDigest:
    """The digest of one document's normalised bytes, fed in chunks cut anywhere."""

    def __init__(self) -> None:
        self.hasher = blake3.blake3()
        self.started = False  # a word was written: a later space goes between two words
        self.space = False  # whitespace seen since the last word
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > MAX_DOCUMENT:
            return
        spaced = chunk.translate(NORMAL)  # letters lowercased, each whitespace byte a space
        while b"  " in spaced:  # runs of spaces to one (each pass halves them)
            spaced = spaced.replace(b"  ", b" ")
        words = spaced.strip(b" ")
        if not words:
            self.space = self.space or bool(chunk)
            return
        if self.started and (self.space or spaced[:1] == b" "):
            self.hasher.update(b" ")
        self.hasher.update(words)
        self.started = True
        self.space = spaced[-1:] == b" "

    def value(self) -> int:
        if self.size > MAX_DOCUMENT:
            return TOO_LONG
        return int.from_bytes(self.hasher.digest(8), "little")


def digest_text(text: str) -> int:
    """The digest of a whole text (a suite question)."""
    document = DocumentDigest()
    document.update(text.encode("utf-8"))
    return document.value()


class Recorder:
    """Digests of the documents a data step reads, as it reads them. (Their n-grams are the
    ngrams step's, `steps/ngrams/`, which reads the same documents again: a filter inline cost
    the byte data step 4.2x its time, issue 46.)"""

    def __init__(self) -> None:
        self.values = array("Q")

    def documents(
        self, stream: Iterable[tuple[str, Iterable[bytes]]]
    ) -> Iterator[tuple[str, Iterable[bytes]]]:
        """`stream` (the corpus: (where, chunks) per document) passed through, each document's
        chunks digested as the consumer reads them."""
        for where, chunks in stream:
            yield where, self._chunks(chunks)

    def _chunks(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        document = DocumentDigest()
        for chunk in chunks:
            document.update(bytes(chunk))
            yield chunk
        value = document.value()
        if value != TOO_LONG:
            self.values.append(value)

    def add_text(self, text: str) -> None:
        """A document given whole (a chat record: its turns' contents, joined)."""
        self.values.append(digest_text(text))

    def write(self, out: Path) -> dict[str, str]:
        """Write `documents.u64` into `out`; the digest the output declares for it, by file name."""
        values = np.unique(np.frombuffer(self.values, dtype=np.uint64)).astype("<u8")
        raw = values.tobytes()
        write_bytes_durably(out / DOCUMENTS, raw)
        return {
            DOCUMENTS: digest("documents", {"file": blake3.blake3(raw).hexdigest(), "count": len(values)})
        }


def read_documents(output: Path) -> np.ndarray | None:
    """A data step output's sorted document digests, or None for an output that has none."""
    path = output / DOCUMENTS
    if not path.is_file():
        return None
    return np.frombuffer(path.read_bytes(), dtype="<u8")


def overlap(trained: np.ndarray, texts: list[str]) -> list[int]:
    """The indices of `texts` whose digest is among `trained` (sorted)."""
    if not len(trained):  # no document digested (each over MAX_DOCUMENT): nothing to match
        return []
    wanted = np.array([digest_text(text) for text in texts], dtype=np.uint64)
    at = np.searchsorted(trained, wanted)
    found = (at < len(trained)) & (trained[np.minimum(at, len(trained) - 1)] == wanted)
    return [int(i) for i in np.flatnonzero(found)]
