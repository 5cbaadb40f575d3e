"""The deterministic record of one update: the trace line that `bt verify` compares bit for bit."""

from __future__ import annotations

import struct
from typing import Any

import torch

from buildtrain.config.schema import TrainConfig
from buildtrain.steps.train.optimizer import AdamW
from buildtrain.steps.train.schedule import checkpoint_due
from buildtrain.steps.train.state import FrozenDigests, checksums, digests, state_tensors
from buildtrain.store.tensors import combine

TENSOR_DIGEST_CHARS = 16


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


def trace_entry(
    update: int,
    loss: float,
    grad_norm: float,
    lr: float,
    cursor: int,
    model: torch.nn.Module,
    optimizer: AdamW,
    cfg: TrainConfig,
    gathered: dict[str, torch.Tensor] | None = None,
    frozen: FrozenDigests | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The record of one update (and the tensors it digested).

    Weights are digested every `digest_every` updates, the whole state (weights and AdamW moments)
    at every update the checkpoint cadence names (`recorded_state`); sharded training passes the
    whole tensors it `gathered`. Between checkpoints, weights on a GPU are checksummed where they
    are (`state.checksums`) instead of copied to the host for blake3, and weights that do not
    train are hashed once (`frozen`).
    """
    entry: dict[str, Any] = {
        "step": update,
        "loss": float_bits(loss),
        "grad_norm": float_bits(grad_norm),
        "lr": lr,
        "cursor": cursor,
    }
    wanted = recorded_state(update, cfg)
    if wanted is None:
        return entry, {}
    full = wanted == "state"
    tensors = gathered if gathered is not None else state_tensors(model, optimizer if full else None)
    on_host = full or next(iter(tensors.values())).device.type == "cpu"
    if not on_host:
        tensor_digests = checksums(tensors)
    elif full or frozen is None:
        tensor_digests = digests(tensors)
    else:
        tensor_digests = frozen.digests(tensors)
    entry["weights"] = combine({k: v for k, v in tensor_digests.items() if k.startswith("model.")})
    if full:
        entry["state"] = combine(tensor_digests)
    entry["tensors"] = {k: v[:TENSOR_DIGEST_CHARS] for k, v in tensor_digests.items()}
    return entry, tensors
