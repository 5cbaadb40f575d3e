"""Evaluation beside training: each kept checkpoint a plan evaluates (`eval.checkpoints_every`)
is scored as soon as its train step seals it, in a process of its own, while training goes on.

A thread of `bt run` looks into the train step's checkpoint folder (as the remote's pusher does,
`remote/remote.py`): a checkpoint folder exists under its `step-NNNNNN` name only once its manifest is
written and it is renamed into place, so what the thread sees is sealed. Each wanted checkpoint
becomes one job (one work unit): locally, sent to one evaluation worker (`process/worker.py
--serve`, started under the plan's numerics on one thread, the second core, by
`engines/local_beside.py`), which runs its jobs one after another; on a cluster engine, a task of
its own (a Ray task, a Slurm job) on one core. Each result is recorded in the evaluation cache as it is computed, under its own key (checkpoint
digest, suite, version, subset, ...; `steps/eval/cache.py`): a worker killed midway loses at most
the result it was computing, and whatever is missing is scored by the eval step (or by the next
`bt run`). The train step never waits for evaluation and never reads what it writes, so its bits
are the same with or without it.

Only where the train step's process writes into this run's store (the local engine, or a cluster
sharing its folder, without a remote); a step built in a node's store of its own (a run with a
remote on a cluster) is evaluated by its eval step, after training.

The runner also builds, before any checkpoint's job, the steps after training in plan order that
need neither it nor torch (`beside_training` kinds: the ngrams steps, which evaluation reads):
each under its own lock, taken here (held by the local worker, to which it is handed with the
job, as a step process holds it; on a cluster engine, here until its task ends), so when the run
reaches it it is a cache hit, and one another run is building is left alone. A checkpoint's job
is sent only once its step's other inputs are built (the ngrams steps' filters among them).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buildtrain.errors import BuildtrainError
from buildtrain.executor.engines.engine import Engine, Handle, OnEvent, Submission
from buildtrain.executor.engines.local_beside import LocalWorker, Release, ended
from buildtrain.executor.process.job import JobOptions
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import layout
from buildtrain.store.claims import Fresh
from buildtrain.store.store import Store

# How often the train step's checkpoint folder is looked at for a newly sealed checkpoint.
POLL_S = 0.5
# Test only: the evaluation worker SIGKILLs itself once it has recorded this many results.
KILL_EVAL_AFTER = "BT_TEST_KILL_EVAL_AFTER"

Say = Callable[[str, str], None]  # (step label, what happened), as Reporter.step


def built_beside(store: Store, plan: Plan, train: Step) -> list[Step]:
    """The steps after `train` in plan order that the local engine builds beside it: of a
    `beside_training` kind, not built, with every input built (never `train` itself)."""
    after = plan.steps[plan.steps.index(train) + 1 :]
    return [
        step
        for step in after
        if kind_of(step.kind).beside_training
        and not store.outputs.has(step.hash)
        and all(store.outputs.has(upstream) for upstream in step.upstream.values())
    ]


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

    def __init__(
        self, store: Store, plan: Plan, train: Step, engine: Engine, on_event: OnEvent, say: Say
    ) -> None:
        self.store, self.plan, self.train = store, plan, train
        self.wanted = planned(plan, train)
        # On a cluster engine only those its evaluation needs (the run may not build them: --target).
        wanted = self.wanted or not engine.concurrent
        self.steps = built_beside(store, plan, train) if wanted else []
        self.on_event = lambda line: on_event({**line, "beside": True})
        self.say = say
        self._sent: set[tuple[str, int]] = set()  # (evaluating step, update): one job each
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="bt-beside", daemon=True)

        def failed(problem: str) -> None:
            self.on_event({"event": "eval_beside_failed", "level": "warning", "problem": problem})
            say(
                train.label,
                f"evaluation beside training stopped ({problem}); the eval step scores what it left",
            )

        runner: LocalWorker | EngineTasks = (
            EngineTasks(engine, failed) if engine.concurrent else LocalWorker(store, plan, failed)
        )
        self.runner = runner

    def start(self) -> Beside:
        """Start the runner now (a local worker's `import torch` then overlaps the train
        step's), and the watcher."""
        if self.wanted or self.steps:
            self.runner.start(self.on_event)
        for step in self.steps:
            self._build(step)
        if self.wanted:
            self._watcher.start()
        return self

    def _build(self, step: Step) -> None:
        """Send `step` to the runner holding its lock, unless it is built or being built."""
        held = contextlib.ExitStack()
        claim = held.enter_context(self.store.outputs.claim(step.hash, wait=False))
        if not isinstance(claim, Fresh):
            held.close()
            return  # cached meanwhile, or another run holds it: the run's own turn sees to it
        submission = Submission(
            store=self.store,
            plan=self.plan,
            step=step,
            threads=1,
            lock_fd=claim.lock_fd,
            options=JobOptions(),
        )
        self.runner.send(submission, self.on_event, release=held.close)
        self.say(step.label, "running beside training")

    def _ready(self, step: Step) -> bool:
        """Whether a checkpoint's job of `step` can run: its inputs but the checkpoints are built."""
        checkpoints = kind_of(step.kind).checkpoints_of
        return all(self.store.outputs.has(h) for name, h in step.upstream.items() if name != checkpoints)

    def finish(self, *, trained: bool) -> None:
        """Training ended: `trained`, hand over the checkpoints sealed since the last look (the
        output holds them once it is published) and let the jobs finish; else (a failure,
        Ctrl-C) stop them now: what they did not record, a later run scores."""
        if not self.wanted and not self.steps:
            return
        self._stop.set()
        if self.wanted:
            self._watcher.join()
        if trained:
            self._dispatch(self.store.outputs.checkpoints_dir(self.train.hash))
            self._dispatch(self.store.outputs.path(self.train.hash) / layout.CHECKPOINTS)
        self.runner.close(now=not trained)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._dispatch(self.store.outputs.checkpoints_dir(self.train.hash))

    def _dispatch(self, folder: Path) -> None:
        """A job for each sealed checkpoint in `folder` that a step wants and has not been sent."""
        try:
            sealed = dict(layout.newest_first(folder.iterdir()))
        except OSError:  # not there yet, or removed as the output was published
            return
        for step, updates in self.wanted:
            if not self._ready(step):
                continue  # a step built beside training is not yet: a later look sends them
            for update in updates:
                path = sealed.get(update)
                if (step.hash, update) in self._sent or path is None or path.is_symlink():
                    continue
                self._sent.add((step.hash, update))
                options = JobOptions(checkpoint=str(path), hooks=_test_hooks())
                submission = Submission(
                    store=self.store, plan=self.plan, step=step, threads=1, lock_fd=-1, options=options
                )
                self.runner.send(submission, self.on_event)


class EngineTasks:
    """The jobs of a run on a cluster engine: each a task of its own (a Ray task, a Slurm job),
    placed wherever the engine has a free core; one that fails is said once."""

    def __init__(self, engine: Engine, failed: Callable[[str], None]) -> None:
        self.engine, self.failed = engine, failed
        self._handles: list[Handle] = []
        self._waiters: list[threading.Thread] = []

    def start(self, on_event: OnEvent) -> None:
        on_event({"event": "eval_beside_started", "engine": self.engine.name})

    def send(self, submission: Submission, on_event: OnEvent, release: Release = lambda: None) -> None:
        """Start a task; `release` (a step's lock) once it has ended."""
        try:
            handle = self.engine.start(submission, on_event)
        except BuildtrainError as exc:  # the cluster refused it: the eval step scores it
            release()
            self.failed(str(exc))
            return
        self._handles.append(handle)
        waiter = threading.Thread(
            target=self._wait, args=(handle, release), name="bt-beside-task", daemon=True
        )
        waiter.start()
        self._waiters.append(waiter)

    def close(self, *, now: bool) -> None:
        if now:
            for handle in self._handles:
                handle.cancel()
        for waiter in self._waiters:
            waiter.join()

    def _wait(self, handle: Handle, release: Release) -> None:
        try:
            outcome = handle.wait()
        except Exception as exc:  # a task lost with its node: the eval step scores it
            self.failed(f"{type(exc).__name__}: {exc}")
            return
        finally:
            release()
        failed = ended(outcome.status)
        if failed is not None:
            self.failed(failed)


def _test_hooks() -> dict[str, Any]:
    value = os.environ.get(KILL_EVAL_AFTER)
    return {"kill_eval_after": int(value)} if value else {}
