"""What chooses the text a data or tokenizer step reads (`TextSettings`, declared with the step
configs in `config/steps.py`), and the built-in synthetic
corpus; `corpus.py` reads it (or the data files, through `formats.py`). Needs no torch."""

from __future__ import annotations

from buildtrain.steps.seeds import derive_seed


class SplitMix64:
    """A tiny, fully specified PRNG for the synthetic corpus (stable across Python versions)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        return self.next() % bound


def arithmetic_document(seed: int, index: int, lines: int) -> bytes:
    """`lines` additions like `417+38=455`, one per line: structure a small model learns quickly."""
    rng = SplitMix64(derive_seed(seed, "synthetic-arithmetic", index))
    rows = []
    for _ in range(lines):
        a, b = rng.below(10 ** (1 + rng.below(3))), rng.below(10 ** (1 + rng.below(3)))
        rows.append(f"{a}+{b}={a + b}\n")
    return "".join(rows).encode("ascii")
