"""The train/held-out split of many split blocks at once: the same rule as one block at a time.

Block `i` is held out when `derive_unit(split_seed, "heldout", i) < heldout_fraction` (seeds.py):
blake3 of the canonical bytes `[seed,"heldout",[i]]`. Those bytes are a fixed prefix, `i` in
decimal and `]]`, at most 64 bytes for any seed and index below 10**19, so blocks whose indexes
have the same number of digits are one batch of one-block messages for `short_blake3`. The
decision per block was 47% of the byte data step's time (8.8 us x 78k blocks for 80 MB); here it
costs about 0.09 us a block with the digests in C, 0.4 us in numpy (`short_blake3`). A seed too
long for one block falls back to the rule itself.
tests/test_split.py holds the law: equal to `derive_unit` for any seed, fraction and range.
Needs no torch.
"""

from __future__ import annotations

import numpy as np

from buildtrain.canonical import canonical_bytes
from buildtrain.steps.data.short_blake3 import BLOCK_BYTES, digest_prefixes
from buildtrain.steps.seeds import MASK_63, derive_unit

PURPOSE = "heldout"
# Blocks per numpy pass: with every operation in place (`short_blake3.InPlace`), 32,768 blocks
# took 0.55x the time per block of 8,192 (the fixed cost of each numpy call, spread wider).
BATCH = 1 << 15
WINDOW = BATCH  # blocks decided ahead by SplitRuns: 32 MB of bytes at 1,024 tokens a block


def _prefix(seed: int) -> bytes:
    """The canonical bytes of `[seed, "heldout", [i]]` before the digits of `i`."""
    encoded = canonical_bytes([seed, PURPOSE, [0]])
    if not encoded.endswith(b"0]]"):
        raise AssertionError(f"the canonical encoding changed shape: {encoded!r}")
    return encoded[:-3]


def _decimal(indexes: np.ndarray, digits: int) -> np.ndarray:
    """Each index (all with `digits` digits) as its ASCII decimal digits, one row per index."""
    out = np.empty((len(indexes), digits), dtype=np.uint8)
    # uint32 division where the indexes fit: a third of the time of uint64's
    rest = indexes.astype(np.uint32) if int(indexes[-1]) < 1 << 32 else indexes
    ten = rest.dtype.type(10)
    for column in range(digits - 1, -1, -1):
        rest, out[:, column] = np.divmod(rest, ten)
    out += ord("0")
    return out


def _units_below(prefix: bytes, start: int, count: int, fraction: float) -> np.ndarray:
    """Held out or not for blocks start .. start + count - 1, all with the same number of digits."""
    digits = len(str(start))
    indexes = np.arange(start, start + count, dtype=np.uint64)
    messages = np.empty((count, len(prefix) + digits + 2), dtype=np.uint8)
    messages[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    messages[:, len(prefix) : len(prefix) + digits] = _decimal(indexes, digits)
    messages[:, -2:] = ord("]")
    seeds = digest_prefixes(messages) & np.uint64(MASK_63)
    # uint64 -> float64 rounds to nearest like Python's int / int, and the power of two divides
    # exactly: the same float derive_unit computes (the law in tests/test_split.py checks it)
    return seeds.astype(np.float64) / float(MASK_63 + 1) < fraction


def held_out(seed: int, fraction: float, start: int, count: int) -> np.ndarray:
    """Whether each of the split blocks start .. start + count - 1 is held out, as a bool array."""
    prefix = _prefix(seed)
    mask = np.empty(count, dtype=bool)
    position = start
    while position < start + count:
        digits = len(str(position))
        end = min(start + count, 10**digits, position + BATCH)
        if len(prefix) + digits + 2 > BLOCK_BYTES or end > 10**18:  # too long for one block
            mask[position - start : end - start] = [
                derive_unit(seed, PURPOSE, index) < fraction for index in range(position, end)
            ]
        else:
            mask[position - start : end - start] = _units_below(prefix, position, end - position, fraction)
        position = end
    return mask


class SplitRuns:
    """The split of every block, consulted in order as runs of consecutive blocks in one split,
    and decided `WINDOW` blocks at a time (a pass over few blocks costs as much as over many)."""

    def __init__(self, seed: int, fraction: float) -> None:
        self.seed, self.fraction = seed, fraction
        self.start = self.stop = 0  # the decided window of blocks
        self.mask = np.zeros(0, dtype=bool)  # its splits, block by block
        self.ends: list[int] = []  # where each run of the window ends (block numbers)
        self.held: list[bool] = []  # and whether it is held out
        self.current = 0  # the run last asked about: blocks are asked about in order

    def run(self, block: int) -> tuple[bool, int]:
        """Whether `block` is held out, and the first block after it that is not in the same run
        (or that lies past the decided window: the run may go on there)."""
        if not self.start <= block < self.stop:
            self._decide(block)
        if block < (self.ends[self.current - 1] if self.current else self.start):
            self.current = 0  # asked about an earlier block: look from the window's start
        while self.ends[self.current] <= block:
            self.current += 1
        return self.held[self.current], self.ends[self.current]

    def blocks(self, start: int, count: int) -> np.ndarray:
        """Whether each of the blocks start .. start + count - 1 is held out (read only)."""
        if count > WINDOW:
            return held_out(self.seed, self.fraction, start, count)
        if not (self.start <= start and start + count <= self.stop):
            self._decide(start)
        return self.mask[start - self.start : start - self.start + count]

    def _decide(self, block: int) -> None:
        mask = held_out(self.seed, self.fraction, block, WINDOW)
        changes = np.flatnonzero(mask[1:] != mask[:-1]) + 1
        self.mask = mask
        self.start, self.stop = block, block + WINDOW
        self.ends = [*(block + changes).tolist(), self.stop]
        self.held = [bool(mask[0]), *mask[changes].tolist()]
        self.current = 0
