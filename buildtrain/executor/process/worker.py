"""The process that executes one step: `python -m buildtrain.executor.process.worker --job JOB.json`.

It is started by the executor with the numerics environment already in place, imports torch only
after checking that, logs structured JSON events to a pipe the executor reads, builds the step's
output in a temporary folder and publishes it atomically. Exit status: 0 done, 1 failed,
3 interrupted (a checkpoint was written), or the exit code of the buildtrain error that stopped the
step (for example 5 for an input that does not verify, 6 for a toolchain that does not match); a
serving worker exits with the status of the first job that did not succeed.

With `--serve FD` it runs one job after another, as the executor sends them (see
`processes.py`), so consecutive steps of one numerics environment import torch once.

Under torchrun the same module runs on every rank of a train step; rank 0 does all of the above,
the other ranks only train (see `steps/train/ranks.py`).

A job that watches its training (`bt verify`) runs in `python -m buildtrain.verify.worker`, which
calls `main` here with an observer factory: the executor never imports verify.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.errors import BuildtrainError, ExitCode, Interrupted, StepFailed, accept_stop_signals
from buildtrain.executor.process import logs, numerics
from buildtrain.executor.process.faults import signal_after_publish_for_tests, signal_inside_import_for_tests
from buildtrain.executor.process.job import Job, JobNumerics
from buildtrain.executor.process.launch import PARENT_PID, die_with_parent
from buildtrain.executor.process.processes import JOB_EXIT
from buildtrain.kinds import kind_of
from buildtrain.plan.stored import load_plan
from buildtrain.steps.failures import out_of_memory
from buildtrain.store import objects
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.config.schema import NumericsConfig
    from buildtrain.plan.plan import Step
    from buildtrain.steps.context import StepContext
    from buildtrain.steps.train.controls import StopRequest, TrainControls
    from buildtrain.steps.train.observer import Observer

# Makes the observer of a train step's rank 0 from the job and the logger (None: the job has none).
ObserverFactory = Callable[[Job, Any], "Observer | None"]

# The numerics this process applied when it imported torch (a serving worker runs several steps).
APPLIED: dict[str, tuple[str, str, int]] = {}


def _interrupt_now(number: int, _: object) -> None:
    raise Interrupted(f"stopped by {signal.Signals(number).name}")


def execute(job: Job, log: Any, observer: ObserverFactory | None = None) -> int:
    from buildtrain.executor.process.inputs import verified_inputs
    from buildtrain.steps.context import StepContext
    from buildtrain.steps.eval.cache import StoreResults
    from buildtrain.steps.sources import planned_sources
    from buildtrain.steps.train.controls import StopRequest

    # Until the step computes, a signal is only remembered: a handler that raised inside `import
    # torch` lands in a library's import machinery, where it was swallowed (the step trained on)
    # or left a half-imported module behind (a traceback), in 8 of 25 trials.
    stop = StopRequest()
    stop.install()
    store = Store(Path(job.store))
    plan = load_plan(store, job.plan)
    step = plan.step(job.step)
    log = log.bind(label=step.label)
    kind = kind_of(step.kind)
    if kind.needs_torch(step.config):
        _import_torch(job.numerics, log)
        _select_kernels(step.toolchain, log)

    controls = _controls(job, step, log, observer, stop)
    lead = controls is None or controls.ranks.lead
    if job.options.checkpoint is not None:
        return _evaluate_checkpoint(job, store, plan.numerics, step, log)

    ctx = StepContext(
        step=step,
        numerics=plan.numerics,
        inputs=verified_inputs(store, step, only=None if lead else kind.rank_inputs),
        sources=planned_sources(step.inputs.get("sources", []), list(job.sources)),
        work=store.outputs.work_dir(step.hash),
        results=StoreResults(store=store),
        log=log,
        controls=controls,
    )
    computation = importlib.import_module(kind.computes)
    if not lead:  # trains in step with rank 0, which alone writes checkpoints and the output
        computation.execute(ctx, None)
        log.info("rank_done")
        return ExitCode.OK
    return _compute_and_publish(job, store, step, ctx, computation, stop, log)


def _controls(
    job: Job, step: Step, log: Any, observer: ObserverFactory | None, stop: StopRequest
) -> TrainControls | None:
    """A step on ranks gets its controls (the loop reads the stop request between updates), the
    ranks agreeing first on what they build; any other step is interrupted by a signal at once."""
    if kind_of(step.kind).ranks:
        controls = _train_controls(job, log, observer, stop)
        controls.ranks.agree_on(step.hash, step.label)
        return controls
    if stop.signal_name is not None:
        raise Interrupted(f"stopped by {stop.signal_name} before {step.label} began; nothing was written")
    signal.signal(signal.SIGTERM, _interrupt_now)
    signal.signal(signal.SIGINT, _interrupt_now)
    return None


def _compute_and_publish(
    job: Job, store: Store, step: Step, ctx: StepContext, computation: Any, stop: StopRequest, log: Any
) -> int:
    """Rank 0 (or the only process): compute the output into a temporary folder and publish it
    as the step's output (with `job.options.commit`); nothing is left behind either way."""
    out = store.new_temp(step.label.replace(":", "-"))
    try:
        digests = computation.execute(ctx, out)
        if digests is None:
            log.info("stopped_early")
            return ExitCode.OK
        # From here a signal is only remembered: the executor writes the step's metrics summary
        # when `step_done` arrives, so an output published without it would stay without one.
        stop.install()
        if job.options.commit:
            objects.publish(out, store.outputs.path(step.hash), digests)
            objects.remove_tree(store.outputs.work_dir(step.hash))  # its checkpoints are in the output now
            signal_after_publish_for_tests(step.label)
        log.info("step_done", digests=digests)
        return ExitCode.OK
    finally:
        objects.remove_tree(out)


def _evaluate_checkpoint(job: Job, store: Store, settings: NumericsConfig, step: Step, log: Any) -> int:
    """Evaluation beside training: score the kept checkpoint the job names, of the train step
    that is the step's `checkpoints_of` input (whose output does not exist yet), and record each
    result in the evaluation cache; nothing is published."""
    from buildtrain.executor.process.inputs import verified_inputs
    from buildtrain.steps.context import StepContext
    from buildtrain.steps.eval.cache import StoreResults
    from buildtrain.steps.sources import planned_sources
    from buildtrain.store.layout import CHECKPOINTS

    kind = kind_of(step.kind)
    assert job.options.checkpoint is not None and kind.checkpoints_of is not None
    folder = Path(job.options.checkpoint)
    published = store.outputs.path(step.upstream[kind.checkpoints_of]) / CHECKPOINTS / folder.name
    work = store.new_temp(f"{step.label}-beside")
    ctx = StepContext(
        step=step,
        numerics=settings,
        inputs=verified_inputs(store, step, only=set(step.upstream) - {kind.checkpoints_of}),
        sources=planned_sources(step.inputs.get("sources", []), list(job.sources)),
        work=work,
        results=StoreResults(store=store),
        log=log,
    )
    kill_after = job.options.hooks.get("kill_eval_after")  # tests only: a worker killed midway

    def before_scoring() -> None:
        if kill_after is not None and SCORED["results"] >= kill_after:
            log.info("hard_kill", scored=SCORED["results"])
            signal.raise_signal(signal.SIGKILL)
        SCORED["results"] += 1

    try:
        computation = importlib.import_module(kind.computes)
        computation.evaluate_checkpoint(ctx, [folder, published], before_scoring)
    finally:
        objects.remove_tree(work)
    return ExitCode.OK


# Results this process began to score beside training (read by the test-only kill_eval_after).
SCORED = {"results": 0}


def _import_torch(settings: JobNumerics, log: Any) -> None:
    """Import torch under the job's numerics environment, once per process (a serving worker runs
    several steps of one environment)."""
    wanted = (settings.profile, settings.device, settings.threads)
    if APPLIED.get("settings") == wanted:
        return
    signal_inside_import_for_tests()
    _, applied = numerics.import_torch(*wanted)
    APPLIED["settings"] = wanted
    log.info("numerics_applied", profile=settings.profile, **applied)


def _select_kernels(toolchain: Mapping[str, Any], log: Any) -> None:
    """The CPU kernels the step's hash names (`numerics.kernels`, resolved by the fingerprint on
    the machine that plans for this one); a GPU step's model never reaches them."""
    from buildtrain.steps.train import kernels

    mode = toolchain.get("kernels", "eager")
    kernels.select(mode)
    log.info("kernels_selected", kernels=mode)


def _train_controls(job: Job, log: Any, observer: ObserverFactory | None, stop: StopRequest) -> TrainControls:
    """The stop request, faults, observer and ranks of a train step process."""
    from buildtrain.steps.train.controls import TrainControls
    from buildtrain.steps.train.faults import FaultPlan, Faults
    from buildtrain.steps.train.observer import Observers
    from buildtrain.steps.train.ranks import Ranks

    ranks = Ranks.from_environment(job.numerics.device)
    if ranks.world > 1:
        log.info("rank_started", pid=os.getpid())
    observers = [Faults(FaultPlan.from_job(dict(job.options.hooks)), ranks.rank, log)]
    watcher = observer(job, log) if observer is not None and ranks.lead else None
    if watcher is not None:
        observers.append(watcher)
    return TrainControls(stop=stop, observer=Observers(*observers), ranks=ranks)


def _kept(job: Job | None) -> str:
    """What survives a failed write: only a step that checkpoints has something to fall back on."""
    if job is not None and kind_of(job.kind).resumable:
        return (
            "nothing partial was published and the newest checkpoint (if any) is intact; free space, then "
            "bt run again"
        )
    return "nothing partial was published; free space, then bt run again"


def run_job(path: Path, log: Any, observer: ObserverFactory | None = None) -> int:
    """Execute the job at `path`; every failure becomes an event and an exit status, never a
    traceback."""
    job = None
    try:
        job = Job.read(path)
        return execute(job, log, observer)
    except Interrupted as exc:
        log.warning("interrupted", message=str(exc))
        return ExitCode.INTERRUPTED
    except (StepFailed, MemoryError) as exc:
        message = str(exc) if isinstance(exc, StepFailed) else "out of memory; the last checkpoint is intact"
        log.error("step_failed", message=message)
        return ExitCode.FAILED
    except BuildtrainError as exc:
        log.error("step_failed", message=str(exc), exit_code=int(exc.exit_code))
        return exc.exit_code
    except OSError as exc:  # disk full, permissions: the store and the last checkpoint stay intact
        written = exc.filename2 or exc.filename  # a copy's error names its source first, its target second
        where = f" {written}" if written else ""
        log.error("step_failed", message=f"cannot write{where}: {exc.strerror or exc}; {_kept(job)}")
        return ExitCode.FAILED
    except Exception as exc:
        if type(exc).__name__ == "SafetensorError":  # safetensors' own I/O error: disk full, file too large
            log.error("step_failed", message=f"cannot write a tensor file: {exc}; {_kept(job)}")
            return ExitCode.FAILED
        if out_of_memory(exc):
            log.error(
                "step_failed",
                message="out of memory on the device; the last checkpoint is intact; lower train.micro_batch_size",
            )
            return ExitCode.FAILED
        log.error("step_crashed", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return ExitCode.FAILED


def serve(control_fd: int, log: Any, observer: ObserverFactory | None = None) -> int:
    """Run the jobs the executor sends, one after another (see `processes.py`), until it closes the
    socket; stop at the first job that does not succeed, so no failed step's state lives on."""
    control = socket.socket(fileno=control_fd)
    while True:
        signal.signal(signal.SIGTERM, _interrupt_now)  # between steps: stop at once
        signal.signal(signal.SIGINT, _interrupt_now)
        try:
            message, fds, _, _ = socket.recv_fds(control, 65536, 1)
        except Interrupted:
            return ExitCode.INTERRUPTED
        if not message:
            return ExitCode.OK
        try:
            code = run_job(Path(os.fsdecode(message)), log, observer)
        finally:
            for fd in fds:
                os.close(fd)  # the step's lock: held while its step ran
        log.info(JOB_EXIT, status=int(code))
        if code != ExitCode.OK:
            return int(code)


def main(argv: list[str] | None = None, observer: ObserverFactory | None = None) -> int:
    """Run the job (or serve jobs) named by `argv`; `observer` makes a train step's observer."""
    parser = argparse.ArgumentParser(prog="buildtrain.executor.process.worker")
    job_or_serve = parser.add_mutually_exclusive_group(required=True)
    job_or_serve.add_argument("--job", help="JSON job description written by the executor")
    job_or_serve.add_argument("--serve", type=int, metavar="FD", help="socket to receive jobs on")
    parser.add_argument(
        "--events-fd", type=int, required=True, help="pipe for JSON event lines (1 under torchrun)"
    )
    args = parser.parse_args(argv)
    accept_stop_signals()  # whatever mask the engine's process handed down
    parent = os.environ.get(PARENT_PID)
    die_with_parent(int(parent) if parent else None)
    events_fd = args.events_fd
    if events_fd == 1:
        # Under torchrun the events share stdout with every rank; keep anything else a library
        # prints out of that stream by sending fd 1 to stderr from here on.
        events_fd = os.dup(1)
        os.dup2(2, 1)
    stream = EventStream(os.fdopen(events_fd, "w", buffering=1, encoding="utf-8"))
    log = logs.configure(stream)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: every event says whose it is
        log = log.bind(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        if args.serve is not None:
            return serve(args.serve, log, observer)
        return run_job(Path(args.job), log, observer)
    finally:
        stream.flush()


class EventStream:
    """The pipe to the executor. Once nobody reads it (`bt run` was killed outright, before the
    kernel's parent-death signal could reach this process), stop at once and quietly: the output
    is unpublished, the checkpoints atomic, and a traceback would only land on a dead terminal."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        try:
            self.stream.write(text)
        except BrokenPipeError:
            os._exit(ExitCode.INTERRUPTED)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            os._exit(ExitCode.INTERRUPTED)


def exit_now(code: int) -> None:
    """Outputs are sealed and fsynced by now; skip the interpreter's teardown, which costs about a
    second once torch is loaded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
