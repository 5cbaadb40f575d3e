"""What the executor hands a step: its plan node, verified inputs, a logger and a place to write.

Torch-free, so the executor can complete steps that need no computation (an evaluation already in
the content cache) without starting a process.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.config.schema import NumericsConfig
from buildtrain.errors import CorruptObject
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import objects
from buildtrain.store.layout import RESULT
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.steps.train.controls import TrainControls


@attrs.frozen(kw_only=True)
class StepContext:
    store: Store
    plan: Plan
    step: Step
    inputs: dict[str, Path]  # upstream step outputs by input name, verified on read
    sources: list[Path]  # data files in plan order (the data step only)
    log: Any
    controls: TrainControls | None = None  # a train step's stop request, observer and ranks

    @property
    def numerics(self) -> NumericsConfig:
        return self.plan.numerics


def verified_inputs(store: Store, step: Step, only: Collection[str] | None = None) -> dict[str, Path]:
    """Upstream outputs (all, or the inputs named in `only`), each re-hashed against its manifest
    before anything reads it."""
    found = {}
    for name, step_hash in step.upstream.items():
        if only is not None and name not in only:
            continue
        path = store.output(step_hash)
        problems = objects.verify(path)
        if problems:
            raise CorruptObject(
                f"input {name} of {step.label} (step {step_hash[:12]}) does not verify: {problems[0]}; "
                "run bt fsck, then bt run again to rebuild it"
            )
        found[name] = path
    return found


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_bytes())


def final_weights(train_output: Path) -> Path:
    """Where a train step's output keeps its final weights."""
    return train_output / read_json(train_output / RESULT)["weights"]
