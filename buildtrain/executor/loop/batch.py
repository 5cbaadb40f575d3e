"""`bt run` over several plans (a sweep): each plan runs as usual, shared steps are built once.

Sharing needs no scheduler of its own: plans run one after another, and a step that an earlier
plan built is a cache hit for every later one (the store is content-addressed by step hash). The
plans also share their step processes (one per numerics environment), so a sweep pays for
`import torch` once, not once per plan. What
this module adds is the count a researcher asks for: how many distinct steps the plans hold,
how many were built now, how many were already in the store, and how many step executions the
sharing saved. The first plan that fails stops the batch (like make without -k).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from buildtrain.errors import BuildtrainError, ExitCode, Interrupted
from buildtrain.executor.engines.engine import Engine
from buildtrain.executor.loop.run import LOCAL, RunOptions, engine_for, run_plan, signals_interrupt
from buildtrain.executor.loop.schedule import LiveSteps
from buildtrain.executor.process.processes import StepProcesses
from buildtrain.plan.plan import Plan
from buildtrain.store.layout import SHORT
from buildtrain.store.store import Store


@attrs.frozen
class BatchSummary:
    plans: int
    ran: int  # plans whose run finished
    step_slots: int  # steps over all plans, counting a shared step once per plan
    distinct: int  # distinct step hashes
    executed: int  # steps executed by this batch (each at most once)
    cached: int  # distinct steps already in the store before the batch
    records: tuple[str, ...]
    code: int
    stopped_at: str | None = None  # the plan whose failure stopped the batch
    error: str | None = None  # its message

    @property
    def saved(self) -> int:
        """Step executions avoided because plans share steps: what running the plans apart costs more."""
        return self.step_slots - self.distinct


def _collect(folder: Path | None, records: list[str], executed: set[str]) -> None:
    """Count the run record a plan's run created (none, or no summary yet: a run that stopped
    first). Each run names its record as it creates it, so a sweep never lists the experiments
    folder, which grows with every run ever made."""
    if folder is None:
        return
    try:
        summary = json.loads((folder / "summary.json").read_bytes())
    except (OSError, ValueError):
        return
    records.append(str(folder))
    executed.update(s["hash"] for s in summary.get("steps", []) if s.get("action") == "executed")


def run_plans(
    store: Store,
    plans: Sequence[tuple[Plan, RunOptions]],
    on_plan: Callable[[int, Plan], None] | None = None,
    engine: Engine | None = None,
) -> BatchSummary:
    """Run each plan in order; the summary counts shared steps once. A failed plan stops the batch
    and is reported in the summary (the records of earlier plans stand); an interruption raises.
    `engine`: one the caller opened and closes (else the plans' executor, opened here)."""
    distinct: dict[str, bool] = {}
    slots = 0
    for plan, _ in plans:
        for step in plan.steps:
            slots += 1
            distinct.setdefault(step.hash, store.outputs.has(step.hash))
    executed: set[str] = set()
    records: list[str] = []
    processes = StepProcesses()
    own_engine = engine is None
    if engine is None:
        engine = engine_for(plans[0][1].executor if plans else LOCAL, processes)
    try:
        if engine.concurrent:
            ran, code, stopped, error = _run_together(store, plans, engine, on_plan, executed, records)
        else:
            ran, code, stopped, error = _run_each(store, plans, processes, on_plan, executed, records)
    finally:
        if own_engine:
            engine.close()
        processes.close()
    return BatchSummary(
        plans=len(plans),
        ran=ran,
        step_slots=slots,
        distinct=len(distinct),
        executed=len(executed),
        cached=sum(distinct.values()),
        records=tuple(records),
        code=code,
        stopped_at=stopped,
        error=error,
    )


def _run_each(
    store: Store,
    plans: Sequence[tuple[Plan, RunOptions]],
    processes: StepProcesses,
    on_plan: Callable[[int, Plan], None] | None,
    executed: set[str],
    records: list[str],
) -> tuple[int, int, str | None, str | None]:
    """(plans done, exit code, the plan that stopped the batch, its message)."""
    code, ran, stopped, error = int(ExitCode.OK), 0, None, None
    for index, (plan, options) in enumerate(plans):
        if on_plan is not None:
            on_plan(index, plan)
        created: list[Path] = []
        try:
            code = run_plan(store, plan, options, processes, on_record=created.append)
        except BuildtrainError as exc:
            if exc.exit_code == ExitCode.INTERRUPTED:
                raise
            code, error = int(exc.exit_code), str(exc)
        _collect(next(iter(created), None), records, executed)
        if code != ExitCode.OK:
            stopped = plan.hash
            break
        ran += 1
    return ran, code, stopped, error


def _run_together(
    store: Store,
    plans: Sequence[tuple[Plan, RunOptions]],
    engine: Engine,
    on_plan: Callable[[int, Plan], None] | None,
    executed: set[str],
    records: list[str],
) -> tuple[int, int, str | None, str | None]:
    """On a concurrent engine every plan runs at once, each in a thread of its own; a step the
    plans share is built once (the others wait for its lock, then find it built). The first plan
    in order that failed is reported; an interruption cancels every started step and is raised."""
    live = LiveSteps()

    def one(index: int, plan: Plan, options: RunOptions) -> tuple[int, str | None, Path | None]:
        if on_plan is not None:
            on_plan(index, plan)
        if len(plans) > 1:  # their lines interleave: each says whose it is
            options = attrs.evolve(options, label=plan.hash[:SHORT])
        created: list[Path] = []
        message: str | None = None
        try:
            code = run_plan(store, plan, options, engine=engine, live=live, on_record=created.append)
        except BuildtrainError as exc:
            code, message = int(exc.exit_code), str(exc)
        return code, message, next(iter(created), None)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(plans)), thread_name_prefix="bt-plan")
    try:
        with signals_interrupt(plans[0][0]):
            futures = [pool.submit(one, i, plan, options) for i, (plan, options) in enumerate(plans)]
            concurrent.futures.wait(futures)
    except BaseException:
        live.cancel_all()
        raise
    finally:
        pool.shutdown(wait=True)
    code, ran, stopped, error = int(ExitCode.OK), 0, None, None
    for (plan, _), future in zip(plans, futures, strict=True):
        plan_code, message, folder = future.result()
        _collect(folder, records, executed)
        if plan_code == ExitCode.INTERRUPTED:
            raise Interrupted(message or f"interrupted; resume with: bt run {plan.hash}")
        if plan_code != ExitCode.OK and stopped is None:
            code, stopped, error = plan_code, plan.hash, message
        ran += plan_code == ExitCode.OK
    return ran, code, stopped, error
