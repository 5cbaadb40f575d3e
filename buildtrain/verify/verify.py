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

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from buildtrain.errors import UsageError
from buildtrain.executor.outcome import raise_for_status
from buildtrain.executor.policy import pinned_threads, prepare
from buildtrain.executor.run import RunOptions, run_plan
from buildtrain.executor.spawn import StepJob, run_isolated
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.stored import save_plan
from buildtrain.store import objects
from buildtrain.store.store import Store
from buildtrain.verify.train_check import describe, foreign, ranges, run_train, train_steps
from buildtrain.verify.verdicts import StepVerdict, Verification, VerifyOptions


def _compare(recorded: dict[str, str], reexecuted: dict[str, str]) -> list[str]:
    return sorted(
        name for name in set(recorded) | set(reexecuted) if recorded.get(name) != reexecuted.get(name)
    )


def _ignore(_: object) -> None:
    pass


def verify_plan(
    store: Store,
    plan: Plan,
    options: VerifyOptions,
    notify: Callable[[str], None] = _ignore,
    on_verdict: Callable[[StepVerdict], None] = _ignore,
) -> Verification:
    """Re-execute `plan` in a scratch store and compare; `notify` hears what is being done,
    `on_verdict` each step's verdict as soon as it is known."""
    if options.threads and pinned_threads(plan) not in (None, options.threads):
        raise UsageError(
            f"plan {plan.hash[:12]} uses the native profile: its hash pins {pinned_threads(plan)} threads, so it "
            "promises nothing at another thread count. Use the portable profile to check thread invariance."
        )
    unreachable = options.resume_problem(plan)
    if unreachable:
        raise UsageError(unreachable)
    launch = options.launch
    threads = prepare(plan, options.threads, launch, list(plan.steps))
    if not all(store.has_output(step.hash) for step in plan.steps):
        notify(
            f"bt verify: plan {plan.hash[:12]} is not built; building it once, then checking it against a second execution"
        )
        run_plan(
            store,
            plan,
            RunOptions(threads=threads, experiments=options.experiments, progress=False, launch=launch),
        )

    scratch_root = Path(tempfile.mkdtemp(prefix="bt-verify-"))
    scratch = Store(scratch_root / "store")
    save_plan(scratch, plan, **store.plan_meta(plan.hash))
    mode = [f"threads {threads}"]
    if launch.world_size > 1:
        mode.insert(0, f"train steps on {launch.world_size} processes")
    if options.resume_at:
        mode.append(f"hard kill and resume at {','.join(map(str, options.resume_at))}")
    if options.steps:
        longest = max((train_steps(step) for step in plan.steps if step.kind == "train"), default=0)
        if options.steps >= longest:
            mode.append(
                f"--steps {options.steps} covers every update of every train stage ({longest} at most)"
            )
        else:
            mode.append(f"first {options.steps} steps of each train stage")
    notify(
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
            on_verdict(verdict)
    finally:
        if options.keep:
            notify(f"scratch store kept at {scratch.root}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)

    return Verification(plan, verdicts, threads, launch.world_size, options)


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
        not_own = foreign(step, recorded_output)
        problems = [f"it is not this step's output: {not_own}"] if not_own else []
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
                objects.link_tree(store.output(upstream), scratch.output(upstream))

    extra = ""
    if step.kind == "train":
        total = train_steps(step)
        # A spot check as long as the stage is the full check of the stage (and says so).
        limit = options.steps if options.steps and options.steps < total else None
        if options.steps and limit is None:
            extra = f"(--steps {options.steps} clamped to the stage's {total})"
        report_path = scratch.root / f"watch-{step.hash[:16]}.json"
        report, resumed = run_train(
            scratch, plan, step, threads, recorded_output, options, report_path, limit
        )
        if resumed:
            extra = f"{extra} (killed and resumed at {','.join(map(str, resumed))})".strip()
        if report is not None and report.get("diverged"):
            return StepVerdict(
                step.label, step.kind, "diverged", recorded, detail=describe(report), divergence=report
            )
        wanted = list(range(1, (limit or total) + 1))
        compared = report.get("compared") if report is not None else None
        if compared != wanted:
            missing = sorted(set(wanted) - set(compared or []))
            why = "no comparison report" if report is None else f"updates {ranges(missing)} were not compared"
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
        raise_for_status(step, run_isolated(scratch, plan, step, threads, StepJob()), plan)

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
    differing = _compare(recorded, reexecuted)
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
