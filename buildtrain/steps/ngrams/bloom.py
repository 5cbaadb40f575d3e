"""N-grams of the training text, for the contamination check: which suite questions share a run of
`NGRAM` words with the documents a model was trained on (GPT-3's and lm-eval's decontamination).

Words are normalised as lm-eval's decontamination does: ASCII letters lowercased, ASCII punctuation
deleted ("don't" is "dont"), the text split on ASCII whitespace (other bytes, UTF-8 included, are
word bytes). A word's hash is FNV-1a (64 bits) of its bytes; an n-gram's is a polynomial of its
words' hashes (rolled forward one word at a time), finalised with splitmix64 and the word count.
N-grams never cross a document's end. A document of fewer than `NGRAM` words (a question, or a
short training document) is one n-gram of all its words: a short question counts only when it is
a whole short training document, as the exact tier (`documents.py`) would also find.

The ngrams step (`step.py`) adds a stage's n-grams to a Bloom filter (`ngrams.bloom`; a filter
of its own, `ngrams-N.bloom`, for each other n its config lists, which suites ask for), grown in
segments as the text arrives (a scalable Bloom filter): segment i holds up to `FIRST_ITEMS << i` n-grams in
`BITS_PER_ITEM` bits each, so memory and disk are at most 4 bytes per word read (8 while the
last segment fills), and the filter's bytes depend on the text alone. Each n-gram sets `HASHES`
bits in one block of 512 bits (one cache line: one miss per n-gram). A full segment answers
"present" for an absent n-gram with a chance of about 1e-5 (fill ** HASHES, fill 0.22); the eval
reports the rate estimated from each segment's real fill, summed over segments.

The hashing is in C (`bloom.c`, built like `short_blake3.c`: integer arithmetic, the same bits
on any machine), with the Python below as the fallback and as the reference tests hold it to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain import native
from buildtrain.errors import StepFailed
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.store.layout import DEFAULT_NGRAM, NGRAMS, ngram_file
from buildtrain.store.ngram_file import FORMAT, filter_digest, read_header

SOURCE = Path(__file__).with_suffix(".c")
NGRAM = DEFAULT_NGRAM  # words per n-gram unless a suite asks for another (GPT-3's and lm-eval's)
FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3
POLY = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
HASHES = 8  # bits set per n-gram, all in one block of 512 bits
BITS_PER_ITEM = 32
FIRST_ITEMS = 1 << 12  # the first segment's n-grams (16 KB); each next segment holds twice as many
BLOCK_WORDS = 8
WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")
PUNCTUATION = (
    frozenset(range(33, 48))
    | frozenset(range(58, 65))
    | frozenset(range(91, 97))
    | frozenset(range(123, 127))
)
STATE_WORDS = 4  # word hash so far, in a word, words so far, rolling polynomial; then the ring


def mix(x: int) -> int:
    """splitmix64's finaliser."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def fresh_state(n: int = NGRAM) -> np.ndarray:
    state = np.zeros(STATE_WORDS + n, dtype=np.uint64)
    state[0] = FNV_OFFSET
    return state


def python_ngrams(text: bytes, state: np.ndarray, n: int) -> list[int]:
    """`bloom.c`'s `bt_ngrams`, one byte at a time: the fallback and the reference."""
    word, in_word, words, rolling = (int(v) for v in state[:STATE_WORDS])
    ring, power, out = state[STATE_WORDS:], pow(POLY, n, 1 << 64), []
    for c in text:
        if c in WHITESPACE:
            if in_word:
                slot = words % n
                old = int(ring[slot]) * power if words >= n else 0
                rolling = (rolling * POLY + word - old) & MASK
                ring[slot] = word
                words += 1
                if words >= n:
                    out.append(mix((rolling + n) & MASK))
                word, in_word = FNV_OFFSET, 0
        elif c not in PUNCTUATION:
            c = c + 32 if 65 <= c <= 90 else c
            word, in_word = ((word ^ c) * FNV_PRIME) & MASK, 1
    state[:STATE_WORDS] = [word, in_word, words, rolling]
    return out


@functools.cache
def _compiled() -> tuple[Callable[..., int], Callable[..., None]] | None:
    """The C functions, or None where this machine cannot build them (Python then)."""
    library = native.load_if_possible(SOURCE, threaded=False)
    if library is None:
        return None
    import ctypes  # only here: `bt plan` imports nothing that needs it

    pointer, long = ctypes.c_void_p, ctypes.c_long
    grams, add = library.bt_ngrams, library.bt_bloom_add
    grams.argtypes = [pointer, long, pointer, long, ctypes.c_uint64, pointer]
    grams.restype = long
    add.argtypes = [pointer, long, pointer, long]
    add.restype = None
    return grams, add


class NgramStream:
    """The n-gram hashes of one document after another, fed in chunks cut anywhere."""

    def __init__(self, n: int = NGRAM, *, compiled: bool = True) -> None:
        self.n, self.power = n, pow(POLY, n, 1 << 64)
        self.functions = _compiled() if compiled else None
        self.state = fresh_state(n)
        self.buffer = np.empty(0, dtype=np.uint64)

    def update(self, chunk: bytes | memoryview) -> np.ndarray:
        """The hashes of the n-grams that end in `chunk` (a view valid until the next call)."""
        if self.functions is None:
            return np.array(python_ngrams(bytes(chunk), self.state, self.n), dtype=np.uint64)
        room = len(chunk) // 2 + 1  # a word ends at a whitespace byte after a word byte
        if len(self.buffer) < room:
            self.buffer = np.empty(max(room, 2 * len(self.buffer)), dtype=np.uint64)
        text = np.frombuffer(chunk, dtype=np.uint8) if len(chunk) else np.zeros(1, np.uint8)
        count = self.functions[0](
            text.ctypes.data, len(chunk), self.state.ctypes.data, self.n, self.power, self.buffer.ctypes.data
        )
        return self.buffer[:count]

    def end(self) -> np.ndarray:
        """The last n-grams of the document (a short one's only one), and a fresh state."""
        last = self.update(b" ").copy()  # ends the last word
        words, rolling = int(self.state[2]), int(self.state[3])
        if 0 < words < self.n:  # fewer words than an n-gram: all of them are its one n-gram
            last = np.array([mix((rolling + words) & MASK)], dtype=np.uint64)
        self.state = fresh_state(self.n)
        return last


def text_ngrams(text: str, n: int = NGRAM) -> np.ndarray:
    """The n-gram hashes of a whole text (a suite question, a chat record), as the step records them."""
    stream = NgramStream(n)
    first = stream.update(text.encode("utf-8")).copy()
    return np.concatenate([first, stream.end()])


def python_add(filter_words: np.ndarray, hashes: np.ndarray) -> None:
    """`bloom.c`'s `bt_bloom_add` in numpy."""
    blocks = len(filter_words) // BLOCK_WORDS
    block, positions = _positions(hashes, blocks)
    for bit in positions:
        np.bitwise_or.at(
            filter_words, block * BLOCK_WORDS + (bit >> 6), np.uint64(1) << (bit & np.uint64(63))
        )


def _positions(hashes: np.ndarray, blocks: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each hash's block and its `HASHES` bit positions in it."""
    hashes = hashes.astype(np.uint64)
    bits = _mix_array(hashes ^ np.uint64(POLY))
    block = (hashes >> np.uint64(9)) & np.uint64(blocks - 1)
    positions = [(bits >> np.uint64(9 * j)) & np.uint64(511) for j in range(HASHES - 1)]
    return block, [*positions, hashes & np.uint64(511)]


def _mix_array(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class Segment:
    """One segment of the filter: room for `capacity` n-grams."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.items = capacity, 0
        self.words = np.zeros(capacity * BITS_PER_ITEM // 64, dtype=np.uint64)

    def add(self, hashes: np.ndarray, functions: Any) -> None:
        if functions is None:
            python_add(self.words, hashes)
        else:
            functions[1](
                self.words.ctypes.data, len(self.words) // BLOCK_WORDS, hashes.ctypes.data, len(hashes)
            )
        self.items += len(hashes)


class NgramFilter:
    """The Bloom filter of every n-gram of a stage's text, grown a segment at a time."""

    def __init__(self, n: int = NGRAM, *, compiled: bool = True) -> None:
        self.n = n
        self.functions = _compiled() if compiled else None
        self.segments = [Segment(FIRST_ITEMS)]

    def add(self, hashes: np.ndarray) -> None:
        while len(hashes):
            last = self.segments[-1]
            if last.items == last.capacity:
                last = Segment(2 * last.capacity)
                self.segments.append(last)
            take = min(len(hashes), last.capacity - last.items)
            last.add(np.ascontiguousarray(hashes[:take]), self.functions)
            hashes = hashes[take:]

    def to_bytes(self) -> bytes:
        """The file: FORMAT, n, HASHES, segment count, (capacity, items) per segment, the bits."""
        header = [FORMAT, self.n, HASHES, len(self.segments)]
        for segment in self.segments:
            header += [segment.capacity, segment.items]
        words = [np.array(header, dtype="<u8"), *(s.words.astype("<u8", copy=False) for s in self.segments)]
        return b"".join(memoryview(w) for w in words)  # one copy: 80 MB of text, 67 MB of filter

    def write(self, out: Path) -> str:
        """Write the filter into `out` (`ngrams.bloom` for 13-grams, `ngrams-N.bloom` for other
        n); the digest the output declares for it."""
        raw = self.to_bytes()
        write_bytes_durably(out / ngram_file(self.n), raw)
        return filter_digest(raw)


class LoadedFilter:
    """An ngrams step's recorded filter, read back for queries."""

    def __init__(self, raw: bytes) -> None:
        try:
            header = read_header(raw)
        except ValueError:
            header = None
        if header is None or header.hashes != HASHES:
            raise StepFailed(f"{NGRAMS} is not an n-gram filter this buildtrain reads")
        words = np.frombuffer(raw, dtype="<u8")
        self.n, at, self.segments = header.n, header.bits_at, []
        for capacity, items in header.segments:
            length = capacity * BITS_PER_ITEM // 64
            self.segments.append((words[at : at + length], items))
            at += length

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """Whether each hash may be among the recorded n-grams (never False for one that is)."""
        found = np.zeros(len(hashes), dtype=bool)
        for words, _ in self.segments:
            block, positions = _positions(hashes, len(words) // BLOCK_WORDS)
            hit = np.ones(len(hashes), dtype=bool)
            for bit in positions:
                word = words[(block * np.uint64(BLOCK_WORDS) + (bit >> np.uint64(6))).astype(np.int64)]
                hit &= ((word >> (bit & np.uint64(63))) & np.uint64(1)).astype(bool)
            found |= hit
        return found

    def false_positive_rate(self) -> float:
        """The chance that an absent n-gram is reported present: each segment's fill ** HASHES
        (blocks are filled unevenly, so this is an estimate), summed over segments."""
        rate = 0.0
        for words, _ in self.segments:
            fill = int(np.unpackbits(words.view(np.uint8)).sum()) / (64 * len(words))
            rate += fill**HASHES
        return rate


def read_filter(output: Path, n: int = NGRAM) -> LoadedFilter | None:
    """An ngrams step output's filter of `n`-grams, or None for an output that has none."""
    path = output / ngram_file(n)
    if not path.is_file():
        return None
    found = LoadedFilter(path.read_bytes())
    if found.n != n:
        raise StepFailed(f"{path.name} holds {found.n}-grams, not {n}-grams")
    return found


def shared(filters: list[LoadedFilter], texts: list[str], n: int = NGRAM) -> list[int]:
    """The indices of `texts` that share at least one n-gram with any of `filters`."""
    found = []
    for index, text in enumerate(texts):
        hashes = text_ngrams(text, n)
        if len(hashes) and any(f.contains(hashes).any() for f in filters):
            found.append(index)
    return found
