"""The `heldout` suite: mean loss, bits per token and perplexity over the held-out split.

The windows are the split cut in order into non-overlapping pieces of `seq_len + 1` tokens. Each
batch's loss is summed in float32 (by cross_entropy), and the batch sums are added in float64 in
that order, so the result is as reproducible as the weights.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F

from buildtrain.config.schema import EvalConfig
from buildtrain.errors import StepFailed
from buildtrain.steps.train.batches import TokenStream
from buildtrain.steps.train.model import record_mask


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    stream: TokenStream,
    config: EvalConfig,
    device: torch.device,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
    masks: TokenStream | None = None,
    records_end: int | None = None,
) -> dict[str, Any]:
    """`masks`: chat records' loss masks, so only completion tokens are scored (and counted);
    `records_end`: their end token, so attention stays within each record as in training."""
    model.eval()
    length = config.seq_len
    windows = (len(stream) - 1) // length
    if config.max_batches:
        windows = min(windows, config.max_batches * config.batch_size)
    if windows < 1:
        raise StepFailed(
            f"the held-out split has {len(stream)} tokens, fewer than eval.seq_len + 1 = {length + 1}"
        )
    total, tokens = 0.0, 0
    for first in range(0, windows, config.batch_size):
        rows = torch.stack(
            [
                stream.read(i * length, length + 1)
                for i in range(first, min(first + config.batch_size, windows))
            ]
        )
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
        with autocast or contextlib.nullcontext():
            logits = model(x, None, None if records_end is None else record_mask(x, records_end))
        if masks is None:
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            total, tokens = total + losses.double().item(), tokens + y.numel()
            continue
        learned = torch.stack(
            [masks.read(i * length + 1, length) for i in range(first, first + len(rows))]
        ).to(device)
        losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        total += (losses * learned.flatten().float()).sum().double().item()
        tokens += int(learned.sum().item())
    if tokens == 0:
        raise StepFailed("the held-out split holds no completion tokens to score; use more chat records")
    loss = total / tokens
    if not math.isfinite(loss):
        raise StepFailed(f"held-out loss is {loss}: the weights have diverged")
    return {
        "tokens": tokens,
        "loss": loss,
        "bits_per_token": loss / math.log(2),
        "perplexity": math.exp(min(loss, 700.0)),
    }
