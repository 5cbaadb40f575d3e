"""A train step's config, structured once at the step boundary (`step.make_setup`) and passed
inward as typed values: nothing below reads the plan's dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.schema import EvalConfig, ModelConfig, TrainConfig


@attrs.frozen(kw_only=True)
class TrainSetup:
    """What one train step needs: its typed config sections and where its inputs and state live."""

    model: ModelConfig
    train: TrainConfig
    eval: EvalConfig | None  # evaluation during training (eval.every > 0), else None
    device: str
    dtype: str
    compile: bool = False  # the forward pass through torch.compile (numerics.compile)
    data: Path  # the data step's output folder
    index: dict[str, Any]  # its data.json: the shards of each split
    init_weights: Path | None  # a later stage starts from its parent's final weights
    separate_records: int | None = None  # chat records: their end token; attention stays within each
    work: Path  # checkpoints of this step in progress
    identity: dict[str, Any]  # what a checkpoint must match to be resumed (the step hash)
