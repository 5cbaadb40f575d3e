"""`bt run`: execute a plan's steps in order, each a cache hit or a child process.

The executor itself never imports torch, so a fully cached plan (a null build) returns at once.
A step that must compute runs in `buildtrain.executor.worker`, started with the numerics
environment, holding the step's lock (inherited), and reporting JSON events through a pipe that
the executor writes to the run record and the terminal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.convert import converter
from buildtrain.config.schema import NumericsConfig
from buildtrain.errors import (
    BuildtrainError,
    CorruptObject,
    ExitCode,
    Interrupted,
    StepFailed,
    ToolchainMismatch,
    UsageError,
)
from buildtrain.executor import numerics
from buildtrain.executor.progress import Reporter
from buildtrain.executor.record import RunRecord
from buildtrain.plan.plan import Plan, SourceFile, Step
from buildtrain.plan.toolchain import cpu_facts, differences, fingerprint, portable_target
from buildtrain.store import objects
from buildtrain.store.sources import locate
from buildtrain.store.store import Store


def _perturbation(text: str) -> list[Any]:
    """`STEP:TENSOR:DELTA`, e.g. `7:blocks.0.attention.wq.weight:1e-3`."""
    step, tensor, delta = text.split(":")
    return [int(step), tensor, float(delta)]


# Test-only fault injection, read from the environment of `bt run`/`bt verify` and passed to the
# step process. Never set in normal use; they exist so that the test suite can prove that resume,
# verify and the checkpoint protocol detect what they claim to detect.
TEST_HOOKS = {
    "BT_TEST_STEP_DELAY": ("step_delay", float),
    "BT_TEST_KILL_IN_CHECKPOINT": ("kill_in_checkpoint", int),
    "BT_TEST_SKIP_CURSOR_RESTORE": ("skip_cursor_restore", bool),
    "BT_TEST_PERTURB": ("perturb", _perturbation),
}


@attrs.frozen(kw_only=True)
class RunOptions:
    threads: int | None = None
    experiments: Path = Path("experiments")
    wait: bool = True
    progress: bool | None = None
    log_every: int = 10
    target: str | None = None  # build only this step (by label) and what it needs


@attrs.frozen(kw_only=True)
class StepJob:
    """Extra settings for one step process (used by `bt verify`)."""

    hooks: dict[str, Any] = attrs.Factory(dict)
    watch: dict[str, Any] | None = None
    commit: bool = True


def plan_numerics(plan: Plan) -> NumericsConfig:
    return converter.structure({"threads": 0, **plan.config["numerics"]}, NumericsConfig)


def pinned_threads(plan: Plan) -> int | None:
    """The thread count a native plan's hash pins, if any."""
    for step in plan.steps:
        if "threads" in step.toolchain:
            return int(step.toolchain["threads"])
    return None


def resolve_threads(plan: Plan, requested: int | None) -> int:
    pinned = pinned_threads(plan)
    if pinned is not None:
        if requested and requested != pinned:
            raise UsageError(
                f"plan {plan.hash[:12]} uses the native profile, whose hash pins {pinned} threads; "
                f"drop --threads, or plan with --set numerics.threads={requested}"
            )
        return pinned
    return requested or os.cpu_count() or 1


def check_toolchain(plan: Plan, threads: int) -> None:
    """Refuse a plan compiled for another toolchain, naming each field that differs."""
    settings = plan_numerics(plan)
    lines: list[str] = []
    for step in plan.steps:
        for line in differences(dict(step.toolchain), fingerprint(step.kind, settings, threads)):
            if line not in lines:
                lines.append(line)
    portable_cpu = settings.device == "cpu" and settings.profile == "portable"
    if portable_cpu and portable_target().endswith("avx2") and cpu_facts()["isa"] == "baseline":
        lines.append("cpu: the portable profile computes with AVX2, which this CPU lacks")
    if lines:
        raise ToolchainMismatch(
            f"plan {plan.hash[:12]} was compiled for another toolchain:\n    "
            + "\n    ".join(lines)
            + "\n  plan it again on this machine (bt plan PRESET), then run the new hash"
        )


def test_hooks_from_environment() -> dict[str, Any]:
    hooks: dict[str, Any] = {}
    for variable, (name, kind) in TEST_HOOKS.items():
        value = os.environ.get(variable)
        if value:
            hooks[name] = value not in ("0", "false") if kind is bool else kind(value)  # type: ignore[operator]
    return hooks


def source_paths(store: Store, plan: Plan, step: Step) -> list[str]:
    """Find each source file of a data step by content (it may have moved since planning)."""
    sources = step.inputs.get("sources", [])
    if not sources:
        return []
    hints = store.plan_meta(plan.hash).get("sources", {})
    cache = store.stat_cache()
    found = []
    for source in sources:
        path = locate(cache, SourceFile(source["blake3"], source["size"]), hints.get(source["blake3"], []))
        if path is None:
            where = ", ".join(hints.get(source["blake3"], [])) or "unknown"
            raise StepFailed(
                f"{step.label}: a data file with blake3 {source['blake3'][:16]}… ({source['size']} bytes) is gone "
                f"(it was at {where}); restore it, or plan again from the preset"
            )
        found.append(str(path))
    cache.save()
    return found


def spawn(
    store: Store,
    plan: Plan,
    step: Step,
    threads: int,
    lock_fd: int,
    on_event: Any,
    job_extra: StepJob,
) -> tuple[int, list[dict[str, Any]], bool]:
    """Run one step in a worker process. Returns (exit status, error events, interrupted here)."""
    settings = plan_numerics(plan)
    job = {
        "store": str(store.root),
        "plan": plan.hash,
        "step": step.hash,
        "numerics": {
            "profile": settings.profile,
            "device": settings.device,
            "dtype": settings.dtype,
            "threads": threads,
        },
        "sources": source_paths(store, plan, step) if step.kind == "data" else [],
        "hooks": {**test_hooks_from_environment(), **job_extra.hooks},
        "watch": job_extra.watch,
        "commit": job_extra.commit,
    }
    store.tmp.mkdir(parents=True, exist_ok=True)
    job_path = store.tmp / f"job-{step.hash[:16]}-{os.getpid()}.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = {
        **os.environ,
        **numerics.environment(settings.profile, settings.device, threads),
    }
    read_fd, write_fd = os.pipe()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "buildtrain.executor.worker",
            "--job",
            str(job_path),
            "--events-fd",
            str(write_fd),
        ],
        env=env,
        pass_fds=(write_fd, lock_fd),
    )
    os.close(write_fd)
    interrupted: list[int] = []

    def forward(number: int, _: object) -> None:
        interrupted.append(number)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the step finishes its update and checkpoints

    previous = {n: signal.signal(n, forward) for n in (signal.SIGINT, signal.SIGTERM)}
    errors: list[dict[str, Any]] = []
    try:
        with os.fdopen(read_fd, encoding="utf-8", errors="replace") as events:
            for raw in events:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if line.get("level") in ("error", "critical"):
                    errors.append(line)
                on_event(line)
        status = process.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        job_path.unlink(missing_ok=True)
    return status, errors, bool(interrupted)


def raise_for_status(
    step: Step, status: int, errors: list[dict[str, Any]], interrupted: bool, plan: Plan
) -> None:
    message = errors[-1]["message"] if errors else ""
    if status == ExitCode.OK:
        return
    if status == ExitCode.INTERRUPTED or (interrupted and status < 0):
        raise Interrupted(f"interrupted during {step.label}; resume with: bt run {plan.hash}")
    if status == ExitCode.CORRUPT:
        raise CorruptObject(f"{step.label}: {message}")
    if status < 0:
        raise StepFailed(
            f"{step.label}: the step process died ({signal.Signals(-status).name}); "
            f"bt run {plan.hash[:12]} resumes from the last checkpoint"
        )
    raise StepFailed(f"{step.label} failed: {message or f'exit status {status}'}")


def complete_eval_from_cache(store: Store, step: Step) -> dict[str, str] | None:
    """An evaluation of the same weights and data may already be in the store: no process needed."""
    from buildtrain.steps.eval import cache_key, lookup, publish

    key, _ = cache_key(step, store.output(step.inputs["weights"]), store.output(step.inputs["data"]))
    cached = lookup(store, key)
    if cached is None:
        return None
    out = store.new_temp("eval")
    try:
        digests = publish(store, key, cached, out)
        objects.publish(out, store.output(step.hash), digests)
    finally:
        objects.remove_tree(out)
    return digests


def build_step(
    store: Store,
    plan: Plan,
    step: Step,
    threads: int,
    record: RunRecord,
    reporter: Reporter,
    options: RunOptions,
) -> dict[str, Any]:
    started = time.perf_counter()

    def result(action: str, detail: str = "") -> dict[str, Any]:
        digests = objects.sealed_digests(store.output(step.hash)) if store.has_output(step.hash) else {}
        duration = round(time.perf_counter() - started, 3)
        record.event("step_finished", step=step.label, hash=step.hash, action=action, duration_s=duration)
        reporter.step(
            step.label,
            action if not detail else f"{action} ({detail})",
            f"{duration:.1f}s" if action == "executed" else "",
        )
        return {
            "label": step.label,
            "hash": step.hash,
            "action": action,
            "detail": detail,
            "duration_s": duration,
            "digests": digests,
        }

    if store.has_output(step.hash):
        problems = store.check_output(step.hash)
        if not problems:
            return result("cached")
        moved = store.quarantine(step.hash)
        reporter.step(step.label, f"output damaged ({problems[0]}); moved to {moved} and rebuilding")
        record.event("output_quarantined", step=step.label, problems=problems, moved_to=str(moved))

    def waiting(holder: str) -> None:
        reporter.step(step.label, f"waiting: pid {holder} is building this step")
        record.event("waiting_for_lock", step=step.label, holder=holder)

    with store.lock(step.hash, wait=options.wait, on_wait=waiting) as lock_fd:
        if store.has_output(step.hash) and not store.check_output(step.hash):
            return result("cached", "built by another run")
        if step.kind == "eval" and complete_eval_from_cache(store, step) is not None:
            return result("cached", "same weights evaluated before")
        record.event("step_started", step=step.label, hash=step.hash, threads=threads)
        if step.kind == "train":
            reporter.train_started(step.label)
        else:
            reporter.step(step.label, "running")

        def on_event(line: dict[str, Any]) -> None:
            record.forward(line)
            reporter.event(line)

        try:
            status, errors, interrupted = spawn(store, plan, step, threads, lock_fd, on_event, StepJob())
        finally:
            reporter.train_finished()
        raise_for_status(step, status, errors, interrupted, plan)
    return result("executed")


def steps_for(plan: Plan, target: str | None) -> list[Step]:
    """All steps, or the target step and its transitive inputs, in plan order."""
    if target is None:
        return list(plan.steps)
    try:
        wanted = {plan.by_label(target).hash}
    except KeyError:
        labels = ", ".join(step.label for step in plan.steps)
        raise UsageError(f"plan {plan.hash[:12]} has no step '{target}'; its steps are: {labels}") from None
    for step in reversed(plan.steps):
        if step.hash in wanted:
            wanted.update(step.upstream.values())
    return [step for step in plan.steps if step.hash in wanted]


def run_plan(store: Store, plan: Plan, options: RunOptions) -> int:
    started = time.perf_counter()
    steps = steps_for(plan, options.target)
    threads = resolve_threads(plan, options.threads)
    check_toolchain(plan, threads)
    record = RunRecord.create(options.experiments, plan, store.plan_meta(plan.hash))
    reporter = Reporter(options.progress, options.log_every)
    reporter.say(
        f"bt run {plan.hash[:12]} '{plan.name}' ({len(steps)} steps, {threads} threads) -> {record.folder}"
    )
    record.event("run_started", plan=plan.hash, threads=threads, pid=os.getpid())
    outcome, code = "failed", int(ExitCode.FAILED)
    try:
        for step in steps:
            record.step_result(**build_step(store, plan, step, threads, record, reporter, options))
        outcome, code = "done", int(ExitCode.OK)
    except BuildtrainError as exc:
        outcome = "interrupted" if isinstance(exc, Interrupted) else "failed"
        code = int(exc.exit_code)
        record.event("run_" + outcome, message=str(exc))
        raise
    finally:
        duration = time.perf_counter() - started
        record.close(outcome, code, duration)
        if outcome == "done":
            executed = sum(s["action"] == "executed" for s in record.steps)
            reporter.say(
                f"done in {duration:.1f}s: {executed} executed, {len(record.steps) - executed} cached; "
                f"record: {record.folder}"
            )
    return code
