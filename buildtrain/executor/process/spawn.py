"""Starting a step's process: one worker, a shared worker (see `processes.py`), or torchrun and its
ranks; forwarding their JSON events and the run's signals; collecting how they ended.

Only the local engine calls `spawn` (`executor/engines/local.py`), with a `StepStart` it works out
from the run's submission: this room never reads a submission, so the arrows between the rooms
run one way, from the engines down to the process model."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import attrs

from buildtrain.errors import ExitCode
from buildtrain.executor.process.job import Job
from buildtrain.executor.process.launch import (
    PARENT_PID,
    SINGLE_PROCESS,
    Launch,
    RankFailure,
    die_with_parent,
    python,
    root_cause,
)
from buildtrain.executor.process.outcome import Outcome
from buildtrain.executor.process.processes import JOB_EXIT, StepProcesses, Worker

# Lines of torchrun's own log kept in the run record when a distributed step fails.
LAUNCHER_LOG_LINES = 40


@attrs.frozen(kw_only=True)
class StepStart:
    """What starting one step's process takes, each part worked out by the engine from the run's
    submission (`engines/local.py`, `start_of`)."""

    job: Job  # what the worker is asked (`engines/engine.py`, `job_of`)
    job_dir: Path  # where the job file is written for the worker to read (the store's tmp/)
    environment: Mapping[str, str]  # the numerics environment, set before torch loads
    lock_fd: int  # the run's lock on the step: the process (or torchrun) inherits it
    launch: Launch = SINGLE_PROCESS  # more than one process: torchrun starts the step's ranks

    @property
    def distributed(self) -> bool:
        return self.launch.world_size > 1


def spawn(
    start: StepStart, on_event: Callable[[dict[str, Any]], None], processes: StepProcesses | None = None
) -> Outcome:
    """Run one step in a worker process (one of `processes`, shared with other steps, when given),
    or a step that runs on ranks on `start.launch.world_size` of them."""
    launch, lock_fd, distributed = start.launch, start.lock_fd, start.distributed
    job_path = _write_job(start.job, start.job_dir)
    launcher_log = job_path.with_name(f"torchrun-{job_path.stem}.log")
    env = {**os.environ, **start.environment}
    if not distributed:  # a worker started by this process (torchrun's ranks have torchrun above)
        env[PARENT_PID] = str(os.getpid())
    # A watched job (bt verify) runs in verify's entry point, which hands this worker its watcher:
    # the executor never imports verification.
    module = "buildtrain.verify.worker" if start.job.options.watch else "buildtrain.executor.process.worker"
    arguments = ["-m", module, "--job", str(job_path)]
    failure = None
    try:
        if distributed:
            process, events_fd = _start_torchrun(launch, arguments, env, lock_fd, launcher_log)
            running = Running(process, os.fdopen(events_fd, encoding="utf-8", errors="replace"))
        elif processes is not None:
            shared = processes.submit(env, job_path, lock_fd)
            running = Running(shared.process, shared.events, shared)
        else:
            running = _start_worker([*python(), *arguments], env, lock_fd)
        status, errors, interrupted = _follow(running, on_event, processes)
        if distributed and status != 0:
            failure = _torchrun_failure(launcher_log, status, on_event, errors, launch)
            status = failure.status if failure is not None else status
    finally:
        job_path.unlink(missing_ok=True)
        launcher_log.unlink(missing_ok=True)
    return Outcome(status, errors, interrupted, failure, launch.world_size if distributed else 1)


@attrs.frozen
class Running:
    """A started step process: the process, the stream of its JSON events, and the shared worker
    it is, if it is one (which reports the end of each step by an event, not by exiting)."""

    process: subprocess.Popen[bytes]
    events: TextIO
    shared: Worker | None = None  # a shared worker, which stays alive after the step


def _write_job(job: Job, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"job-{job.step[:16]}-{os.getpid()}.json"
    job.write(path)
    return path


def _start_worker(worker: list[str], env: dict[str, str], lock_fd: int) -> Running:
    """A worker process of its own, its events arriving on a pipe."""
    events_fd, write_fd = os.pipe()
    process = subprocess.Popen([*worker, "--events-fd", str(write_fd)], env=env, pass_fds=(write_fd, lock_fd))
    os.close(write_fd)
    return Running(process, os.fdopen(events_fd, encoding="utf-8", errors="replace"))


def _follow(
    running: Running, on_event: Callable[[dict[str, Any]], None], processes: StepProcesses | None
) -> tuple[int, list[dict[str, Any]], bool]:
    """Forward the step's events until it ends, and this run's SIGINT/SIGTERM to it as SIGTERM
    (it finishes its update and checkpoints); (exit status, error events, whether signalled)."""
    process = running.process
    interrupted: list[int] = []

    def forward(number: int, _: object) -> None:
        interrupted.append(number)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    previous = {n: signal.signal(n, forward) for n in (signal.SIGINT, signal.SIGTERM)}
    errors: list[dict[str, Any]] = []
    status = None
    try:
        for raw in running.events:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("event") == JOB_EXIT:  # a shared worker finished this step
                status = int(line["status"])
                on_event(line)
                break
            if line.get("level") in ("error", "critical"):
                errors.append(line)
            on_event(line)
        if running.shared is None:
            running.events.close()
            status = process.wait()
        elif status != ExitCode.OK:  # failed, or died (no job_exit): not used again
            assert processes is not None
            processes.discard(running.shared)
            status = process.returncode if status is None else status
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return int(status), errors, bool(interrupted)


def _start_torchrun(
    launch: Launch, arguments: list[str], env: dict[str, str], lock_fd: int, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """torchrun starting Python with `arguments` (`-m MODULE ...`) on each rank; returns it and
    the read end of the ranks' events."""
    if launch.nnodes == 1:
        # One machine: the ranks talk over loopback, whatever the host name resolves to.
        env = {"GLOO_SOCKET_IFNAME": "lo", **env}
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [*launch.command(), *arguments, "--events-fd", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            pass_fds=(lock_fd,),  # torchrun holds the step lock for its ranks
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
    assert process.stdout is not None
    events_fd = os.dup(process.stdout.fileno())
    process.stdout.close()
    return process, events_fd


def _torchrun_failure(
    log: Path, status: int, on_event: Any, errors: list[dict[str, Any]], launch: Launch
) -> RankFailure | None:
    """Which rank brought torchrun down, from its log; the log's tail goes to the run record."""
    text = log.read_text(encoding="utf-8", errors="replace")
    tail = text.splitlines()[-LAUNCHER_LOG_LINES:]
    on_event({"event": "torchrun_failed", "level": "warning", "status": status, "log_tail": "\n".join(tail)})
    failure = root_cause(text)
    if failure is None:  # torchrun itself failed: a rendezvous that timed out, a bad endpoint
        hint = ""
        if launch.nnodes > 1:
            hint = (
                f"; the nodes did not all meet at {launch.rdzv_endpoint} within {launch.rdzv_timeout} s: "
                "check --rdzv-endpoint (node 0's address) and that every node runs the same command"
            )
        last = tail[-1] if tail else "no output"
        errors.append({"message": f"torchrun failed (exit {status}): {last}{hint}"})
    return failure
