"""What a data step's `ngrams.bloom` declares, read from its header: no numpy, no steps code.

The file (written by `steps/ngrams.py`) is little-endian 64-bit words: the format word, n, the
bits set per n-gram, the segment count, then each segment's capacity and item count, then the
bits. Its declared digest is the file's blake3 with n and the number of n-grams recorded, so a
pull or fsck re-derives it from the bytes alone (`kinds/data.py`).
"""

from __future__ import annotations

import blake3

from buildtrain.canonical import digest

FORMAT = 0x3130_6D61_7267_6E  # "ngram01" little-endian: the file's first word
WORD = 8


def _word(raw: bytes, index: int) -> int:
    start = index * WORD
    if start + WORD > len(raw):
        raise ValueError("ngrams.bloom ends inside its header")
    return int.from_bytes(raw[start : start + WORD], "little")


def filter_digest(raw: bytes) -> str:
    """The digest a data step declares for these `ngrams.bloom` bytes (ValueError: not such a file)."""
    if _word(raw, 0) != FORMAT:
        raise ValueError("ngrams.bloom is not an n-gram filter this buildtrain reads")
    n, count = _word(raw, 1), _word(raw, 3)
    items = sum(_word(raw, 5 + 2 * segment) for segment in range(count))
    return digest("ngrams", {"file": blake3.blake3(raw).hexdigest(), "n": n, "items": items})
