"""`bt run`: execute a plan's steps in order, each a cache hit or a child process.

The executor itself never imports torch, so a fully cached plan (a null build) returns at once.
A step that must compute runs in `buildtrain.executor.process.worker`, started with the numerics
environment, holding the step's lock, and reporting JSON events through a pipe that the executor
writes to the run record and the terminal. Consecutive steps of one numerics environment share a
worker (see `process/processes.py`); a train step on several processes runs the same worker on every rank
under torchrun (see `launch.py`), the events arriving on its stdout.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.errors import BuildtrainError, ExitCode, Interrupted, UsageError
from buildtrain.executor.engines.engine import DEFAULT_ENGINE, Engine, EngineOptions, open_engine
from buildtrain.executor.engines.local import LocalEngine
from buildtrain.executor.loop.build import Builder
from buildtrain.executor.loop.progress import Reporter
from buildtrain.executor.loop.record import RunRecord
from buildtrain.executor.loop.schedule import LiveSteps, build_in_order
from buildtrain.executor.process import numerics
from buildtrain.executor.process.launch import SINGLE_PROCESS, Launch
from buildtrain.executor.process.outcome import StepResult
from buildtrain.executor.process.policy import pinned_threads, prepare
from buildtrain.executor.process.processes import StepProcesses
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.executor.remote.remote import RemoteCache
    from buildtrain.store.remote.url import RemoteUrl


LOCAL = EngineOptions()


@attrs.frozen(kw_only=True)
class RunOptions:
    threads: int | None = None
    experiments: Path = Path("experiments")
    wait: bool = True
    progress: bool | None = None
    log_every: int = 10
    target: str | None = None  # build only this step (by label) and what it needs
    launch: Launch = SINGLE_PROCESS  # processes for the train steps (torchrun when more than one)
    remote: RemoteUrl | None = None  # a team cache (never part of a hash: where, not what)
    min_attestations: int = 0  # trusted signers a step pulled from the remote needs (0: any)
    executor: EngineOptions = LOCAL  # where the steps' processes run (never part of a hash)
    quiet: bool = False  # say only what the run came to (`bt run -q`)
    label: str = ""  # put before every line said (several plans running at once)


def with_inputs(steps: list[Step], wanted: set[str]) -> list[Step]:
    """The steps of `steps` (in plan order) whose hash is in `wanted`, and their transitive inputs."""
    wanted = set(wanted)
    for step in reversed(steps):
        if step.hash in wanted:
            wanted.update(step.upstream.values())
    return [step for step in steps if step.hash in wanted]


def steps_for(plan: Plan, target: str | None) -> list[Step]:
    """All steps, or the target step and its transitive inputs, in plan order."""
    if target is None:
        return list(plan.steps)
    try:
        wanted = {plan.by_label(target).hash}
    except KeyError:
        labels = ", ".join(step.label for step in plan.steps)
        raise UsageError(f"plan {plan.hash[:12]} has no step '{target}'; its steps are: {labels}") from None
    return with_inputs(list(plan.steps), wanted)


@contextlib.contextmanager
def signals_interrupt(plan: Plan) -> Iterator[None]:
    """Between step processes (waiting for a lock, reading the store) SIGINT and SIGTERM stop the
    run as an interruption (exit 3, recorded as such, not a bare death by signal); while a step
    process runs, `spawn` forwards them to it instead, so that it checkpoints first."""

    def stop(number: int, _: object) -> None:
        raise Interrupted(
            f"stopped by {signal.Signals(number).name} between steps or while waiting for a step's "
            f"lock; nothing partial was written; resume with: bt run {plan.hash}"
        )

    previous: dict[int, Any] = {}
    try:
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, stop)
    except ValueError:  # not the main thread: the signals are not ours to take
        pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def run_plan(
    store: Store,
    plan: Plan,
    options: RunOptions,
    shared: StepProcesses | None = None,
    engine: Engine | None = None,
    live: LiveSteps | None = None,
    on_record: Callable[[Path], None] | None = None,
) -> int:
    """Execute `plan`; `shared`: local workers that outlive this plan (the plans of a sweep share
    them); `engine`: one that outlives it (else `options.executor` is opened for this plan);
    `live`: the started steps of every plan of a sweep (Ctrl-C cancels them all); `on_record`:
    told the run record's folder as soon as it exists."""
    started = time.perf_counter()
    launch = options.launch
    steps, threads = _steps_and_threads(plan, options, engine)
    record = RunRecord.create(options.experiments, plan, store.plans.meta(plan.hash), store.root)
    if on_record is not None:
        on_record(record.folder)
    reporter = Reporter(options.progress, options.log_every, quiet=options.quiet, plan=options.label)
    _announce(plan, steps, threads, launch, record, reporter)
    outcome, code = "failed", int(ExitCode.FAILED)
    own_engine = engine is None
    if engine is None:
        engine = engine_for(options.executor, shared)
    builder = _builder(store, plan, options, threads, record, reporter, engine, live)

    def build(step: Step) -> StepResult:
        joins = launch.follower and kind_of(step.kind).ranks
        result = builder.join(step) if joins else builder.build(step)
        record.step_result(result)  # now: a later step's interruption must not lose it
        return result

    try:
        with signals_interrupt(plan), store.locks.running(plan.hash):
            concurrent = engine.concurrent and not launch.follower
            build_in_order(steps, build, concurrent=concurrent, cancel=builder.live.cancel_all)
        outcome, code = "done", int(ExitCode.OK)
    except KeyboardInterrupt:  # SIGINT where no handler of ours was installed (another thread)
        outcome, code = "interrupted", int(ExitCode.INTERRUPTED)
        record.event("run_interrupted", message="interrupted")
        raise
    except BuildtrainError as exc:
        outcome = "interrupted" if isinstance(exc, Interrupted) else "failed"
        code = int(exc.exit_code)
        record.event("run_" + outcome, message=str(exc))
        raise
    finally:
        if own_engine:
            engine.close()
        _close_record(record, reporter, outcome, code, time.perf_counter() - started)
    return code


def _builder(
    store: Store,
    plan: Plan,
    options: RunOptions,
    threads: int,
    record: RunRecord,
    reporter: Reporter,
    engine: Engine,
    live: LiveSteps | None,
) -> Builder:
    """What builds each step of this run: through `engine`, with the run's remote if it has one."""
    return Builder(
        store=store,
        plan=plan,
        threads=threads,
        record=record,
        reporter=reporter,
        launch=options.launch,
        wait=options.wait,
        engine=engine,
        remote=_remote_cache(options.remote, reporter, options.min_attestations),
        live=live if live is not None else LiveSteps(),
    )


def _steps_and_threads(plan: Plan, options: RunOptions, engine: Engine | None) -> tuple[list[Step], int]:
    """The steps this run builds (a follower node: those on ranks and what they read) and the
    threads each step process gets, the plan checked against this machine where it runs here."""
    launch = options.launch
    steps = steps_for(plan, options.target)
    if launch.follower:  # node 0 builds the rest; this node helps with the steps on ranks
        steps = with_inputs(steps, {step.hash for step in steps if kind_of(step.kind).ranks})
    # A plan made for an engine's workers (bt plan --executor) need not fit this machine: each node
    # checks the steps' toolchains against its own before it builds (on_node, slurm_task).
    here = (engine.name if engine is not None else options.executor.name) == DEFAULT_ENGINE
    return steps, prepare(plan, options.threads, launch, steps, here)


def _close_record(record: RunRecord, reporter: Reporter, outcome: str, code: int, duration: float) -> None:
    """Seal the run record; a run that is done says so in one line, with what each step came to."""
    record.close(outcome, code, duration)
    if outcome == "done":
        counts = collections.Counter(s.action for s in record.steps)
        done = ", ".join(
            f"{counts[action]} {action}"
            for action in ("executed", "joined", "pulled", "cached")
            if counts[action] or action not in ("joined", "pulled")
        )
        reporter.result(f"done in {duration:.1f}s: {done}; record: {record.folder}")


def engine_for(options: EngineOptions, shared: StepProcesses | None) -> Engine:
    """The engine of one plan's run: local steps share `shared` workers (a sweep's) or their own."""
    if options.name == DEFAULT_ENGINE:
        if shared is not None:
            return LocalEngine(processes=shared, owns_processes=False)
        return LocalEngine(processes=StepProcesses())
    return open_engine(options)


def _remote_cache(url: RemoteUrl | None, reporter: Reporter, min_attestations: int) -> RemoteCache | None:
    """The run's team cache, imported only when a remote is set (a run without one loads nothing
    of it, and a run with one opens it only when a step is not in the local store)."""
    if url is None:
        return None
    from buildtrain.executor.remote.remote import RemoteCache

    return RemoteCache(url, reporter.step, min_attestations)


def _announce(
    plan: Plan, steps: list[Step], threads: int, launch: Launch, record: RunRecord, reporter: Reporter
) -> None:
    """Say what runs where, and warn when the processes ask for more cores than the machine has."""
    settings = plan.numerics
    per_process = numerics.intra_op_threads(settings.profile, settings.device, threads)
    if launch.world_size > 1:
        layout = f"{launch.world_size} processes x {per_process} threads"
    elif per_process != threads:
        layout = f"{threads} cores, one thread per process"
    else:
        layout = f"{threads} threads"
    node = f", node {launch.node_rank} of {launch.nnodes}" if launch.nnodes > 1 else ""
    reporter.say(
        f"bt run {plan.hash[:12]} '{plan.name}' ({len(steps)} steps, {layout}{node}) -> {record.folder}"
    )
    record.event("run_started", plan=plan.hash, threads=threads, pid=os.getpid(), **attrs.asdict(launch))
    cores = os.cpu_count() or 1
    if launch.nproc * per_process > cores and any(kind_of(step.kind).ranks for step in steps):
        fix = (
            "this native plan pins its thread count: plan it with fewer numerics.threads"
            if pinned_threads(plan) is not None
            else f"--threads {max(1, cores // launch.nproc)} fits"
        )
        reporter.say(
            f"note: {launch.nproc} processes x {threads} threads exceed this machine's {cores} cores, "
            f"which slows training; {fix}"
        )
