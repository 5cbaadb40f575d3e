"""Seeds derived from (seed, purpose, counters): every random draw in buildtrain starts here.

A derived seed is a pure function of its arguments, so the random numbers for step s are the same
whether the run started at step 0 or resumed at step s - 1, and whatever process computes them.
"""

from __future__ import annotations

import blake3

from buildtrain.canonical import canonical_bytes

MASK_63 = (1 << 63) - 1


def derive_seed(seed: int, purpose: str, *counters: int) -> int:
    """A 63-bit seed for `purpose` at `counters` (for example step and micro-batch index)."""
    material = canonical_bytes([seed, purpose, list(counters)])
    return int.from_bytes(blake3.blake3(material).digest()[:8], "little") & MASK_63


def derive_unit(seed: int, purpose: str, *counters: int) -> float:
    """A number in [0, 1) from the same derivation, for keyed choices such as the data split."""
    return derive_seed(seed, purpose, *counters) / (MASK_63 + 1)
