"""Evaluation beside training: each kept checkpoint a plan evaluates (`eval.checkpoints_every`)
is scored as soon as its train step seals it, in a process of its own, while training goes on.

A thread of `bt run` looks into the train step's checkpoint folder (as the remote's pusher does,
`remote.py`): a checkpoint folder exists under its `step-NNNNNN` name only once its manifest is
written and it is renamed into place, so what the thread sees is sealed. Each wanted checkpoint
becomes one job (one work unit), sent to one evaluation worker (`worker.py`, started under the
plan's numerics on one thread: the second core), which runs its jobs one after another. Each
result is recorded in the evaluation cache as it is computed, under its own key (checkpoint
digest, suite, version, subset, ...; `steps/eval_cache.py`): a worker killed midway loses at most
the result it was computing, and whatever is missing is scored by the eval step (or by the next
`bt run`). The train step never waits for evaluation and never reads what it writes, so its bits
are the same with or without it.

Only where the train step's process writes into this run's store (the local engine, or a cluster
sharing its folder); a step built in a node's store of its own is evaluated by its eval step.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buildtrain.executor import numerics
from buildtrain.executor.engine import Submission, job_of
from buildtrain.executor.job import JobOptions
from buildtrain.executor.launch import PARENT_PID
from buildtrain.executor.processes import JOB_EXIT, Worker, start
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import layout
from buildtrain.store.store import Store

# How often the train step's checkpoint folder is looked at for a newly sealed checkpoint.
POLL_S = 0.5
# Test only: the evaluation worker SIGKILLs itself once it has recorded this many results.
KILL_EVAL_AFTER = "BT_TEST_KILL_EVAL_AFTER"

OnEvent = Callable[[dict[str, Any]], None]
Say = Callable[[str, str], None]  # (step label, what happened), as Reporter.step


def planned(plan: Plan, train: Step) -> list[tuple[Step, list[int]]]:
    """The plan's steps that evaluate `train`'s kept checkpoints, each with the updates it wants."""
    kept = kind_of(train.kind).kept_updates(train.config)
    found = []
    for step in plan.steps:
        kind = kind_of(step.kind)
        if kind.checkpoints_of is not None and step.upstream.get(kind.checkpoints_of) == train.hash:
            updates = kind.checkpoints_evaluated(step.config, kept)
            if updates:
                found.append((step, updates))
    return found


class Beside:
    """The evaluation beside one train step's build (see the module's docstring)."""

    def __init__(self, store: Store, plan: Plan, train: Step, on_event: OnEvent, say: Say) -> None:
        self.store, self.plan, self.train = store, plan, train
        self.wanted = planned(plan, train)
        self.on_event, self.say = on_event, say
        self._sent: set[tuple[str, int]] = set()  # (evaluating step, update): one job each
        self._jobs: list[Path] = []
        self._worker: Worker | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="bt-beside", daemon=True)

    def start(self) -> Beside:
        """Start the worker now, so that its `import torch` overlaps the train step's, and the
        watcher."""
        if self.wanted:
            self._start()
            self._watcher.start()
        return self

    def finish(self, *, trained: bool) -> None:
        """Training ended: `trained`, hand over the checkpoints sealed since the last look (the
        output holds them once it is published) and let the worker finish its jobs; else (a
        failure, Ctrl-C) stop the worker now: what it did not record, a later run scores."""
        if not self.wanted:
            return
        self._stop.set()
        self._watcher.join()
        if trained:
            self._dispatch(self.store.checkpoints_dir(self.train.hash))
            self._dispatch(self.store.output(self.train.hash) / layout.CHECKPOINTS)
        worker = self._worker
        if worker is not None:
            with contextlib.suppress(OSError):
                worker.control.shutdown(socket.SHUT_WR)  # no more jobs: it ends after the last
            if not trained and worker.process.poll() is None:
                worker.process.terminate()
            worker.process.wait()
            assert self._reader is not None
            self._reader.join()
            worker.control.close()
        for job in self._jobs:
            job.unlink(missing_ok=True)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._dispatch(self.store.checkpoints_dir(self.train.hash))

    def _dispatch(self, folder: Path) -> None:
        """A job for each sealed checkpoint in `folder` that a step wants and has not been sent."""
        try:
            sealed = dict(layout.newest_first(folder.iterdir()))
        except OSError:  # not there yet, or removed as the output was published
            return
        for step, updates in self.wanted:
            for update in updates:
                path = sealed.get(update)
                if (step.hash, update) in self._sent or path is None or path.is_symlink():
                    continue
                self._sent.add((step.hash, update))
                self._send(step, path)

    def _send(self, step: Step, checkpoint: Path) -> None:
        """Hand one checkpoint to the worker (started on the first); a worker that died is not
        replaced: the eval step scores what it left."""
        worker = self._worker
        if worker is None or worker.process.poll() is not None:
            return
        options = JobOptions(checkpoint=str(checkpoint), hooks=_test_hooks())
        job = job_of(
            Submission(store=self.store, plan=self.plan, step=step, threads=1, lock_fd=-1, options=options),
            self.on_event,
        )
        path = self.store.tmp / f"job-beside-{step.hash[:16]}-{checkpoint.name}-{os.getpid()}.json"
        job.write(path)
        self._jobs.append(path)
        with contextlib.suppress(OSError):  # it died meanwhile: its reader says so
            socket.send_fds(worker.control, [os.fsencode(path)], [])

    def _start(self) -> Worker:
        settings = self.plan.numerics
        env = {**os.environ, **numerics.environment(settings.profile, settings.device, 1)}
        env[PARENT_PID] = str(os.getpid())  # it dies with this run
        self.store.tmp.mkdir(parents=True, exist_ok=True)
        self._worker = start(env)
        self._reader = threading.Thread(
            target=self._read, args=(self._worker,), name="bt-beside-events", daemon=True
        )
        self._reader.start()
        self.on_event(
            {"event": "eval_beside_started", "step": self.train.label, "pid": self._worker.process.pid}
        )
        return self._worker

    def _read(self, worker: Worker) -> None:
        """Forward the worker's events to the run record until it ends; say how it ended when
        not by finishing its jobs."""
        failed = None
        for raw in worker.events:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("event") == JOB_EXIT and line.get("status") != 0:
                failed = f"exit {line.get('status')}"
            self.on_event({**line, "beside": True})
        worker.events.close()
        status = worker.process.wait()
        if failed is None and status != 0:
            failed = f"killed by signal {-status}" if status < 0 else f"exit {status}"
        if failed is not None:
            self.on_event(
                {
                    "event": "eval_beside_failed",
                    "level": "warning",
                    "step": self.train.label,
                    "problem": failed,
                }
            )
            self.say(
                self.train.label,
                f"evaluation beside training stopped ({failed}); the eval step scores what it left",
            )


def _test_hooks() -> dict[str, Any]:
    value = os.environ.get(KILL_EVAL_AFTER)
    return {"kill_eval_after": int(value)} if value else {}
