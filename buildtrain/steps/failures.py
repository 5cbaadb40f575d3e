"""How a step process recognises an allocation failure, wherever it happens (torch-free)."""

from __future__ import annotations


def out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA OOM error (matched by name: no torch import), or the CPU allocator's failure
    (a RuntimeError that says so)."""
    return type(exc).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(exc)
