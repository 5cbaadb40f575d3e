"""Building one step of a run: a cache hit when its output verifies, else the step computed under
its lock, with damaged outputs set aside and damaged inputs rebuilt; or, on a node other than 0, a
step on ranks joined."""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.errors import CorruptObject, StepFailed
from buildtrain.executor.engines.engine import Engine, Submission
from buildtrain.executor.engines.local import LocalEngine
from buildtrain.executor.engines.on_node import NODE_PUSHED
from buildtrain.executor.loop.progress import Reporter
from buildtrain.executor.loop.record import RunRecord
from buildtrain.executor.loop.schedule import LiveSteps
from buildtrain.executor.process.launch import Launch
from buildtrain.executor.process.outcome import StepResult, raise_for_status
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.sources import durable
from buildtrain.store import objects
from buildtrain.store.claims import Cached, Claim, Fresh, LockedBy, Resume
from buildtrain.store.store import Store

if TYPE_CHECKING:
    from buildtrain.executor.loop.beside import Beside
    from buildtrain.executor.remote.remote import RemoteCache


def damaged_inputs(store: Store, plan: Plan, step: Step) -> list[Step]:
    """The upstream steps whose outputs do not verify when fully re-hashed (their stamps, which
    said otherwise, are dropped): what to rebuild when a step process finds an input damaged."""
    damaged = []
    for step_hash in dict.fromkeys(step.upstream.values()):
        if store.outputs.verify(step_hash):
            store.outputs.drop_stamp(step_hash)
            damaged.append(plan.step(step_hash))
    return damaged


@attrs.frozen(kw_only=True)
class Builder:
    """Builds the steps of one plan for one run: where (store, launch, threads), what it tells
    (record, reporter), and whether it waits for a step another run is building."""

    store: Store
    plan: Plan
    threads: int
    record: RunRecord
    reporter: Reporter
    launch: Launch
    wait: bool = True
    engine: Engine = attrs.field(factory=lambda: LocalEngine(processes=None))  # where processes run
    remote: RemoteCache | None = None  # a team cache: pull before building, push what was built
    live: LiveSteps = attrs.Factory(LiveSteps)  # the steps started on the engine (Ctrl-C cancels them)

    def build(self, step: Step) -> StepResult:
        """A cache hit when the step's output verifies; else, under the step's lock, set aside
        whatever occupies its place (damaged, foreign, half-made) and build it. Inputs that a step
        process finds damaged (decay that a stamp could not see) are rebuilt and the step retried."""
        started = time.perf_counter()
        for attempt in (1, 2):
            with self.store.outputs.claim(step.hash, wait=self.wait, on_wait=self._waiting(step)) as claim:
                done = self._settled(step, claim, started)
                if done is not None:
                    return done
                assert isinstance(claim, Fresh | Resume)
                try:
                    with self._turn(step) as build:
                        if not build:  # only a remote hands out a pull instead of a build
                            assert self.remote is not None
                            return self._result(step, started, "pulled", f"from {self.remote.url}")
                        if self.remote is not None:
                            self.remote.share_plan(self.plan, step)
                        node, collected = self._compute(step, claim.lock_fd, started)
                        # Holding the lease: a waiter then pulls it. An engine whose process
                        # built it in a store of its own has pushed it (and this run pulled it).
                        if self.remote is not None and not collected:
                            self.remote.report_push(self.store, self.plan, step, self.record.event)
                    return self._result(step, started, "executed", "" if node == "local" else f"on {node}")
                except CorruptObject:
                    damaged = damaged_inputs(self.store, self.plan, step) if attempt == 1 else []
                    if not damaged:
                        raise
            # Outside this step's lock: rebuild each damaged input under its own, then try again.
            for upstream in damaged:
                self.reporter.step(step.label, f"input {upstream.label} is damaged; rebuilding it")
                self.record.event("input_damaged", step=step.label, input=upstream.label, hash=upstream.hash)
                self.build(upstream)
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _turn(self, step: Step) -> contextlib.AbstractContextManager[bool]:
        """Without a remote: build. With one: pull, or build holding the remote lease."""
        if self.remote is None:
            return contextlib.nullcontext(True)
        return self.remote.turn(self.store, step, wait=self.wait, checkpoints=not self.engine.pushes_outputs)

    def _settled(self, step: Step, claim: Claim, started: float) -> StepResult | None:
        """What the claim leaves nothing to build for: an output in the store (built by another run
        meanwhile, when found holding the lock), or one the kind completes from the store without a
        process; a lock held elsewhere raises. Reports a damaged output the claim set aside."""
        if isinstance(claim, Cached):
            detail = "built by another run" if claim.by_another_run else ""
            return self._result(step, started, "cached", detail, digests=claim.digests)
        if isinstance(claim, LockedBy):
            raise claim.refusal()
        if claim.moved is not None:
            problems, moved = list(claim.problems), claim.moved
            self.reporter.step(step.label, f"output damaged ({problems[0]}); moved to {moved} and rebuilding")
            self.record.event("output_quarantined", step=step.label, problems=problems, moved_to=str(moved))
        kind = kind_of(step.kind)
        if kind.completes_from_store:
            computation = importlib.import_module(kind.computes)
            if computation.complete_from_store(self.store, step) is not None:
                return self._result(step, started, "cached", kind.completes_from_store)
        return None

    def _compute(self, step: Step, lock_fd: int, started: float) -> tuple[str, bool]:
        """Run the step's process (or ranks) on the engine holding its lock; raises for how it
        ended, else returns the node it ran on and whether the output came through the remote.

        The step's metrics summary is written when its process says the output is published
        (`step_done`): while the process runs, this run's signals are forwarded to it, never
        raised here, so a Ctrl-C that lands as the step ends cannot leave an output without one."""
        self.record.event("step_started", step=step.label, hash=step.hash, threads=self.threads)
        if kind_of(step.kind).ranks:
            self.reporter.progress_started(step.label)
        else:
            self.reporter.step(step.label, "running")

        pushed: dict[str, str] = {}  # the build a node pushed (its manifest digest)

        def on_event(line: dict[str, Any]) -> None:
            if line.get("event") == NODE_PUSHED and line.get("hash") == step.hash:
                pushed["manifest"] = str(line.get("manifest"))
            self.record.forward(line)
            self.reporter.event(line)
            if line.get("event") == "step_done" and line.get("label") == step.label:
                self.record.step_built(step.label, step.hash, round(time.perf_counter() - started, 3))

        # An engine whose processes build in stores of their own hands outputs over through the
        # remote; without one (or with one out of reach) they build in this store, which they
        # must then see (a local Ray instance, a shared file system), or are refused.
        via_remote = self.remote is not None and not self.remote.offline and self.engine.pushes_outputs
        submission = Submission(
            store=self.store,
            plan=self.plan,
            step=step,
            threads=self.threads,
            lock_fd=lock_fd,
            launch=self.launch,
            remote=self.remote.url if via_remote else None,
            min_attestations=self.remote.min_attestations if via_remote else 0,
            inputs=self._held(step) if via_remote else {},
        )
        handle = self.engine.start(submission, on_event)
        self.live.add(handle)
        beside = self._beside(step, shares_store=not via_remote)
        outcome = None
        try:
            outcome = handle.wait()
        except BaseException:  # this run is stopping (Ctrl-C): stop the step too
            handle.cancel()
            raise
        finally:
            self.live.discard(handle)
            self.reporter.progress_finished()
            if beside is not None:
                beside.finish(trained=outcome is not None and outcome.status == 0)
        if handle.node != "local":
            self.record.event("step_placed", step=step.label, hash=step.hash, node=handle.node)
        raise_for_status(step, outcome, self.plan)
        if via_remote:
            self._collect(step, handle.node, pushed.get("manifest"))
        return handle.node, via_remote

    def _beside(self, step: Step, *, shares_store: bool) -> Beside | None:
        """Evaluation beside a train step whose kept checkpoints the plan evaluates, where its
        process writes them into this store, and the steps built beside it on the local engine
        (`beside.py`); None for any other step."""
        if not shares_store or not kind_of(step.kind).resumable:
            return None
        from buildtrain.executor.loop.beside import Beside, built_beside, planned

        # A cluster engine runs the ngrams steps at once with training itself: none beside it then.
        alongside = not self.engine.concurrent and built_beside(self.store, self.plan, step)
        if not planned(self.plan, step) and not alongside:
            return None
        return Beside(
            self.store, self.plan, step, self.engine, self.record.forward, self.reporter.step
        ).start()

    def _held(self, step: Step) -> dict[str, str]:
        """The manifest digest of each input in this store: a node takes exactly those builds."""
        held = {}
        for upstream in dict.fromkeys(step.upstream.values()):
            with contextlib.suppress(OSError):  # none here: the node counts signers instead
                found = objects.manifest_self(
                    (self.store.outputs.path(upstream) / objects.MANIFEST).read_bytes()
                )
                if found is not None:
                    held[upstream] = found
        return held

    def _collect(self, step: Step, node: str, pinned: str | None) -> None:
        """Pull the output that the engine's process built on `node` and pushed to the remote:
        the build it names (`pinned`), which needs no signer of the remote's (this run built it)."""
        assert self.remote is not None
        if not self.remote.pull(self.store, step, pinned=pinned):
            raise StepFailed(
                f"{step.label}: built on {node} and pushed, but its output could not be pulled from "
                f"{self.remote.url}; bt run again pulls it"
            )

    def _waiting(self, step: Step) -> Any:
        def waiting(holder: str) -> None:
            self.reporter.step(step.label, f"waiting: pid {holder} is building this step")
            self.record.event("waiting_for_lock", step=step.label, holder=holder)

        return waiting

    def _result(
        self,
        step: Step,
        started: float,
        action: str,
        detail: str = "",
        digests: Mapping[str, str] | None = None,
    ) -> StepResult:
        """The step's result and its report; `digests` read from its output when not given."""
        if digests is None:
            outputs = self.store.outputs
            digests = outputs.digests(step.hash) if outputs.has(step.hash) else {}
        duration = round(time.perf_counter() - started, 3)
        self.record.event(
            "step_finished", step=step.label, hash=step.hash, action=action, duration_s=duration
        )
        self.reporter.step(
            step.label,
            action if not detail else f"{action} ({detail})",
            f"{duration:.1f}s" if action == "executed" else "",
        )
        return StepResult(
            label=step.label,
            hash=step.hash,
            action=action,
            detail=detail,
            duration_s=duration,
            digests=digests,
        )

    def join(self, step: Step) -> StepResult:
        """On a machine other than node 0: compute a step on ranks with node 0, which writes the
        step's output there.

        A marker remembers that the step completed, so a later `bt run` here skips it exactly when
        node 0 finds it in its store, and the nodes keep meeting on the same steps.
        """
        marker = self.store.outputs.work_dir(step.hash) / "joined"
        if marker.exists():
            self.reporter.step(step.label, "cached (joined before)")
            return StepResult(label=step.label, hash=step.hash, action="cached", detail="joined before")
        started = time.perf_counter()
        self.reporter.step(step.label, f"joining node 0 as node {self.launch.node_rank}")
        with self.store.locks.hold(step.hash) as lock_fd:
            submission = Submission(
                store=self.store,
                plan=self.plan,
                step=step,
                threads=self.threads,
                lock_fd=lock_fd,
                launch=self.launch,
            )
            # Ranks on this machine that meet node 0's: the local engine's, whatever node 0 runs.
            outcome = LocalEngine(processes=None).start(submission, self.record.forward).wait()
        raise_for_status(step, outcome, self.plan)
        marker.parent.mkdir(parents=True, exist_ok=True)
        durable.write_bytes_durably(marker, b"")
        duration = round(time.perf_counter() - started, 3)
        self.reporter.step(step.label, "joined", f"{duration:.1f}s")
        return StepResult(label=step.label, hash=step.hash, action="joined", duration_s=duration)
