"""`bt verify`: re-execute a plan from scratch, in isolation, and compare bit for bit.

Like `nix build --check`, and then some: each step runs again in a scratch store, in a fresh
process, from its re-executed inputs, and its output is compared with the recorded one by canonical
digests (tensors by name, dtype, shape and bytes). A train step is compared update by update while
it runs, so a difference is reported with the first update where it appeared, the tensors it
touched and how far they moved, and the re-execution stops there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

from buildtrain.errors import ExitCode, UsageError
from buildtrain.executor.launch import SINGLE_PROCESS, Launch
from buildtrain.executor.run import (
    Outcome,
    RunOptions,
    StepJob,
    check_toolchain,
    check_world_size,
    pinned_threads,
    raise_for_status,
    resolve_threads,
    run_plan,
    spawn,
)
from buildtrain.plan.plan import Plan, Step
from buildtrain.store import objects
from buildtrain.store.store import Store

RESUMED_KILL_STATUS = -9


@attrs.frozen(kw_only=True)
class VerifyOptions:
    resume_at: tuple[int, ...] = ()
    threads: int | None = None
    steps: int | None = None
    json: bool = False
    keep: bool = False
    experiments: Path = Path("experiments")
    launch: Launch = SINGLE_PROCESS  # re-execute the train steps at this world size


@attrs.define
class StepVerdict:
    label: str
    kind: str
    status: str  # reproduced, diverged, skipped
    recorded: dict[str, str] = attrs.Factory(dict)
    reexecuted: dict[str, str] = attrs.Factory(dict)
    detail: str = ""
    divergence: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _link_output(source: Path, target: Path) -> None:
    """Bring a recorded output into the scratch store (hard links: instant and read-only use)."""
    shutil.copytree(source, target, copy_function=os.link)


def _compare(step: Step, recorded: dict[str, str], reexecuted: dict[str, str]) -> list[str]:
    return sorted(
        name for name in set(recorded) | set(reexecuted) if recorded.get(name) != reexecuted.get(name)
    )


def _spawn_in(
    scratch: Store, plan: Plan, step: Step, threads: int, job: StepJob, launch: Launch = SINGLE_PROCESS
) -> Outcome:
    """Run one step process (or a train step's ranks) in the scratch store, holding its lock there."""
    with scratch.lock(step.hash) as lock_fd:
        return spawn(scratch, plan, step, threads, lock_fd, lambda _: None, job, launch)


def _run_train(
    scratch: Store,
    plan: Plan,
    step: Step,
    threads: int,
    recorded_output: Path,
    options: VerifyOptions,
    report: Path,
) -> tuple[dict[str, Any] | None, list[int]]:
    """Re-execute a train step under the watcher, killing and resuming it at the requested steps."""
    watch = {"recorded": str(recorded_output), "report": str(report), "stop_after": options.steps}
    hooks: dict[str, Any] = {"stop_after": options.steps} if options.steps else {}
    pending = [n for n in options.resume_at if options.steps is None or n < options.steps]
    resumed: list[int] = []
    while True:
        job = StepJob(hooks={**hooks, "kill_after": pending}, watch=watch, commit=options.steps is None)
        outcome = _spawn_in(scratch, plan, step, threads, job, options.launch)
        if outcome.status == RESUMED_KILL_STATUS and pending and not report.exists():
            resumed.append(pending.pop(0))  # killed on purpose after a checkpoint: resume now
            continue
        raise_for_status(step, outcome, plan)
        break
    divergence = json.loads(report.read_text()) if report.exists() else None
    return divergence, resumed


def _verdict_line(verdict: StepVerdict) -> str:
    mark = {"reproduced": "✓", "diverged": "✗"}.get(verdict.status, "-")
    shown = ""
    for name in ("weights", "data", "eval", "package"):
        if verdict.status == "reproduced" and len(verdict.reexecuted.get(name, "")) == 64:
            shown = f"{name} {verdict.reexecuted[name][:12]}"
            break
    return f"  {mark} {verdict.label:<16} {verdict.status:<10} {shown}  {verdict.detail}".rstrip()


def _describe(divergence: dict[str, Any]) -> str:
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
    return "\n                    ".join(lines)


def verify_plan(store: Store, plan: Plan, options: VerifyOptions) -> int:
    if options.threads and pinned_threads(plan) not in (None, options.threads):
        raise UsageError(
            f"plan {plan.hash[:12]} uses the native profile: its hash pins {pinned_threads(plan)} threads, so it "
            "promises nothing at another thread count. Use the portable profile to check thread invariance."
        )
    launch = options.launch
    threads = resolve_threads(plan, options.threads, launch.nproc)
    check_toolchain(plan, threads, launch.world_size)
    check_world_size(list(plan.steps), launch.world_size)
    if not all(store.has_output(step.hash) for step in plan.steps):
        _say(
            f"bt verify: plan {plan.hash[:12]} is not built; building it once, then checking it against a second execution"
        )
        run_plan(store, plan, RunOptions(experiments=options.experiments, progress=False, launch=launch))

    scratch_root = Path(tempfile.mkdtemp(prefix="bt-verify-"))
    scratch = Store(scratch_root / "store")
    scratch.save_plan(plan, **store.plan_meta(plan.hash))
    mode = [f"threads {threads}"]
    if launch.world_size > 1:
        mode.insert(0, f"train steps on {launch.world_size} processes")
    if options.resume_at:
        mode.append(f"hard kill and resume at {','.join(map(str, options.resume_at))}")
    if options.steps:
        mode.append(f"first {options.steps} steps of each train stage")
    _say(
        f"bt verify {plan.hash[:12]} '{plan.name}': re-executing {len(plan.steps)} steps in isolation ({'; '.join(mode)})"
    )

    verdicts: list[StepVerdict] = []
    failed: set[str] = set()
    try:
        for step in plan.steps:
            verdict = _verify_step(store, scratch, plan, step, threads, options, failed)
            if verdict.status == "diverged" or (verdict.status == "skipped" and not options.steps):
                failed.add(step.hash)
            verdicts.append(verdict)
            _say(_verdict_line(verdict))
    finally:
        if options.keep:
            _say(f"scratch store kept at {scratch.root}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)

    diverged = [v for v in verdicts if v.status == "diverged"]
    checked = [v for v in verdicts if v.status != "skipped"]
    if diverged:
        _say(f"NOT REPRODUCED: {', '.join(v.label for v in diverged)} differ from the recorded build")
    else:
        _say(f"reproduced: {len(checked)} of {len(verdicts)} steps match the recorded build bit for bit")
    if options.json:
        print(
            json.dumps(
                {
                    "plan": plan.hash,
                    "reproduced": not diverged,
                    "threads": threads,
                    "world_size": launch.world_size,
                    "resume_at": list(options.resume_at),
                    "steps_limit": options.steps,
                    "steps": [v.as_json() for v in verdicts],
                },
                indent=2,
            )
        )
    return ExitCode.NOT_REPRODUCED if diverged else ExitCode.OK


def _verify_step(
    store: Store,
    scratch: Store,
    plan: Plan,
    step: Step,
    threads: int,
    options: VerifyOptions,
    failed: set[str],
) -> StepVerdict:
    recorded_output = store.output(step.hash)
    problems = objects.verify(recorded_output)
    if problems:
        return StepVerdict(
            step.label, step.kind, "diverged", detail=f"the recorded output is damaged: {problems[0]}"
        )
    recorded = objects.sealed_digests(recorded_output)
    if set(step.upstream.values()) & failed:
        return StepVerdict(step.label, step.kind, "skipped", recorded, detail="an input did not reproduce")
    if options.steps:
        if step.kind in ("eval", "export"):
            return StepVerdict(
                step.label, step.kind, "skipped", recorded, detail="spot check (--steps) covers training only"
            )
        for upstream in step.upstream.values():  # spot checks start from the recorded inputs
            if not scratch.has_output(upstream):
                _link_output(store.output(upstream), scratch.output(upstream))

    if step.kind == "train":
        report = scratch.root / f"watch-{step.hash[:16]}.json"
        divergence, resumed = _run_train(scratch, plan, step, threads, recorded_output, options, report)
        extra = f"(killed and resumed at {','.join(map(str, resumed))})" if resumed else ""
        if divergence and divergence.get("diverged"):
            return StepVerdict(
                step.label,
                step.kind,
                "diverged",
                recorded,
                detail=_describe(divergence),
                divergence=divergence,
            )
        if options.steps:
            compared = divergence["steps_compared"] if divergence else options.steps
            return StepVerdict(
                step.label,
                step.kind,
                "reproduced",
                recorded,
                {},
                detail=f"first {compared} steps match the recorded trace {extra}".strip(),
            )
    else:
        raise_for_status(step, _spawn_in(scratch, plan, step, threads, StepJob()), plan)
        extra = ""

    reexecuted = objects.sealed_digests(scratch.output(step.hash))
    differing = _compare(step, recorded, reexecuted)
    if differing:
        return StepVerdict(
            step.label,
            step.kind,
            "diverged",
            recorded,
            reexecuted,
            detail=f"digests differ: {', '.join(differing[:5])}",
        )
    return StepVerdict(step.label, step.kind, "reproduced", recorded, reexecuted, detail=extra)
