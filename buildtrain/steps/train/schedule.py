"""What happens at which update, as pure functions of the update number: the learning rate and
the checkpoint cadence. Nothing to checkpoint, nothing to drift."""

from __future__ import annotations

import math

from buildtrain.config.schema import TrainConfig


def learning_rate(update: int, train: TrainConfig) -> float:
    """The rate for update `update` (1-based): linear warmup, then cosine, linear or constant decay."""
    if train.warmup_steps and update <= train.warmup_steps:
        return train.lr * (update / train.warmup_steps)  # exactly lr at the end, never above
    progress = (update - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    floor = train.lr * train.min_lr_ratio
    if train.schedule == "cosine":
        return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if train.schedule == "linear":
        return train.lr - (train.lr - floor) * progress
    return train.lr


def checkpoint_due(update: int, train: TrainConfig) -> bool:
    """The regular checkpoints: every `checkpoint_every` updates and after the last. The trace
    digests the whole state exactly here; an interruption adds a checkpoint, never a digest."""
    return update % train.checkpoint_every == 0 or update == train.steps
