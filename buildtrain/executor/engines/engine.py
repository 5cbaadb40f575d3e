"""The executor seam: where a step's process runs (this machine, a Ray cluster, Slurm).

An engine only places and runs step processes. Everything else is written once above it, in the
build loop (`executor/loop/`: `run.py`, `build.py`, `batch.py`): the DAG order (a step starts when
its inputs exist), the cache checks (a step already built here or on the remote never reaches an
engine), the locks, the run record and the progress lines. An engine plugs in with one module
under `buildtrain.executor.engines` named in `ENGINES`, whose `open_engine(options)` returns an `Engine`; it is imported only when
`--executor` (or `BT_EXECUTOR`) names it, so a run on this machine loads nothing of Ray or Slurm.

Given a `Submission` (the store, plan and step, the threads per process, this run's lock on the
step, the remote), an engine starts the step's process with `job_of`'s job, under
`environment_of`'s numerics environment (applied before torch is imported, as locally), on the
resources `resources_of` names (ranks, CPUs and GPUs per rank), and returns a `Handle` to wait on
or cancel. After a successful `wait` the step's output is in the run's store: written there by a
process that shares the store's folder, or pulled from the remote where the engine's process
built it in a store of its own and pushed it (then the engine says `pushes_outputs`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from buildtrain.errors import EngineUnavailable, UsageError
from buildtrain.executor.process import numerics
from buildtrain.executor.process.faults import test_hooks_from_environment
from buildtrain.executor.process.job import PLAIN_RUN, Job, JobNumerics, JobOptions
from buildtrain.executor.process.launch import SINGLE_PROCESS, Launch
from buildtrain.executor.process.policy import step_launch
from buildtrain.executor.process.step_sources import source_paths
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.toolchain import Machine
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.executor.process.outcome import Outcome
    from buildtrain.store.remote.url import RemoteUrl

# The engines `--executor` names, each the module that implements it (imported only when named).
ENGINES: Mapping[str, str] = {
    "local": "buildtrain.executor.engines.local",
    "ray": "buildtrain.executor.engines.ray_engine",
    "slurm": "buildtrain.executor.engines.slurm_engine",
}
DEFAULT_ENGINE = "local"
OnEvent = Callable[[dict[str, Any]], None]


def _at_least_one(_: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1 (got {value})")


@attrs.frozen(kw_only=True)
class Resources:
    """What one step asks an engine for: `ranks` processes, each with these CPUs and GPUs."""

    ranks: int = attrs.field(default=1, validator=_at_least_one)
    cpus_per_rank: int = attrs.field(default=1, validator=_at_least_one)
    gpus_per_rank: int = attrs.field(default=0, validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class Submission:
    """Everything a step's process needs, wherever it runs."""

    store: Store  # the run's store: a process sharing its folder writes the output there
    plan: Plan
    step: Step
    threads: int  # threads per process (the plan's numerics decide how many it computes with)
    lock_fd: int  # this run's lock on the step in `store`; a local process inherits it
    launch: Launch = SINGLE_PROCESS  # ranks as `bt run --nproc` asked for them
    options: JobOptions = PLAIN_RUN
    remote: RemoteUrl | None = None  # where a process on another node gets inputs and leaves outputs
    min_attestations: int = 0  # the run's requirement of trusted signers, which such a process keeps
    inputs: Mapping[str, str] = attrs.field(factory=dict)  # input step -> the manifest digest the run holds


def job_of(submission: Submission, on_event: OnEvent) -> Job:
    """The job file's content: what the worker (`buildtrain.executor.process.worker`) reads; a data
    step's files are located by content here (`on_event` hears of one found elsewhere)."""
    store, plan, step = submission.store, submission.plan, submission.step
    settings = plan.numerics
    sources = source_paths(store, plan, step, on_event) if kind_of(step.kind).reads_sources else []
    options = submission.options
    return Job(
        store=str(submission.store.root),
        plan=submission.plan.hash,
        step=submission.step.hash,
        kind=submission.step.kind,
        numerics=JobNumerics(
            profile=settings.profile, device=settings.device, dtype=settings.dtype, threads=submission.threads
        ),
        sources=tuple(sources),
        options=attrs.evolve(options, hooks={**test_hooks_from_environment(), **options.hooks}),
    )


def environment_of(submission: Submission) -> dict[str, str]:
    """The numerics environment the step's process must start under (before torch loads)."""
    settings = submission.plan.numerics
    return numerics.environment(settings.profile, settings.device, submission.threads)


def resources_of(submission: Submission) -> Resources:
    """Ranks, CPUs and GPUs per rank: the ranks `step_launch` gives the step on `threads` cores,
    each rank computing with the threads its numerics profile allows."""
    plan, step = submission.plan, submission.step
    settings = plan.numerics
    launch = step_launch(settings, step, submission.threads, submission.launch)
    ranks = launch.world_size if kind_of(step.kind).ranks else 1
    cpus = numerics.intra_op_threads(settings.profile, settings.device, submission.threads)
    gpus = 1 if settings.device == "cuda" and kind_of(step.kind).needs_torch(step.config) else 0
    return Resources(ranks=ranks, cpus_per_rank=max(1, cpus), gpus_per_rank=gpus)


class Handle(Protocol):
    """A started step: where it runs, how it stands, how it ended."""

    @property
    def node(self) -> str:
        """The node it runs on ("" until the engine placed it)."""
        ...

    def state(self) -> str:
        """ "pending", "running" or "finished"."""
        ...

    def wait(self) -> Outcome:
        """Block until it ends; its exit status, error events and whether it was interrupted."""
        ...

    def cancel(self) -> None:
        """Stop it as an interruption: a train step checkpoints first (a later run resumes)."""
        ...


class Engine(Protocol):
    """Where step processes run; see the module's docstring for what it owes its caller."""

    name: str
    concurrent: bool  # runs independent steps (and sweep points) at once
    pushes_outputs: bool  # its processes push outputs to the remote themselves

    def start(self, submission: Submission, on_event: OnEvent) -> Handle:
        """Start the step's process(es); `on_event` receives its JSON events."""
        ...

    def worker_machine(self, device: str, store: Store) -> Machine | None:
        """The machine a worker that runs steps of `device` executes them on, asked of the engine
        (a task or job that reports `Machine.here`; None: this machine). `bt plan --executor`
        plans for it, so the steps' hashes name the workers' results."""
        ...

    def cluster(self) -> str:
        """What names the workers `worker_machine` asks (an address, a partition): with the
        device and this machine's toolchain, the key its kept answer is found by (`probes.py`)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, a connection, a cluster it started)."""
        ...


@attrs.frozen(kw_only=True)
class EngineOptions:
    """What opening an engine may use: never part of a hash (where, not what)."""

    name: str = DEFAULT_ENGINE
    settings: Mapping[str, str] = attrs.Factory(dict)  # engine-specific (--slurm-partition, ...)


def engine_name(given: str | None) -> str:
    """`--executor`, else `BT_EXECUTOR`, else local; an unknown name is a usage error."""
    name = given or os.environ.get("BT_EXECUTOR") or DEFAULT_ENGINE
    if name not in ENGINES:
        raise UsageError(f"--executor / BT_EXECUTOR: unknown executor {name!r}; choose {', '.join(ENGINES)}")
    return name


def open_engine(options: EngineOptions) -> Engine:
    """The engine named, its module imported only now."""
    try:
        module = importlib.import_module(ENGINES[options.name])
    except ModuleNotFoundError as exc:
        if exc.name != ENGINES[options.name]:
            raise
        raise EngineUnavailable(f"--executor {options.name}: not available in this buildtrain") from None
    engine: Engine = module.open_engine(options)
    return engine
