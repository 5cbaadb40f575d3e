"""What changed between two plans, and which steps that invalidates.

Steps are matched by label (`data:main`, `train:finetune`, `eval`, `export`). A step whose hash
is unchanged is reused from the store; a changed one says why: its own config keys, an upstream
step, its source files, or the toolchain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf key paths of nested data: `stages[1].train.lr` -> 0.0001."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        out = {}
        for index, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{index}]"))
        return out
    return {prefix: list(value) if isinstance(value, tuple) else value}


@attrs.frozen
class Change:
    key: str
    before: Any
    after: Any


@attrs.frozen
class StepChange:
    label: str
    status: str  # "reused", "invalidated", "added", "removed"
    before: str | None
    after: str | None
    reasons: tuple[str, ...] = ()


def changed_keys(before: Any, after: Any) -> list[Change]:
    old, new = flatten(before), flatten(after)
    missing = object()
    return [
        Change(key, old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if old.get(key, missing) != new.get(key, missing)
    ]


def _reasons(old: Step, new: Step, relabel: Mapping[str, str]) -> tuple[str, ...]:
    reasons = [f"config {c.key}" for c in changed_keys(old.config, new.config)]
    for name in sorted(set(old.inputs) | set(new.inputs)):
        before, after = old.inputs.get(name), new.inputs.get(name)
        if before == after:
            continue
        if name == "sources":
            reasons.append(f"{kind_of(new.kind).sources} changed")
        else:
            reasons.append(f"input {name} ({relabel.get(str(after), str(after)[:12])}) changed")
    reasons += [f"toolchain {c.key}" for c in changed_keys(old.toolchain, new.toolchain)]
    return tuple(reasons)


def diff_plans(a: Plan, b: Plan) -> tuple[list[Change], list[StepChange]]:
    config_changes = changed_keys({"name": a.name, **a.config}, {"name": b.name, **b.config})
    old = {step.label: step for step in a.steps}
    new = {step.label: step for step in b.steps}
    relabel = {step.hash: step.label for step in b.steps}
    steps: list[StepChange] = []
    for label in [*old, *[n for n in new if n not in old]]:
        if label not in new:
            steps.append(StepChange(label, "removed", old[label].hash, None))
        elif label not in old:
            steps.append(StepChange(label, "added", None, new[label].hash))
        elif old[label].hash == new[label].hash:
            steps.append(StepChange(label, "reused", old[label].hash, new[label].hash))
        else:
            steps.append(
                StepChange(
                    label,
                    "invalidated",
                    old[label].hash,
                    new[label].hash,
                    _reasons(old[label], new[label], relabel),
                )
            )
    return config_changes, steps
