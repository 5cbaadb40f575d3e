"""What an ngrams step's `ngrams.bloom` declares, read from its header: no numpy, no steps code.

The file (written by `steps/ngrams/bloom.py`) is little-endian 64-bit words: the format word, n, the
bits set per n-gram, the segment count, then each segment's capacity and item count, then the
bits. Its declared digest is the file's blake3 with n and the number of n-grams recorded, so a
pull or fsck re-derives it from the bytes alone (`kinds/ngrams.py`; `kinds/data.py` for a data
step's output from before the ngrams kind, which held its filters itself).
"""

from __future__ import annotations

import attrs
import blake3

from buildtrain.canonical import digest

FORMAT = 0x3130_6D61_7267_6E  # "ngram01" little-endian: the file's first word
WORD = 8


def _word(raw: bytes, index: int) -> int:
    start = index * WORD
    if start + WORD > len(raw):
        raise ValueError("ngrams.bloom ends inside its header")
    return int.from_bytes(raw[start : start + WORD], "little")


@attrs.frozen
class Header:
    n: int  # words per n-gram
    hashes: int  # bits set per n-gram
    segments: tuple[tuple[int, int], ...]  # (capacity, items) of each segment, in file order
    bits_at: int  # the word where the first segment's bits start


def read_header(raw: bytes) -> Header:
    """The header of `ngrams.bloom` bytes (ValueError: not such a file)."""
    if _word(raw, 0) != FORMAT:
        raise ValueError("ngrams.bloom is not an n-gram filter this buildtrain reads")
    count = _word(raw, 3)
    segments = tuple((_word(raw, 4 + 2 * i), _word(raw, 5 + 2 * i)) for i in range(count))
    return Header(n=_word(raw, 1), hashes=_word(raw, 2), segments=segments, bits_at=4 + 2 * count)


def filter_digest(raw: bytes) -> str:
    """The digest an output declares for these `ngrams.bloom` bytes (ValueError: not such a file)."""
    header = read_header(raw)
    items = sum(items for _, items in header.segments)
    return digest("ngrams", {"file": blake3.blake3(raw).hexdigest(), "n": header.n, "items": items})
