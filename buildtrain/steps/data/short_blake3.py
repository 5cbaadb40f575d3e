"""blake3 of many short messages at once: the first 8 bytes of each digest.

A message of at most 64 bytes is one blake3 chunk of one block, so its digest is a single call of
the compression function (7 rounds of the quarter-round G over 16 32-bit words) with the flags
CHUNK_START | CHUNK_END | ROOT. Evaluating that function over arrays of messages, one array per
word, gives bit for bit what the blake3 library gives one message at a time, at a fraction of the
per-call cost: 0.15-0.3 us a message in batches of 32,768 here, against 1.2 us for one library
call and 7.5 us for derive_unit with its canonical JSON (tests check results against the
library). Words that are the same in every message of a batch stay scalars through the first
round, so the parts of it that see only them are computed once; the six other rounds run in
place on arrays.

The same function is written in C (`short_blake3.c`, 16 messages per vector register, about
0.03 us a message here), built like the model's kernels (`native.py`) and used wherever this
machine has a C compiler: integer arithmetic gives the same bits on any CPU, so which one ran is
no part of a plan, and numpy is the fallback where no compiler can build it (tests hold both to
the blake3 library).

Only what the data split needs: messages of one length per call, and only the first 64 bits of
the output. Needs no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain import native

SOURCE = Path(__file__).with_suffix(".c")
BLOCK_BYTES = 64
IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
MESSAGE_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
ONE_BLOCK_ROOT = 1 | 2 | 8  # CHUNK_START | CHUNK_END | ROOT: the flags of a message of one block
# (state a, b, c, d, message word x, message word y) of the eight G calls of a round
ROUND = (
    (0, 4, 8, 12, 0, 1),
    (1, 5, 9, 13, 2, 3),
    (2, 6, 10, 14, 4, 5),
    (3, 7, 11, 15, 6, 7),
    (0, 5, 10, 15, 8, 9),
    (1, 6, 11, 12, 10, 11),
    (2, 7, 8, 13, 12, 13),
    (3, 4, 9, 14, 14, 15),
)

Word = Any  # a numpy uint32 array of one word per message, or a np.uint32 shared by all


def _rotate_right(x: Word, bits: int) -> Word:
    return (x >> np.uint32(bits)) | (x << np.uint32(32 - bits))


def _g(v: list[Word], a: int, b: int, c: int, d: int, x: Word, y: Word) -> None:
    """The quarter-round on words that may be scalars: each result is a new value."""
    v[a] = v[a] + v[b] + x
    v[d] = _rotate_right(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotate_right(v[b] ^ v[c], 12)
    v[a] = v[a] + v[b] + y
    v[d] = _rotate_right(v[d] ^ v[a], 8)
    v[c] = v[c] + v[d]
    v[b] = _rotate_right(v[b] ^ v[c], 7)


class InPlace:
    """The quarter-round on arrays the caller owns, each operation writing into its operand: no
    array is allocated per operation (1.3x faster than `_g` on 32,768 messages here)."""

    def __init__(self, count: int) -> None:
        self.scratch = np.empty(count, dtype=np.uint32)

    def rotate_right(self, x: np.ndarray, bits: int) -> None:
        np.left_shift(x, np.uint32(32 - bits), out=self.scratch)
        np.right_shift(x, np.uint32(bits), out=x)
        np.bitwise_or(x, self.scratch, out=x)

    def g(self, v: list[np.ndarray], a: int, b: int, c: int, d: int, x: Word, y: Word) -> None:
        va, vb, vc, vd = v[a], v[b], v[c], v[d]
        for word, bits in ((x, (16, 12)), (y, (8, 7))):
            np.add(va, vb, out=va)
            np.add(va, word, out=va)
            np.bitwise_xor(vd, va, out=vd)
            self.rotate_right(vd, bits[0])
            np.add(vc, vd, out=vc)
            np.bitwise_xor(vb, vc, out=vb)
            self.rotate_right(vb, bits[1])


def _words(messages: np.ndarray) -> list[Word]:
    """The 16 little-endian message words of each zero-padded message; a word the same in every
    message becomes one scalar."""
    padded = np.zeros((len(messages), BLOCK_BYTES), dtype=np.uint8)
    padded[:, : messages.shape[1]] = messages
    columns = padded.view("<u4").T
    words: list[Word] = []
    for column in columns:
        first = column[0]
        words.append(np.uint32(first) if (column == first).all() else np.ascontiguousarray(column, np.uint32))
    return words


def digest_prefixes(messages: np.ndarray) -> np.ndarray:
    """The first 8 bytes of blake3 of each row of `messages` (uint8, shape (n, length), length at
    most 64, n at least 1), as little-endian uint64 numbers: in C where it is built, else numpy."""
    count, length = messages.shape
    if length > BLOCK_BYTES or count == 0:
        raise ValueError(
            f"digest_prefixes takes 1 or more messages of at most 64 bytes, got {messages.shape}"
        )
    compiled = _compiled()
    return in_numpy(messages) if compiled is None else in_c(compiled, messages)


@functools.cache
def _compiled() -> Callable[..., None] | None:
    """`bt_digest_prefixes` from short_blake3.c, or None where there is no compiler, the build
    fails or the library does not load (numpy then computes the same bits, only slower)."""
    library = native.load_if_possible(SOURCE)
    if library is None:
        return None
    import ctypes  # only here: `bt plan` imports this module and needs no ctypes

    function = library.bt_digest_prefixes
    function.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    function.restype = None
    return function


def in_c(function: Callable[..., None], messages: np.ndarray) -> np.ndarray:
    """digest_prefixes computed by `function`, a build of short_blake3.c."""
    rows = np.ascontiguousarray(messages, dtype=np.uint8)
    out = np.empty(len(rows), dtype=np.uint64)
    function(rows.ctypes.data, len(rows), rows.shape[1], out.ctypes.data)
    return out


def in_numpy(messages: np.ndarray) -> np.ndarray:
    """digest_prefixes computed with numpy's array operations."""
    count, length = messages.shape
    m = _words(messages)
    v: list[Word] = [np.uint32(w) for w in (*IV, *IV[:4], 0, 0, length, ONE_BLOCK_ROOT)]
    with np.errstate(over="ignore"):  # additions wrap modulo 2**32, as the function defines them
        for a, b, c, d, x, y in ROUND:  # round 1 on scalars where words are shared
            _g(v, a, b, c, d, m[x], m[y])
        state = [np.array(np.broadcast_to(word, (count,)), dtype=np.uint32) for word in v]  # owned
        rounds = InPlace(count)
        for _ in range(6):
            m = [m[i] for i in MESSAGE_PERMUTATION]
            for a, b, c, d, x, y in ROUND:
                rounds.g(state, a, b, c, d, m[x], m[y])
    low = (state[0] ^ state[8]).astype(np.uint64)
    high = (state[1] ^ state[9]).astype(np.uint64)
    return low | (high << np.uint64(32))
