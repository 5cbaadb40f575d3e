"""`bt verify`: re-execute a plan from scratch, in isolation, and compare bit for bit.

Like `nix build --check`, and then some: each step runs again in a scratch store, in a fresh
process, from its re-executed inputs, and its output is compared with the recorded one by canonical
digests (tensors by name, dtype, shape and bytes). A train step is compared update by update while
it runs, so a difference is reported with the first update where it appeared, the tensors it
touched and how far they moved, and the re-execution stops there.

It fails closed: a step counts as reproduced only when every comparison it stands for was made
(every update of a train step against the recorded trace, every declared digest of its output). A
missing report, an update left uncompared or an output without digests is "not compared", which
fails like a difference (exit 4); a recorded output that is damaged or belongs to another step
fails as a damaged store (exit 5).
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
# `steps.train.state.TRAIN_STATE`, named here so that the bt process does not import torch for it.
TRAIN_STATE = "train_state.json"


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
    status: str  # reproduced, diverged, not compared, damaged, skipped
    recorded: dict[str, str] = attrs.Factory(dict)
    reexecuted: dict[str, str] = attrs.Factory(dict)
    detail: str = ""
    divergence: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # the scratch store is on another file system than the store
        shutil.copy2(source, target)


def _link_output(source: Path, target: Path) -> None:
    """Bring a recorded output into the scratch store (hard links where possible: instant, and
    only read)."""
    shutil.copytree(source, target, copy_function=_link_or_copy)


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


def _read_report(report: Path) -> dict[str, Any] | None:
    try:
        body = json.loads(report.read_bytes())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _run_train(
    scratch: Store,
    plan: Plan,
    step: Step,
    threads: int,
    recorded_output: Path,
    options: VerifyOptions,
    report: Path,
    limit: int | None,
) -> tuple[dict[str, Any] | None, list[int]]:
    """Re-execute a train step under the watcher, killing and resuming it at the requested steps;
    `limit` is the spot check's number of updates (None: all of them)."""
    watch = {"recorded": str(recorded_output), "report": str(report), "stop_after": limit}
    hooks: dict[str, Any] = {"stop_after": limit} if limit else {}
    pending = [n for n in options.resume_at if limit is None or n < limit]
    resumed: list[int] = []
    while True:
        job = StepJob(hooks={**hooks, "kill_after": pending}, watch=watch, commit=limit is None)
        outcome = _spawn_in(scratch, plan, step, threads, job, options.launch)
        diverged = (_read_report(report) or {}).get("diverged")
        if outcome.status == RESUMED_KILL_STATUS and pending:  # killed on purpose after a checkpoint
            if diverged:
                break  # the divergence before the kill stands; resuming would only blur it
            resumed.append(pending.pop(0))
            continue
        raise_for_status(step, outcome, plan)
        break
    return _read_report(report), resumed


def _train_steps(step: Step) -> int:
    return int(step.config["train"]["steps"])


def _foreign(step: Step, recorded_output: Path) -> str | None:
    """Why a recorded train output is not this step's own, if it is not: its checkpoints carry
    the hash of the step that wrote them, and its result the number of updates."""
    try:
        result = json.loads((recorded_output / "result.json").read_bytes())
        if result.get("steps") != _train_steps(step):
            return f"it records {result.get('steps')} updates, the step has {_train_steps(step)}"
        for name in result["checkpoints"]:
            state = json.loads((recorded_output / "checkpoints" / name / TRAIN_STATE).read_bytes())
            if state.get("step_hash") != step.hash:
                found = str(state.get("step_hash"))[:12]
                return f"checkpoints/{name} was written by step {found}, not {step.hash[:12]}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its result or checkpoints cannot be read ({exc})"
    return None


def _verdict_line(verdict: StepVerdict) -> str:
    mark = {"reproduced": "✓", "diverged": "✗", "damaged": "✗", "not compared": "✗"}.get(verdict.status, "-")
    shown = ""
    for name in ("weights", "data", "eval", "package", "tokenizer"):
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
    elif divergence.get("compared_at") is None:
        lines.append("(no recorded checkpoint within the steps run to measure the differences at)")
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
        run_plan(
            store,
            plan,
            RunOptions(threads=threads, experiments=options.experiments, progress=False, launch=launch),
        )

    scratch_root = Path(tempfile.mkdtemp(prefix="bt-verify-"))
    scratch = Store(scratch_root / "store")
    scratch.save_plan(plan, **store.plan_meta(plan.hash))
    mode = [f"threads {threads}"]
    if launch.world_size > 1:
        mode.insert(0, f"train steps on {launch.world_size} processes")
    if options.resume_at:
        mode.append(f"hard kill and resume at {','.join(map(str, options.resume_at))}")
    if options.steps:
        longest = max((_train_steps(step) for step in plan.steps if step.kind == "train"), default=0)
        if options.steps >= longest:
            mode.append(
                f"--steps {options.steps} covers every update of every train stage ({longest} at most)"
            )
        else:
            mode.append(f"first {options.steps} steps of each train stage")
    _say(
        f"bt verify {plan.hash[:12]} '{plan.name}': re-executing {len(plan.steps)} steps in isolation ({'; '.join(mode)})"
    )

    verdicts: list[StepVerdict] = []
    failed: set[str] = set()
    try:
        for step in plan.steps:
            verdict = _verify_step(store, scratch, plan, step, threads, options, failed)
            if verdict.status != "reproduced" and not (verdict.status == "skipped" and options.steps):
                failed.add(step.hash)
            verdicts.append(verdict)
            _say(_verdict_line(verdict))
    finally:
        if options.keep:
            _say(f"scratch store kept at {scratch.root}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)

    diverged = [v for v in verdicts if v.status == "diverged"]
    damaged = [v for v in verdicts if v.status == "damaged"]
    uncompared = [v for v in verdicts if v.status == "not compared"]
    checked = [v for v in verdicts if v.status == "reproduced"]
    if damaged:
        _say(
            f"DAMAGED STORE: the recorded output of {', '.join(v.label for v in damaged)} is damaged or not "
            "its step's; run bt fsck, then bt run to rebuild it"
        )
    if diverged:
        _say(f"NOT REPRODUCED: {', '.join(v.label for v in diverged)} differ from the recorded build")
    if uncompared:
        _say(f"NOT VERIFIED: {', '.join(v.label for v in uncompared)} could not be compared (see above)")
    if not (damaged or diverged or uncompared):
        _say(f"reproduced: {len(checked)} of {len(verdicts)} steps match the recorded build bit for bit")
    reproduced = not (damaged or diverged or uncompared)
    if options.json:
        print(
            json.dumps(
                {
                    "plan": plan.hash,
                    "reproduced": reproduced,
                    "threads": threads,
                    "world_size": launch.world_size,
                    "resume_at": list(options.resume_at),
                    "steps_limit": options.steps,
                    "steps": [v.as_json() for v in verdicts],
                },
                indent=2,
            )
        )
    if damaged:
        return ExitCode.CORRUPT
    return ExitCode.OK if reproduced else ExitCode.NOT_REPRODUCED


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
    if not problems and step.kind == "train":
        foreign = _foreign(step, recorded_output)
        problems = [f"it is not this step's output: {foreign}"] if foreign else []
    if problems:
        return StepVerdict(
            step.label, step.kind, "damaged", detail=f"the recorded output is damaged: {problems[0]}"
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

    extra = ""
    if step.kind == "train":
        total = _train_steps(step)
        # A spot check as long as the stage is the full check of the stage (and says so).
        limit = options.steps if options.steps and options.steps < total else None
        if options.steps and limit is None:
            extra = f"(--steps {options.steps} clamped to the stage's {total})"
        report_path = scratch.root / f"watch-{step.hash[:16]}.json"
        report, resumed = _run_train(
            scratch, plan, step, threads, recorded_output, options, report_path, limit
        )
        if resumed:
            extra = f"{extra} (killed and resumed at {','.join(map(str, resumed))})".strip()
        if report is not None and report.get("diverged"):
            return StepVerdict(
                step.label, step.kind, "diverged", recorded, detail=_describe(report), divergence=report
            )
        wanted = list(range(1, (limit or total) + 1))
        compared = report.get("compared") if report is not None else None
        if compared != wanted:
            missing = sorted(set(wanted) - set(compared or []))
            why = (
                "no comparison report" if report is None else f"updates {_ranges(missing)} were not compared"
            )
            return StepVerdict(
                step.label, step.kind, "not compared", recorded, detail=f"{why}; nothing is claimed for them"
            )
        if limit is not None:
            return StepVerdict(
                step.label,
                step.kind,
                "reproduced",
                recorded,
                {},
                detail=f"first {limit} steps match the recorded trace {extra}".strip(),
            )
        extra = f"all {total} steps match the recorded trace {extra}".strip()
    else:
        raise_for_status(step, _spawn_in(scratch, plan, step, threads, StepJob()), plan)

    if not scratch.has_output(step.hash):
        return StepVerdict(
            step.label, step.kind, "not compared", recorded, detail="the re-execution published no output"
        )
    reexecuted = objects.sealed_digests(scratch.output(step.hash))
    if not recorded or not reexecuted:
        return StepVerdict(
            step.label,
            step.kind,
            "not compared",
            recorded,
            reexecuted,
            detail="an output declares no digests to compare",
        )
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


def _ranges(numbers: list[int]) -> str:
    """`1-3,7` for [1, 2, 3, 7]."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"
