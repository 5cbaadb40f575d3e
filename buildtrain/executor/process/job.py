"""The job file: what the executor asks one step process (or the ranks of one step) to do.

An engine makes it from a submission (`engines/engine.py`, `job_of`); `spawn` (or a cluster
engine) writes it where the worker reads it back; JSON on disk, typed values on both sides
(structured with the strict converter, so an unknown key is an error, not a default).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.convert import converter


@attrs.frozen(kw_only=True)
class JobNumerics:
    """The numerics environment the process computes under (set before it imports torch)."""

    profile: str
    device: str
    dtype: str
    threads: int


@attrs.frozen(kw_only=True)
class JobOptions:
    """What `bt verify` adds to a step's job; a plain `bt run` leaves the defaults."""

    hooks: Mapping[str, Any] = attrs.Factory(dict)  # fault injection (steps/train/faults.py)
    watch: Mapping[str, Any] | None = None  # compare with a recorded build (read by verify's watcher)
    commit: bool = True  # publish the output (a spot check does not)
    # Evaluation beside training: score this kept checkpoint folder of the step's `checkpoints_of`
    # input (recording each result in the evaluation cache) instead of building the step.
    checkpoint: str | None = None


PLAIN_RUN = JobOptions()


@attrs.frozen(kw_only=True)
class Job:
    store: str  # the store's root
    plan: str  # the plan's hash
    step: str  # the step's hash
    kind: str
    numerics: JobNumerics
    sources: tuple[str, ...] = ()  # data files, located by content, in plan order
    options: JobOptions = PLAIN_RUN

    def write(self, path: Path) -> None:
        path.write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> Job:
        return cls.from_json(path.read_text(encoding="utf-8"))

    def to_json(self) -> str:
        return json.dumps(converter.unstructure(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return converter.structure(json.loads(text), cls)
