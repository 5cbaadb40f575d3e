"""How a step process ended, and what that means for the run: the mapping from exit statuses,
signals and error events to the error that `bt` reports."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import attrs

from buildtrain.errors import CorruptObject, ExitCode, Interrupted, StepFailed
from buildtrain.executor.process.launch import RankFailure
from buildtrain.plan.plan import Plan, Step


@attrs.frozen(kw_only=True)
class StepResult:
    """What building one step of a run came to, as the run record and the summary keep it."""

    label: str
    hash: str
    action: str = attrs.field(validator=attrs.validators.in_(("executed", "cached", "pulled", "joined")))
    detail: str = ""  # why it was a cache hit ("built by another run", "from s3://...", ...)
    duration_s: float = 0.0
    digests: Mapping[str, str] = attrs.Factory(dict)  # of its sealed output (none where joined)


@attrs.frozen
class Outcome:
    """How a step's process (or torchrun and its ranks) ended."""

    status: int  # exit status; negative: killed by that signal (for torchrun: the failed rank's)
    errors: list[dict[str, Any]]  # error events, in order
    interrupted: bool  # this bt was asked to stop while the step ran
    failure: RankFailure | None = None  # the rank whose failure stopped the others
    world_size: int = 1


def raise_for_status(step: Step, outcome: Outcome, plan: Plan) -> None:
    status, failure = outcome.status, outcome.failure
    if status == ExitCode.OK:
        if outcome.interrupted:  # it finished before the forwarded signal could stop it
            raise Interrupted(f"stopped after {step.label} completed; resume with: bt run {plan.hash}")
        return
    # Asked to stop: a rank or worker that exits otherwise was cut short by the signal (torchrun
    # itself exits 1 when it is signalled), and the checkpoint it wrote is what resume starts from.
    if status == ExitCode.INTERRUPTED or outcome.interrupted:
        raise Interrupted(f"interrupted during {step.label}; resume with: bt run {plan.hash}")
    # Prefer what the failing rank said; the others only report that a peer went away.
    said = [e for e in outcome.errors if failure is None or e.get("rank", 0) == failure.rank]
    message = (said or outcome.errors or [{}])[-1].get("message", "")
    if status == ExitCode.CORRUPT:
        raise CorruptObject(f"{step.label}: {message}")
    resume = f"bt run {plan.hash[:12]} resumes from the last checkpoint"
    if failure is not None and (status < 0 or not message):
        raise StepFailed(
            f"{step.label}: {failure.describe(outcome.world_size)}; the other ranks were stopped "
            f"and nothing partial was written; {resume}"
        )
    if status < 0:
        raise StepFailed(f"{step.label}: the step process died ({signal.Signals(-status).name}); {resume}")
    where = f" (rank {failure.rank} of {outcome.world_size})" if failure is not None else ""
    raise StepFailed(f"{step.label} failed{where}: {message or f'exit status {status}'}")
