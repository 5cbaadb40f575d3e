"""Building one step of a run: a cache hit when its output verifies, else the step computed under
its lock, with damaged outputs set aside and damaged inputs rebuilt; or, on a node other than 0, a
train step joined."""

from __future__ import annotations

import os
import time
from typing import Any

from buildtrain.errors import CorruptObject
from buildtrain.executor.launch import Launch
from buildtrain.executor.outcome import raise_for_status
from buildtrain.executor.processes import StepProcesses
from buildtrain.executor.progress import Reporter
from buildtrain.executor.record import RunRecord
from buildtrain.executor.spawn import StepJob, spawn
from buildtrain.plan.plan import Plan, Step
from buildtrain.steps.eval_cache import complete_from_cache
from buildtrain.store import objects
from buildtrain.store.store import Store


def damaged_inputs(store: Store, plan: Plan, step: Step) -> list[Step]:
    """The upstream steps whose outputs do not verify when fully re-hashed (their stamps, which
    said otherwise, are dropped): what to rebuild when a step process finds an input damaged."""
    damaged = []
    for step_hash in dict.fromkeys(step.upstream.values()):
        if store.verify_output(step_hash):
            store.drop_stamp(step_hash)
            damaged.append(plan.step(step_hash))
    return damaged


def build_step(
    store: Store,
    plan: Plan,
    step: Step,
    threads: int,
    record: RunRecord,
    reporter: Reporter,
    wait: bool,
    launch: Launch,
    processes: StepProcesses | None = None,
) -> dict[str, Any]:
    """A cache hit when the step's output verifies; else, under the step's lock, set aside
    whatever occupies its place (damaged, foreign, half-made) and build it. Inputs that a step
    process finds damaged (decay that a stamp could not see) are rebuilt and the step retried."""
    started = time.perf_counter()

    def result(action: str, detail: str = "") -> dict[str, Any]:
        digests = objects.sealed_digests(store.output(step.hash)) if store.has_output(step.hash) else {}
        duration = round(time.perf_counter() - started, 3)
        record.event("step_finished", step=step.label, hash=step.hash, action=action, duration_s=duration)
        reporter.step(
            step.label,
            action if not detail else f"{action} ({detail})",
            f"{duration:.1f}s" if action == "executed" else "",
        )
        return {
            "label": step.label,
            "hash": step.hash,
            "action": action,
            "detail": detail,
            "duration_s": duration,
            "digests": digests,
        }

    # Without the lock: a null build only reads (and works in a read-only store).
    if store.has_output(step.hash) and not store.check_output(step.hash):
        return result("cached")

    def waiting(holder: str) -> None:
        reporter.step(step.label, f"waiting: pid {holder} is building this step")
        record.event("waiting_for_lock", step=step.label, holder=holder)

    for attempt in (1, 2):
        with store.lock(step.hash, wait=wait, on_wait=waiting) as lock_fd:
            output = store.output(step.hash)
            if os.path.lexists(output):
                problems = store.check_output(step.hash)
                if not problems:
                    return result("cached", "built by another run")
                moved = store.quarantine(step.hash)
                if moved is not None:
                    reporter.step(
                        step.label, f"output damaged ({problems[0]}); moved to {moved} and rebuilding"
                    )
                    record.event(
                        "output_quarantined", step=step.label, problems=problems, moved_to=str(moved)
                    )
            if step.kind == "eval" and complete_from_cache(store, step) is not None:
                return result("cached", "same weights evaluated before")
            record.event("step_started", step=step.label, hash=step.hash, threads=threads)
            if step.kind == "train":
                reporter.train_started(step.label)
            else:
                reporter.step(step.label, "running")

            def on_event(line: dict[str, Any]) -> None:
                record.forward(line)
                reporter.event(line)

            try:
                outcome = spawn(store, plan, step, threads, lock_fd, on_event, StepJob(), launch, processes)
            finally:
                reporter.train_finished()
            try:
                raise_for_status(step, outcome, plan)
                return result("executed")
            except CorruptObject:
                damaged = damaged_inputs(store, plan, step) if attempt == 1 else []
                if not damaged:
                    raise
        # Outside this step's lock: rebuild each damaged input under its own, then try again.
        for upstream in damaged:
            reporter.step(step.label, f"input {upstream.label} is damaged; rebuilding it")
            record.event("input_damaged", step=step.label, input=upstream.label, hash=upstream.hash)
            build_step(store, plan, upstream, threads, record, reporter, wait, launch, processes)
    raise AssertionError("unreachable: the second attempt returns or raises")


def join_step(
    store: Store, plan: Plan, step: Step, threads: int, record: RunRecord, reporter: Reporter, launch: Launch
) -> dict[str, Any]:
    """On a machine other than node 0: train with node 0, which writes the step's output there.

    A marker remembers that the step completed, so a later `bt run` here skips it exactly when
    node 0 finds it in its store, and the nodes keep meeting on the same steps.
    """
    marker = store.work_dir(step.hash) / "joined"
    entry = {"label": step.label, "hash": step.hash, "detail": "", "digests": {}, "duration_s": 0.0}
    if marker.exists():
        reporter.step(step.label, "cached (joined before)")
        return {**entry, "action": "cached", "detail": "joined before"}
    started = time.perf_counter()
    reporter.step(step.label, f"joining node 0 as node {launch.node_rank}")

    def on_event(line: dict[str, Any]) -> None:
        record.forward(line)

    with store.lock(step.hash) as lock_fd:
        outcome = spawn(store, plan, step, threads, lock_fd, on_event, StepJob(), launch)
    raise_for_status(step, outcome, plan)
    marker.parent.mkdir(parents=True, exist_ok=True)
    objects.write_bytes_durably(marker, b"")
    duration = round(time.perf_counter() - started, 3)
    reporter.step(step.label, "joined", f"{duration:.1f}s")
    return {**entry, "action": "joined", "duration_s": duration}
