"""The local engine: a step's process on this machine, as `bt run` always started it.

One worker per step, a worker shared by consecutive steps of one numerics environment
(`process/processes.py`), or torchrun and its ranks (`launch.py`); see `spawn.py`. Steps run one at a
time: the machine's cores go to the step that runs (its ranks or threads), not to several.
"""

from __future__ import annotations

import attrs

from buildtrain.executor.engines.engine import EngineOptions, OnEvent, Submission
from buildtrain.executor.process.outcome import Outcome
from buildtrain.executor.process.processes import StepProcesses
from buildtrain.executor.process.spawn import spawn
from buildtrain.plan.toolchain import Machine
from buildtrain.store.store import Store


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
            sub = self.submission
            self.outcome = spawn(
                sub.store,
                sub.plan,
                sub.step,
                sub.threads,
                sub.lock_fd,
                self.on_event,
                sub.options,
                launch=sub.launch,
                processes=self.processes,
            )
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
