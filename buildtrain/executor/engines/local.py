"""The local engine: a step's process on this machine, as `bt run` always started it.

One worker per step, a worker shared by consecutive steps of one numerics environment
(`process/processes.py`), or torchrun and its ranks (`launch.py`); see `spawn.py`. Steps run one at a
time: the machine's cores go to the step that runs (its ranks or threads), not to several.

Every local step comes through here, as a cluster engine's does, from a `Submission`: `bt run`'s
steps (`loop/build.py`), a node joining node 0's ranks (`Builder.join`) and `bt verify`'s
re-executions (`run_isolated`). This is the one caller of `spawn`, which it hands what the
submission makes of it (`start_of`: the job, the numerics environment, the ranks).
"""

from __future__ import annotations

import attrs

from buildtrain.executor.engines.engine import EngineOptions, OnEvent, Submission, environment_of, job_of
from buildtrain.executor.process.job import JobOptions
from buildtrain.executor.process.launch import SINGLE_PROCESS, Launch
from buildtrain.executor.process.outcome import Outcome
from buildtrain.executor.process.policy import step_launch
from buildtrain.executor.process.processes import StepProcesses
from buildtrain.executor.process.spawn import StepStart, spawn
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.toolchain import Machine
from buildtrain.store.store import Store


def start_of(submission: Submission, on_event: OnEvent) -> StepStart:
    """How the submitted step's process starts here: its job (a data step's files located now,
    `on_event` hearing of one found elsewhere), its numerics environment, and torchrun's ranks
    for a kind that runs on ranks when the step gets more than one."""
    plan, step = submission.plan, submission.step
    launch = step_launch(plan.numerics, step, submission.threads, submission.launch)
    ranked = kind_of(step.kind).ranks and launch.world_size > 1
    return StepStart(
        job=job_of(submission, on_event),
        job_dir=submission.store.tmp,
        environment=environment_of(submission),
        lock_fd=submission.lock_fd,
        launch=launch if ranked else SINGLE_PROCESS,
    )


@attrs.define
class LocalHandle:
    """A local step runs inside `wait` (spawn forwards this run's signals to it as it runs)."""

    submission: Submission
    on_event: OnEvent
    processes: StepProcesses | None
    outcome: Outcome | None = None

    @property
    def node(self) -> str:
        return "local"

    def state(self) -> str:
        return "finished" if self.outcome is not None else "pending"

    def wait(self) -> Outcome:
        if self.outcome is None:
            self.outcome = spawn(start_of(self.submission, self.on_event), self.on_event, self.processes)
        return self.outcome

    def cancel(self) -> None:
        """Nothing to do: a local step receives this run's SIGINT/SIGTERM itself (see spawn)."""


@attrs.define
class LocalEngine:
    """This machine; `processes`: workers shared by the steps (and plans) of one `bt run`."""

    processes: StepProcesses | None = attrs.Factory(StepProcesses)
    owns_processes: bool = True  # else a caller's (a sweep's), closed by that caller
    name: str = "local"
    concurrent: bool = False
    pushes_outputs: bool = False

    def start(self, submission: Submission, on_event: OnEvent) -> LocalHandle:
        return LocalHandle(submission, on_event, self.processes)

    def worker_machine(self, device: str, store: Store) -> Machine | None:
        return None  # this machine: the planner's own

    def cluster(self) -> str:
        return ""  # this machine, which no probe asks

    def close(self) -> None:
        if self.processes is not None and self.owns_processes:
            self.processes.close()


def open_engine(options: EngineOptions) -> LocalEngine:
    return LocalEngine()


def run_isolated(
    store: Store, plan: Plan, step: Step, threads: int, options: JobOptions, launch: Launch = SINGLE_PROCESS
) -> Outcome:
    """One step in a fresh process (or a train step's ranks), holding its lock in `store`, its
    events discarded: how `bt verify` re-executes a step in its scratch store."""
    with store.locks.hold(step.hash) as lock_fd:
        submission = Submission(
            store=store,
            plan=plan,
            step=step,
            threads=threads,
            lock_fd=lock_fd,
            launch=launch,
            options=options,
        )
        return LocalEngine(processes=None).start(submission, lambda _: None).wait()
