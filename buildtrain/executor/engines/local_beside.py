"""The local engine's evaluation worker beside training (`loop/beside.py` says what is evaluated
and when): one process on this machine (`process/worker.py --serve`), started under the plan's
numerics on one thread (the second core), that runs the jobs it is sent one after another. Beside a
cluster engine each job is a task of that engine's instead (`beside.py`, `EngineTasks`).

Like `local.py`, it starts processes on this machine for the build loop, from submissions: the
build loop never starts one itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from buildtrain.errors import ExitCode
from buildtrain.executor.engines.engine import OnEvent, Submission, job_of
from buildtrain.executor.process import numerics
from buildtrain.executor.process.launch import PARENT_PID
from buildtrain.executor.process.processes import JOB_EXIT, Worker, start
from buildtrain.plan.plan import Plan
from buildtrain.store.store import Store

Release = Callable[[], None]  # lets go of a step's lock (held by the worker once it has the job)


class LocalWorker:
    """The jobs of a local run: one evaluation worker (`worker.py --serve`) on one thread, which
    runs them one after another; one that died is not replaced (the eval step scores the rest)."""

    def __init__(self, store: Store, plan: Plan, failed: Callable[[str], None]) -> None:
        self.store, self.plan, self.failed = store, plan, failed
        self._jobs: list[Path] = []
        self._worker: Worker | None = None
        self._reader: threading.Thread | None = None
        self._stopped = False

    def start(self, on_event: OnEvent) -> None:
        settings = self.plan.numerics
        env = {**os.environ, **numerics.environment(settings.profile, settings.device, 1)}
        env[PARENT_PID] = str(os.getpid())  # it dies with this run
        self.store.tmp.mkdir(parents=True, exist_ok=True)
        self._worker = start(env)
        self._reader = threading.Thread(
            target=self._read, args=(self._worker, on_event), name="bt-beside-events", daemon=True
        )
        self._reader.start()
        on_event({"event": "eval_beside_started", "pid": self._worker.process.pid})

    def send(self, submission: Submission, on_event: OnEvent, release: Release = lambda: None) -> None:
        """Queue a job; `release` (a step's lock) once its descriptor is in the worker's hands."""
        worker = self._worker
        if worker is None or worker.process.poll() is not None:
            release()
            return
        job = job_of(submission, on_event)
        name = Path(job.options.checkpoint or "").name
        path = self.store.tmp / f"job-beside-{submission.step.hash[:16]}-{name}-{os.getpid()}.json"
        job.write(path)
        self._jobs.append(path)
        locks = [submission.lock_fd] if submission.lock_fd >= 0 else []  # a step's, held while it runs
        with contextlib.suppress(OSError):  # it died meanwhile: its reader says so
            socket.send_fds(worker.control, [os.fsencode(path)], locks)
        release()  # the descriptor in flight, then the worker's, keeps the lock (flock: one description)

    def close(self, *, now: bool) -> None:
        worker = self._worker
        if worker is not None:
            with contextlib.suppress(OSError):
                worker.control.shutdown(socket.SHUT_WR)  # no more jobs: it ends after the last
            if now and worker.process.poll() is None:
                self._stopped = True  # by this run: not a failure to report
                worker.process.terminate()
            worker.process.wait()
            assert self._reader is not None
            self._reader.join()
            worker.control.close()
        for job in self._jobs:
            job.unlink(missing_ok=True)

    def _read(self, worker: Worker, on_event: OnEvent) -> None:
        """Forward the worker's events to the run record until it ends; say how it ended when
        not by finishing its jobs."""
        failed = None
        for raw in worker.events:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("event") == JOB_EXIT:
                failed = failed or ended(int(line.get("status", 1)))
            on_event(line)
        worker.events.close()
        status = worker.process.wait()
        failed = failed or ended(status)
        if failed is not None and not self._stopped:
            self.failed(failed)


def ended(status: int) -> str | None:
    """How a job (or the worker) ended, when that was a failure; an interruption (Ctrl-C) is the
    run's own, which the run reports."""
    if status in (0, ExitCode.INTERRUPTED):
        return None
    return f"killed by signal {-status}" if status < 0 else f"exit {status}"
