"""Text for sweeps: which steps the points share (`bt plan --sweep`), what a batch built (`bt run`)."""

from __future__ import annotations

from typing import Protocol

from buildtrain.plan.sweep import SweepPlans
from buildtrain.store.layout import SHORT
from buildtrain.store.store import Store


class BatchCounts(Protocol):
    """What `bt run` over several plans counts (`executor.loop.batch.BatchSummary`), read here without
    importing the executor: `bt plan --sweep` prints its summary from this module too."""

    @property
    def plans(self) -> int: ...

    @property
    def ran(self) -> int: ...

    @property
    def distinct(self) -> int: ...

    @property
    def step_slots(self) -> int: ...

    @property
    def executed(self) -> int: ...

    @property
    def cached(self) -> int: ...

    @property
    def saved(self) -> int: ...

    @property
    def stopped_at(self) -> str | None: ...

    @property
    def error(self) -> str | None: ...


def sweep_summary(store: Store, sweep: SweepPlans) -> str:
    """One line per point, then every step with the number of points that share it."""
    plans = [point.planned.plan for point in sweep.points]
    users: dict[str, list[int]] = {}
    labels: dict[str, str] = {}
    for index, plan in enumerate(plans):
        for step in plan.steps:
            users.setdefault(step.hash, []).append(index)
            labels[step.hash] = step.label
    slots = sum(len(plan.steps) for plan in plans)
    shape = " x ".join(str(len(axis.values)) for axis in sweep.axes)
    lines = [
        f"sweep {sweep.hash[:SHORT]}: {len(plans)} plans ({shape} over {', '.join(a.key for a in sweep.axes)}), "
        f"{len(users)} distinct steps for {slots} step slots"
    ]
    for point in sweep.points:
        lines.append(f"  {point.planned.plan.hash[:SHORT]}  {' '.join(point.assignments)}")
    shared = [h for h, who in users.items() if len(who) > 1]
    width = max(len(label) for label in labels.values())
    lines.append(f"shared by several plans (built once): {len(shared)}")
    for step_hash in shared:
        status = "cached" if store.outputs.has(step_hash) else "to build"
        lines.append(
            f"  {labels[step_hash]:<{width}}  {step_hash[:SHORT]}  "
            f"in {len(users[step_hash])} of {len(plans)} plans, {status}"
        )
    own = len(users) - len(shared)
    lines.append(f"each in one plan: {own}")
    return "\n".join(lines)


def batch_text(summary: BatchCounts) -> str:
    text = (
        f"bt run: {summary.ran} of {summary.plans} plans done; {summary.distinct} distinct steps for "
        f"{summary.step_slots} step slots: {summary.executed} executed, {summary.cached} already "
        f"built, {summary.saved} shared (built once for several plans)"
    )
    if summary.stopped_at:
        text += f"\nstopped at plan {summary.stopped_at[:SHORT]}" + (
            f": {summary.error}" if summary.error else ""
        )
    return text
