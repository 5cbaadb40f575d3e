"""Learning rate as a pure function of the update number: nothing to checkpoint, nothing to drift."""

from __future__ import annotations

import math

from buildtrain.config.schema import TrainConfig


def learning_rate(step: int, train: TrainConfig) -> float:
    """The rate for update `step` (1-based): linear warmup, then cosine, linear or constant decay."""
    if train.warmup_steps and step <= train.warmup_steps:
        return train.lr * (step / train.warmup_steps)  # exactly lr at the end, never above
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    floor = train.lr * train.min_lr_ratio
    if train.schedule == "cosine":
        return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if train.schedule == "linear":
        return train.lr - (train.lr - floor) * progress
    return train.lr
