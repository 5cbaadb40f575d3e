"""Re-executing a train step under the watcher (`watch.py`), with deliberate kills and resumes, and
reading what the watcher found: where a divergence began, and whether a recorded output is this
step's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from buildtrain.executor.engines.local import run_isolated
from buildtrain.executor.process.job import JobOptions
from buildtrain.executor.process.outcome import raise_for_status
from buildtrain.plan.plan import Plan, Step
from buildtrain.store.store import Store
from buildtrain.verify.verdicts import VerifyOptions

RESUMED_KILL_STATUS = -9


def read_findings(findings: Path) -> dict[str, Any] | None:
    try:
        body = json.loads(findings.read_bytes())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def run_train(
    scratch: Store,
    plan: Plan,
    step: Step,
    threads: int,
    recorded_output: Path,
    options: VerifyOptions,
    findings: Path,
    limit: int | None,
) -> tuple[dict[str, Any] | None, list[int]]:
    """Re-execute a train step under the watcher, killing and resuming it at the requested steps;
    `limit` is the spot check's number of updates (None: all of them)."""
    watch = {"recorded": str(recorded_output), "findings": str(findings), "stop_after": limit}
    hooks: dict[str, Any] = {"stop_after": limit} if limit else {}
    pending = [n for n in options.resume_at if limit is None or n < limit]
    resumed: list[int] = []
    while True:
        job = JobOptions(hooks={**hooks, "kill_after": pending}, watch=watch, commit=limit is None)
        outcome = run_isolated(scratch, plan, step, threads, job, options.launch)
        diverged = (read_findings(findings) or {}).get("diverged")
        if outcome.status == RESUMED_KILL_STATUS and pending:  # killed on purpose after a checkpoint
            if diverged:
                break  # the divergence before the kill stands; resuming would only blur it
            resumed.append(pending.pop(0))
            continue
        raise_for_status(step, outcome, plan)
        break
    return read_findings(findings), resumed


def describe(divergence: dict[str, Any]) -> str:
    lines = [f"diverged at step {divergence['step']} ({', '.join(divergence['fields'])})"]
    if divergence.get("tensors"):
        shown = ", ".join(divergence["tensors"][:5])
        more = len(divergence["tensors"]) - 5
        lines.append(
            f"tensors differing at step {divergence['step']}: {shown}{f' (+{more} more)' if more > 0 else ''}"
        )
    if divergence.get("differences"):
        top = ", ".join(f"{d['tensor']} {d['max_abs_diff']:.3g}" for d in divergence["differences"][:5])
        lines.append(f"max |difference| at checkpoint step {divergence['compared_at']}: {top}")
    elif divergence.get("compared_at") is None:
        lines.append("(no recorded checkpoint within the steps run to measure the differences at)")
    return "\n                    ".join(lines)


def ranges(numbers: list[int]) -> str:
    """`1-3,7` for [1, 2, 3, 7]."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"
