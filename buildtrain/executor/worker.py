"""The process that executes one step: `python -m buildtrain.executor.worker --job JOB.json`.

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
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.errors import BuildtrainError, ExitCode, Interrupted, StepFailed
from buildtrain.executor import logs, numerics
from buildtrain.executor.launch import die_with_parent
from buildtrain.executor.processes import JOB_EXIT
from buildtrain.plan.stored import load_plan
from buildtrain.steps.failures import out_of_memory
from buildtrain.store import objects
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext
    from buildtrain.steps.train.controls import TrainControls
    from buildtrain.steps.train.observer import Observer

# Makes the observer of a train step's rank 0 from the job and the logger (None: the job has none).
ObserverFactory = Callable[[dict[str, Any], Any], "Observer | None"]

TORCH_STEPS = ("train", "eval")
# The numerics this process applied when it imported torch (a serving worker runs several steps).
APPLIED: dict[str, tuple[str, str, int]] = {}


def _interrupt_now(number: int, _: object) -> None:
    raise Interrupted(f"stopped by {signal.Signals(number).name}")


def execute(job: dict[str, Any], log: Any, observer: ObserverFactory | None = None) -> int:
    from buildtrain.steps.context import StepContext, verified_inputs

    store = Store(Path(job["store"]))
    plan = load_plan(store, job["plan"])
    step = plan.step(job["step"])
    log = log.bind(label=step.label)

    if step.kind in TORCH_STEPS or (step.kind == "export" and _casts(step.config)):
        settings = job["numerics"]
        wanted = (settings["profile"], settings["device"], settings["threads"])
        if APPLIED.get("settings") != wanted:  # the first computing step of this process
            numerics.check_before_import(*wanted)
            import torch  # only now: the numerics environment is in place

            applied = numerics.apply_after_import(torch, *wanted)
            APPLIED["settings"] = wanted
            log.info("numerics_applied", profile=settings["profile"], **applied)

    controls = None
    lead = True
    if step.kind == "train":
        controls = _train_controls(job, log, observer)
        lead = controls.ranks.lead
        controls.ranks.agree_on(step.hash, step.label)
    else:
        signal.signal(signal.SIGTERM, _interrupt_now)
        signal.signal(signal.SIGINT, _interrupt_now)

    ctx = StepContext(
        store=store,
        plan=plan,
        step=step,
        # The other ranks receive their starting weights from rank 0 and only read the data.
        inputs=verified_inputs(store, step, only=None if lead else ("data",)),
        sources=[Path(p) for p in job.get("sources", [])],
        log=log,
        controls=controls,
    )
    if not lead:  # trains in step with rank 0, which alone writes checkpoints and the output
        _dispatch(ctx, None)
        log.info("rank_done")
        return ExitCode.OK
    out = store.new_temp(step.label.replace(":", "-"))
    try:
        digests = _dispatch(ctx, out)
        if digests is None:
            log.info("stopped_early")
            return ExitCode.OK
        if job.get("commit", True):
            objects.publish(out, store.output(step.hash), digests)
            if step.kind == "train":
                objects.remove_tree(store.work_dir(step.hash))
        log.info("step_done", digests=digests)
        return ExitCode.OK
    finally:
        objects.remove_tree(out)


def _casts(export_config: dict[str, Any]) -> bool:
    """An export that casts the weights needs torch (and so the numerics environment)."""
    from buildtrain.steps.export import ExportStep

    return ExportStep.from_config(export_config).export.dtype != "float32"


def _train_controls(job: dict[str, Any], log: Any, observer: ObserverFactory | None) -> TrainControls:
    """The stop request, faults, observer and ranks of a train step process."""
    from buildtrain.steps.train.controls import StopRequest, TrainControls
    from buildtrain.steps.train.faults import FaultPlan, Faults
    from buildtrain.steps.train.observer import Observers
    from buildtrain.steps.train.ranks import Ranks

    ranks = Ranks.from_environment(job["numerics"]["device"])
    if ranks.world > 1:
        log.info("rank_started", pid=os.getpid())
    stop = StopRequest()
    stop.install()
    observers = [Faults(FaultPlan.from_job(job.get("hooks", {})), ranks.rank, log)]
    watcher = observer(job, log) if observer is not None and ranks.lead else None
    if watcher is not None:
        observers.append(watcher)
    return TrainControls(stop=stop, observer=Observers(*observers), ranks=ranks)


def _dispatch(ctx: StepContext, out: Path | None) -> dict[str, str] | None:
    kind = ctx.step.kind
    if kind == "train":
        from buildtrain.steps.train import step as train_step

        return train_step.execute(ctx, out)
    assert out is not None, "only a train step runs on several ranks"
    if kind == "tokenizer":
        from buildtrain.steps import tokenizer

        return tokenizer.execute(ctx, out)
    if kind == "data":
        from buildtrain.steps import data

        return data.execute(ctx, out)
    if kind == "eval":
        from buildtrain.steps import eval as eval_step

        return eval_step.execute(ctx, out)
    from buildtrain.steps import export

    return export.execute(ctx, out)


def _kept(job: dict[str, Any]) -> str:
    """What survives a failed write: only a train step has checkpoints to fall back on."""
    if job.get("kind") == "train":
        return (
            "nothing partial was published and the newest checkpoint (if any) is intact; free space, then "
            "bt run again"
        )
    return "nothing partial was published; free space, then bt run again"


def run_job(job: dict[str, Any], log: Any, observer: ObserverFactory | None = None) -> int:
    """Execute one job; every failure becomes an event and an exit status, never a traceback."""
    try:
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
            code = run_job(json.loads(Path(os.fsdecode(message)).read_text(encoding="utf-8")), log, observer)
        finally:
            for fd in fds:
                os.close(fd)  # the step's lock: held while its step ran
        log.info(JOB_EXIT, status=int(code))
        if code != ExitCode.OK:
            return int(code)


def main(argv: list[str] | None = None, observer: ObserverFactory | None = None) -> int:
    """Run the job (or serve jobs) named by `argv`; `observer` makes a train step's observer."""
    parser = argparse.ArgumentParser(prog="buildtrain.executor.worker")
    job_or_serve = parser.add_mutually_exclusive_group(required=True)
    job_or_serve.add_argument("--job", help="JSON job description written by the executor")
    job_or_serve.add_argument("--serve", type=int, metavar="FD", help="socket to receive jobs on")
    parser.add_argument(
        "--events-fd", type=int, required=True, help="pipe for JSON event lines (1 under torchrun)"
    )
    args = parser.parse_args(argv)
    die_with_parent()
    events_fd = args.events_fd
    if events_fd == 1:
        # Under torchrun the events share stdout with every rank; keep anything else a library
        # prints out of that stream by sending fd 1 to stderr from here on.
        events_fd = os.dup(1)
        os.dup2(2, 1)
    stream = os.fdopen(events_fd, "w", buffering=1, encoding="utf-8")
    log = logs.configure(stream)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: every event says whose it is
        log = log.bind(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        if args.serve is not None:
            return serve(args.serve, log, observer)
        return run_job(json.loads(Path(args.job).read_text(encoding="utf-8")), log, observer)
    finally:
        stream.flush()


def exit_now(code: int) -> None:
    """Outputs are sealed and fsynced by now; skip the interpreter's teardown, which costs about a
    second once torch is loaded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
