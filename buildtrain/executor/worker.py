"""The process that executes one step: `python -m buildtrain.executor.worker --job JOB.json`.

It is started by the executor with the numerics environment already in place, imports torch only
after checking that, logs structured JSON events to a pipe the executor reads, builds the step's
output in a temporary folder and publishes it atomically. Exit status: 0 done, 1 failed,
3 interrupted (a checkpoint was written).

With `--serve FD` it runs one job after another, as the executor sends them (see
`processes.py`), so consecutive steps of one numerics environment import torch once.

Under torchrun the same module runs on every rank of a train step; rank 0 does all of the above,
the other ranks only train (see `steps/train/ranks.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import structlog

from buildtrain.errors import BuildtrainError, ExitCode, Interrupted, StepFailed
from buildtrain.executor import numerics
from buildtrain.executor.launch import die_with_parent
from buildtrain.executor.processes import JOB_EXIT
from buildtrain.store import objects
from buildtrain.store.store import Store

TORCH_STEPS = ("train", "eval")
# The numerics this process applied when it imported torch (a serving worker runs several steps).
APPLIED: dict[str, tuple[str, str, int]] = {}


def configure_logging(stream: Any) -> Any:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()


def _interrupt_now(number: int, _: object) -> None:
    raise Interrupted(f"stopped by {signal.Signals(number).name}")


def execute(job: dict[str, Any], log: Any) -> int:
    from buildtrain.steps.context import StepContext, verified_inputs

    store = Store(Path(job["store"]))
    plan = store.load_plan(job["plan"])
    step = plan.step(job["step"])
    log = log.bind(label=step.label)

    if step.kind in TORCH_STEPS or (step.kind == "export" and step.config["export"]["dtype"] != "float32"):
        settings = job["numerics"]
        wanted = (settings["profile"], settings["device"], settings["threads"])
        if APPLIED.get("settings") != wanted:  # the first computing step of this process
            numerics.check_before_import(*wanted)
            import torch  # only now: the numerics environment is in place

            applied = numerics.apply_after_import(torch, *wanted)
            APPLIED["settings"] = wanted
            log.info("numerics_applied", profile=settings["profile"], **applied)

    extra: dict[str, Any] = {}
    lead = True
    if step.kind == "train":
        from buildtrain.steps.train.ranks import Ranks
        from buildtrain.steps.train.trainer import Hooks, StopRequest

        ranks = extra["ranks"] = Ranks.from_environment(job["numerics"]["device"])
        lead = ranks.lead
        if ranks.world > 1:
            log.info("rank_started", pid=os.getpid())
        ranks.agree_on(step.hash, step.label)

        stop = StopRequest()
        stop.install()
        extra["stop"] = stop
        extra["hooks"] = Hooks(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in job.get("hooks", {}).items()}
        )
        if job.get("watch") and lead:
            from buildtrain.verify.watch import Watcher

            extra["watch"] = Watcher.from_job(job["watch"], log)
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
        extra=extra,
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


def _dispatch(ctx: Any, out: Path | None) -> dict[str, str] | None:
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

        return data.build(ctx.step.to_body(), ctx.sources, out, ctx.log, ctx.inputs.get("tokenizer"))
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


def run_job(job: dict[str, Any], log: Any) -> int:
    """Execute one job; every failure becomes an event and an exit status, never a traceback."""
    try:
        return execute(job, log)
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
        where = f" {exc.filename}" if exc.filename else ""
        log.error("step_failed", message=f"cannot write{where}: {exc.strerror or exc}; {_kept(job)}")
        return ExitCode.FAILED
    except Exception as exc:
        if type(exc).__name__ == "SafetensorError":  # safetensors' own I/O error: disk full, file too large
            log.error("step_failed", message=f"cannot write a tensor file: {exc}; {_kept(job)}")
            return ExitCode.FAILED
        if type(exc).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(exc):
            log.error(
                "step_failed",
                message="out of memory on the device; the last checkpoint is intact; lower train.micro_batch_size",
            )
            return ExitCode.FAILED
        log.error("step_crashed", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return ExitCode.FAILED


def serve(control_fd: int, log: Any) -> int:
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
            code = run_job(json.loads(Path(os.fsdecode(message)).read_text(encoding="utf-8")), log)
        finally:
            for fd in fds:
                os.close(fd)  # the step's lock: held while its step ran
        log.info(JOB_EXIT, status=int(code))
        if code != ExitCode.OK:
            return int(code)


def main(argv: list[str] | None = None) -> int:
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
    log = configure_logging(stream)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: every event says whose it is
        log = log.bind(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        if args.serve is not None:
            return serve(args.serve, log)
        return run_job(json.loads(Path(args.job).read_text(encoding="utf-8")), log)
    finally:
        stream.flush()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Outputs are sealed and fsynced by now; skip the interpreter's teardown, which costs about a
    # second once torch is loaded.
    os._exit(code)
