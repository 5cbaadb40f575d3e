"""Step processes that outlive one step, so that a plan pays for `import torch` once.

Starting a step process costs an interpreter and, for a computing step, torch's import (seconds
on a CPU; on a GPU also CUDA's and cuBLAS's start-up, about 10 s). Consecutive steps whose
numerics environment is the same share one worker: the environment is still in place before
torch loads, because a worker only ever serves steps of the environment it was started with.

Each job reaches the worker over a Unix socket together with its step's lock (SCM_RIGHTS); the
worker holds the lock while it builds the step and closes it afterwards, so the process doing the
work holds the lock, as it does with a process per step. A worker whose step did not end in
success is not used again.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import attrs

from buildtrain.executor.process.launch import python

if TYPE_CHECKING:
    import socket

EnvironmentKey = tuple[tuple[str, str], ...]
JOB_EXIT = "job_exit"  # a serving worker's last event for a job, with the job's exit status


@attrs.define
class Worker:
    process: subprocess.Popen[bytes]
    control: socket.socket
    events: TextIO

    def stop(self, *, now: bool = False) -> None:
        """Closing the control socket ends the worker's loop; one that hangs, or any when `now`,
        is killed."""
        self.control.close()
        try:
            if now:
                raise subprocess.TimeoutExpired(self.process.args, 0)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        self.events.close()


class StepProcesses:
    """The live workers of one `bt run`, one per numerics environment."""

    def __init__(self) -> None:
        self.workers: dict[EnvironmentKey, Worker] = {}

    def submit(self, env: dict[str, str], job: Path, lock_fd: int) -> Worker:
        """Hand `job` and its lock to a worker for `env`, started if there is none alive."""
        import socket  # here: a null build submits nothing, and the import cost it ~5 ms

        key = tuple(sorted(env.items()))
        worker = self.workers.get(key)
        if worker is not None and worker.process.poll() is not None:
            self.discard(worker)
            worker = None
        if worker is None:
            worker = self.workers[key] = start(env)
        try:
            socket.send_fds(worker.control, [os.fsencode(job)], [lock_fd])
        except OSError:  # it died between two steps: start another
            self.discard(worker)
            worker = self.workers[key] = start(env)
            socket.send_fds(worker.control, [os.fsencode(job)], [lock_fd])
        return worker

    def discard(self, worker: Worker) -> None:
        """Stop using a worker (its step failed, or it died), and make sure it is gone."""
        self.workers = {k: w for k, w in self.workers.items() if w is not worker}
        worker.stop(now=True)

    def close(self) -> None:
        for worker in list(self.workers.values()):
            worker.stop()
        self.workers = {}


def start(env: dict[str, str]) -> Worker:
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_fd, write_fd = os.pipe()
    command = [*python(), "-m", "buildtrain.executor.process.worker"]
    process = subprocess.Popen(
        [*command, "--serve", str(theirs.fileno()), "--events-fd", str(write_fd)],
        env=env,
        pass_fds=(theirs.fileno(), write_fd),
    )
    theirs.close()
    os.close(write_fd)
    return Worker(process, ours, os.fdopen(read_fd, encoding="utf-8", errors="replace"))
