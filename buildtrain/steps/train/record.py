"""The deterministic record of each update: the trace lines that `bt verify` compares bit for bit.

Every update's line holds its loss and gradient-norm bits, learning rate and data cursor; every
`digest_every` updates also the weights' fingerprints (`fingerprint.py`: two exact integer sums per
tensor, taken on the device), and at every checkpoint the full blake3 digests of the whole state.
The fingerprints stay on the device until the lines are written: at a checkpoint, every
`RECORD_EVERY` updates, at the end, or at once when an observer asks (`bt verify`'s watcher
compares each update as it happens). So between checkpoints the record costs the device a few
reductions and the host nothing, with no synchronisation (the loop's own, for the loss, is the one
an update has); when lines are written changes none of their bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import torch

from buildtrain.config.schema import TrainConfig
from buildtrain.steps.train.fingerprint import Pending
from buildtrain.steps.train.schedule import checkpoint_due
from buildtrain.steps.train.state import digests
from buildtrain.store.tensors import combine

TENSOR_DIGEST_CHARS = 16
RECORD_EVERY = 64  # updates whose lines may wait for their fingerprints (a few KiB of device memory)


def float_bits(value: float) -> str:
    """The exact float32 bit pattern of a value, as hex: the trace compares bits, not decimals."""
    return struct.pack(">f", value).hex()


def recorded_state(update: int, cfg: TrainConfig) -> str | None:
    """What the record of `update` digests: the whole "state" at each update of the checkpoint
    cadence, the "weights" every `digest_every` updates, else nothing. Only the cadence decides,
    never an interruption, so the trace of a resumed run equals that of an uninterrupted one."""
    if checkpoint_due(update, cfg):
        return "state"
    return "weights" if update % cfg.digest_every == 0 else None


def update_entry(update: int, loss: float, grad_norm: float, lr: float, cursor: int) -> dict[str, Any]:
    """The fields every update's line has."""
    return {
        "step": update,
        "loss": float_bits(loss),
        "grad_norm": float_bits(grad_norm),
        "lr": lr,
        "cursor": cursor,
    }


def add_digests(entry: dict[str, Any], tensor_digests: dict[str, str], *, full: bool) -> None:
    """The weights' combined digest (and with `full`, the whole state's) and each tensor's prefix."""
    entry["weights"] = combine({k: v for k, v in tensor_digests.items() if k.startswith("model.")})
    if full:
        entry["state"] = combine(tensor_digests)
    entry["tensors"] = {k: v[:TENSOR_DIGEST_CHARS] for k, v in sorted(tensor_digests.items())}


class Recorder:
    """Rank 0's lines of the updates not yet in the trace, in order, each waiting (or not) for
    its fingerprints."""

    def __init__(self, frozen: set[str]) -> None:
        self.fingerprints = Pending(frozen)
        self.waiting: list[tuple[dict[str, Any], bool]] = []  # (line, waits for fingerprints)

    @classmethod
    def of(cls, model: torch.nn.Module) -> Recorder:
        """The recorder of `model`'s training: the weights that do not train (LoRA's base model)
        are fingerprinted once, while they stay unchanged."""
        return cls({f"model.{name}" for name, p in model.named_parameters() if not p.requires_grad})

    def __len__(self) -> int:
        return len(self.waiting)

    def update(
        self, entry: dict[str, Any], wanted: str | None, tensors: Callable[[], dict[str, torch.Tensor]]
    ) -> None:
        """Record an update whose `recorded_state` is `wanted`; `tensors` gives the weights (for
        "weights") or the whole state (for "state"), as whole tensors."""
        if wanted == "state":  # a checkpoint: its digests are full blake3, on the host
            add_digests(entry, digests(tensors()), full=True)
        elif wanted == "weights":
            self.fingerprints.add(tensors())
        self.waiting.append((entry, wanted == "weights"))

    def evaluated(self, update: int, result: dict[str, Any]) -> None:
        self.waiting.append(({"step": update, "eval": result}, False))

    def flush(self, append: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
        """Every waiting line to `append` (the trace's), after one copy of their fingerprints to
        the host; returns the update lines written, in order."""
        found = iter(self.fingerprints.take())
        written = []
        for entry, waits in self.waiting:
            if waits:
                add_digests(entry, next(found), full=False)
            append(entry)
            if "eval" not in entry:
                written.append(entry)
        self.waiting = []
        return written
