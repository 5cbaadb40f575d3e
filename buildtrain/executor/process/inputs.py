"""A step's upstream outputs, each re-hashed against its manifest before the step reads it.

Done by the process that runs the step, before the step's own code: the checking and its
messages are the store's concern, not part of what the step computes (nor of its code hash).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from buildtrain.errors import CorruptObject
from buildtrain.plan.plan import Step
from buildtrain.store import objects
from buildtrain.store.store import Store


def verified_inputs(store: Store, step: Step, only: Collection[str] | None = None) -> dict[str, Path]:
    """Upstream outputs (all, or the inputs named in `only`), each re-hashed against its manifest
    before anything reads it."""
    found = {}
    for name, step_hash in step.upstream.items():
        if only is not None and name not in only:
            continue
        path = store.outputs.path(step_hash)
        problems = objects.verify(path)
        if problems:
            raise CorruptObject(
                f"input {name} of {step.label} (step {step_hash[:12]}) does not verify: {problems[0]}; "
                "run bt fsck, then bt run again to rebuild it"
            )
        found[name] = path
    return found
