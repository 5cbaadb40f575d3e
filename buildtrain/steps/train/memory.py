"""What one rank's training holds in memory, and an update that runs out of it: the bytes of
weights, gradients and optimizer moments read off the tensors, the process's peak resident set,
and an allocation failure turned into a step failure naming the update and the fix. Read by the
loop in `trainer.py`; nothing here changes a number it computes.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from buildtrain.errors import StepFailed
from buildtrain.steps.failures import out_of_memory
from buildtrain.steps.train import checkpoint
from buildtrain.steps.train.optimizer import AdamW


def held_bytes(model: torch.nn.Module, optimizer: AdamW) -> dict[str, int]:
    """Bytes of weights, gradients and AdamW moments this rank holds (sharded: its shards), read
    off the tensors themselves: what benchmarks/sharding.py compares across world sizes."""

    def size(tensor: Any) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    parameters = list(model.parameters())
    moments = [v for p in parameters for k, v in optimizer.state.get(p, {}).items() if k != "step"]
    return {
        "weights_bytes": sum(size(p.detach()) for p in parameters),
        "gradient_bytes": sum(size(p.grad) for p in parameters if p.grad is not None),
        "optimizer_bytes": sum(size(m) for m in moments),
    }


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def newest(folder: Path) -> str:
    saved = checkpoint.candidates(folder)
    return saved[0][1].name if saved else "none"


@contextlib.contextmanager
def out_of_memory_fails(update: int, work: Path) -> Iterator[None]:
    """Turn an allocation failure during an update into a step failure that names the update."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not out_of_memory(exc):
            raise
        raise StepFailed(
            f"out of memory at step {update} (newest checkpoint: {newest(work)}, intact); "
            "lower train.micro_batch_size (the batch stays the same) or train.seq_len"
        ) from None
