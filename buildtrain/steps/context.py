"""What the executor hands a step: what it computes with, and nothing more.

Its plan node (kind, config, hash), the numerics it runs under, its verified inputs and its data
files (checked against the plan as they are read: `sources.py`), its work folder (where a train
step keeps checkpoints between attempts), the evaluation cache as a lookup and a record, a logger
and, for a train step, its controls. Not the store: a step cannot reach the rest of it, and the
store's code (layout, locks, repair) stays outside every kind's code hash
(`plan/sources_digest.py`), like the code that verifies inputs before a step starts
(`executor/process/inputs.py`).

Torch-free, so the executor can complete steps that need no computation (an evaluation already in
the content cache) without starting a process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from buildtrain.store.layout import RESULT

if TYPE_CHECKING:
    from buildtrain.config.schema import NumericsConfig
    from buildtrain.plan.plan import Step
    from buildtrain.steps.sources import Source
    from buildtrain.steps.train.controls import TrainControls


class ResultCache(Protocol):
    """Results addressed by content (the store's `evals/`, see `steps/eval/cache.py`)."""

    def lookup(self, key: str) -> dict[str, Any] | None:
        """The result recorded under `key`, only if its entry verifies."""

    def record(self, key: str, body: dict[str, Any]) -> None:
        """Record `body` under `key` (replacing a damaged entry)."""


@attrs.frozen(kw_only=True)
class StepContext:
    step: Step  # its plan node: kind, config, hash, label, upstream hashes
    numerics: NumericsConfig
    inputs: dict[str, Path]  # upstream step outputs by input name, verified on read
    sources: list[Source] = attrs.Factory(list)  # data files in plan order (tokenizer and data steps)
    work: Path  # the step's work folder (it may not exist yet): kept until the step is published
    results: ResultCache | None = None  # the evaluation cache (an eval step)
    log: Any
    controls: TrainControls | None = None  # a train step's stop request, observer and ranks


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_bytes())


def final_weights(train_output: Path) -> Path:
    """Where a train step's output keeps its final weights."""
    return train_output / read_json(train_output / RESULT)["weights"]
