"""The DAG order of a run, written once for every engine: a step starts when its inputs exist.

On an engine that runs one step at a time (the local one) the steps are built in plan order, in
this thread, exactly as before the seam existed (a local step takes this run's signals). On a
concurrent engine each step waits in a thread of its own for its inputs, then for the engine, so
independent steps run at once; the first failure starts nothing new, lets what runs finish and is
raised; an interruption of this thread (Ctrl-C) cancels the running steps through `cancel`, each
of which checkpoints and ends as interrupted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from buildtrain.executor.process.outcome import StepResult
from buildtrain.plan.plan import Step

if TYPE_CHECKING:
    from buildtrain.executor.engines.engine import Handle


# How long the main thread sleeps at a time while steps run. The kernel may hand a process signal
# (Ctrl-C) to any thread that does not block it, Ray's included, and Python runs the handler only
# when the main thread wakes: asleep on a lock until every step ends, it would run it only then.
SIGNAL_POLL_S = 0.2


class _Skipped(Exception):
    """A step not started because another failed first."""


def build_in_order(
    steps: list[Step],
    build: Callable[[Step], StepResult],
    *,
    concurrent: bool,
    cancel: Callable[[], None],
) -> list[StepResult]:
    """The results of building `steps` (given in plan order: inputs first), in that order."""
    if not concurrent:
        return [build(step) for step in steps]
    hashes = {step.hash for step in steps}
    futures: dict[str, Future[StepResult]] = {}
    failed: list[BaseException] = []

    def one(step: Step) -> StepResult:
        for upstream in dict.fromkeys(step.upstream.values()):
            if upstream in hashes:
                try:
                    futures[upstream].result()
                except BaseException:
                    raise _Skipped() from None
        if failed:
            raise _Skipped()
        try:
            return build(step)
        except BaseException as exc:
            failed.append(exc)
            raise

    # One thread per step: a step's thread mostly waits (for its inputs, then for the engine).
    pool = ThreadPoolExecutor(max_workers=max(1, len(steps)), thread_name_prefix="bt-step")
    try:
        for step in steps:
            futures[step.hash] = pool.submit(one, step)
        while wait(futures.values(), timeout=SIGNAL_POLL_S).not_done:
            pass  # a signal's handler runs here (see SIGNAL_POLL_S)
    except BaseException:
        failed.append(RuntimeError("interrupted"))
        cancel()
        wait(futures.values())
        raise
    finally:
        pool.shutdown(wait=True)
    if failed:
        raise failed[0]
    return [futures[step.hash].result() for step in steps]


class LiveSteps:
    """The started steps of a run (or of every plan of a sweep): what Ctrl-C cancels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[Handle] = []

    def add(self, handle: Handle) -> None:
        with self._lock:
            self._handles.append(handle)

    def discard(self, handle: Handle) -> None:
        with self._lock:
            self._handles = [h for h in self._handles if h is not handle]

    def cancel_all(self) -> None:
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            handle.cancel()
