"""`bt run`: execute a plan's steps in order, each a cache hit or a child process.

The executor itself never imports torch, so a fully cached plan (a null build) returns at once.
A step that must compute runs in `buildtrain.executor.worker`, started with the numerics
environment, holding the step's lock, and reporting JSON events through a pipe that the executor
writes to the run record and the terminal. Consecutive steps of one numerics environment share a
worker (see `processes.py`); a train step on several processes runs the same worker on every rank
under torchrun (see `launch.py`), the events arriving on its stdout.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.convert import converter
from buildtrain.config.schema import ModelConfig, NumericsConfig, TrainConfig, world_size_problem
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
from buildtrain.executor.launch import SINGLE_PROCESS, Launch, RankFailure, die_with_parent, root_cause
from buildtrain.executor.processes import JOB_EXIT, StepProcesses
from buildtrain.executor.progress import Reporter
from buildtrain.executor.record import RunRecord
from buildtrain.plan.plan import Plan, SourceFile, Step
from buildtrain.plan.toolchain import (
    cpu_facts,
    differences,
    fingerprint,
    hashed_world_size,
    library_facts,
    portable_target,
)
from buildtrain.store import objects
from buildtrain.store.sources import locate
from buildtrain.store.store import Store


def _perturbation(text: str) -> list[Any]:
    """`STEP:TENSOR:DELTA`, e.g. `7:blocks.0.attention.wq.weight:1e-3`."""
    step, tensor, delta = text.split(":")
    return [int(step), tensor, float(delta)]


def _rank_and_step(text: str) -> list[int]:
    """`RANK:STEP`, e.g. `1:7`."""
    rank, step = text.split(":")
    return [int(rank), int(step)]


# Test-only fault injection, read from the environment of `bt run`/`bt verify` and passed to the
# step process. Never set in normal use; they exist so that the test suite can prove that resume,
# verify and the checkpoint protocol detect what they claim to detect.
TEST_HOOKS = {
    "BT_TEST_STEP_DELAY": ("step_delay", float),
    "BT_TEST_KILL_IN_CHECKPOINT": ("kill_in_checkpoint", int),
    "BT_TEST_SKIP_CURSOR_RESTORE": ("skip_cursor_restore", bool),
    "BT_TEST_PERTURB": ("perturb", _perturbation),
    "BT_TEST_KILL_RANK": ("kill_rank", _rank_and_step),
}


# Lines of torchrun's own log kept in the run record when a distributed step fails.
LAUNCHER_LOG_LINES = 40


@attrs.frozen(kw_only=True)
class RunOptions:
    threads: int | None = None
    experiments: Path = Path("experiments")
    wait: bool = True
    progress: bool | None = None
    log_every: int = 10
    target: str | None = None  # build only this step (by label) and what it needs
    launch: Launch = SINGLE_PROCESS  # processes for the train steps (torchrun when more than one)


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


def resolve_threads(plan: Plan, requested: int | None, processes: int = 1) -> int:
    """Threads per process: what a native plan pins, else --threads, else the cores shared out."""
    pinned = pinned_threads(plan)
    if pinned is not None:
        if requested and requested != pinned:
            raise UsageError(
                f"plan {plan.hash[:12]} uses the native profile, whose hash pins {pinned} threads; "
                f"drop --threads, or plan with --set numerics.threads={requested}"
            )
        return pinned
    return requested or max(1, (os.cpu_count() or 1) // processes)


def check_toolchain(plan: Plan, threads: int, world_size: int = 1) -> None:
    """Refuse a plan compiled for another toolchain, naming each field that differs."""
    settings = plan_numerics(plan)
    lines: list[str] = []
    for step in plan.steps:
        current = fingerprint(
            step.kind, settings, threads, hashed_world_size(step.kind, step.config, world_size)
        ) | library_facts(step.kind, step.config)
        for line in differences(dict(step.toolchain), current):
            if line not in lines:
                lines.append(line)
    portable_cpu = numerics.portable_cpu(settings.profile, settings.device)
    if portable_cpu and portable_target().endswith("avx2") and cpu_facts()["isa"] == "baseline":
        lines.append("cpu: the portable profile computes with AVX2, which this CPU lacks")
    if lines:
        again = "plan it again on this machine (bt plan PRESET), then run the new hash"
        if any(line.startswith("world_size:") for line in lines):
            again = (
                f"train.reduction = 'allreduce' makes the world size part of the hash; plan it again "
                f"(bt plan PRESET --nproc N) for {world_size} processes, or use reduction 'invariant'"
            )
        raise ToolchainMismatch(
            f"plan {plan.hash[:12]} was compiled for another toolchain:\n    "
            + "\n    ".join(lines)
            + f"\n  {again}"
        )


def check_world_size(steps: list[Step], world_size: int) -> None:
    """Every train step must share its micro-batches evenly among the processes (exit 2)."""
    problems = []
    for step in steps:
        if step.kind == "train":
            problem = world_size_problem(converter.structure(step.config["train"], TrainConfig), world_size)
            if problem is not None:
                problems.append(f"{step.label}: train.micro_batch_size: {problem}")
    if problems:
        raise UsageError("\n  ".join(problems))


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
    if not isinstance(hints, dict):  # only hints: damaged ones are ignored, the digests decide
        hints = {}
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


@attrs.frozen
class Outcome:
    """How a step's process (or torchrun and its ranks) ended."""

    status: int  # exit status; negative: killed by that signal (for torchrun: the failed rank's)
    errors: list[dict[str, Any]]  # error events, in order
    interrupted: bool  # this bt was asked to stop while the step ran
    failure: RankFailure | None = None  # the rank whose failure stopped the others
    world_size: int = 1


MEMORY_FOR_RANKS = 0.8  # the share of the machine's memory the ranks of one step may count on


def step_launch(settings: NumericsConfig, step: Step, threads: int, launch: Launch) -> Launch:
    """The processes a step runs on: `launch` as given, except that a portable train step given
    one process shares its `threads` cores out as single-threaded ranks (see `numerics`);
    `--threads 1` keeps it on one."""
    if step.kind != "train" or launch.world_size > 1:
        return launch
    if not numerics.portable_cpu(settings.profile, settings.device) or threads == 1:
        return launch
    train = converter.structure(step.config["train"], TrainConfig)
    if train.reduction != "invariant":
        return launch  # the world size of an allreduce plan is fixed by its hash
    # Only once a train step computes: the preset loader is not on the path of a null build.
    from buildtrain.config.preflight import machine_memory, memory_estimate, parameter_count

    model = converter.structure(step.config["model"], ModelConfig)
    flop = 6 * parameter_count(model) * train.batch_size * train.seq_len * train.steps
    # Every rank holds the whole model and optimizer: no more ranks than the memory holds.
    fitting = max(1, int(machine_memory() * MEMORY_FOR_RANKS) // memory_estimate(model, train))
    nproc = numerics.portable_ranks(min(threads, fitting), train.batch_size // train.micro_batch_size, flop)
    return attrs.evolve(launch, nproc=nproc)


def spawn(
    store: Store,
    plan: Plan,
    step: Step,
    threads: int,
    lock_fd: int,
    on_event: Any,
    job_extra: StepJob,
    launch: Launch = SINGLE_PROCESS,
    processes: StepProcesses | None = None,
) -> Outcome:
    """Run one step in a worker process (one of `processes`, shared with other steps, when given),
    or a train step on `launch.world_size` ranks."""
    settings = plan_numerics(plan)
    launch = step_launch(settings, step, threads, launch)
    job = {
        "store": str(store.root),
        "plan": plan.hash,
        "step": step.hash,
        "kind": step.kind,
        "numerics": {
            "profile": settings.profile,
            "device": settings.device,
            "dtype": settings.dtype,
            "threads": threads,
        },
        "sources": source_paths(store, plan, step) if step.kind in ("tokenizer", "data") else [],
        "hooks": {**test_hooks_from_environment(), **job_extra.hooks},
        "watch": job_extra.watch,
        "commit": job_extra.commit,
    }
    store.tmp.mkdir(parents=True, exist_ok=True)
    name = f"{step.hash[:16]}-{os.getpid()}"
    job_path = store.tmp / f"job-{name}.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = {
        **os.environ,
        **numerics.environment(settings.profile, settings.device, threads),
    }
    worker = [sys.executable, "-m", "buildtrain.executor.worker", "--job", str(job_path)]
    distributed = step.kind == "train" and launch.world_size > 1
    launcher_log = store.tmp / f"torchrun-{name}.log"
    shared = None
    if distributed:
        process, events_fd = _start_torchrun(launch, worker, env, lock_fd, launcher_log)
        events = os.fdopen(events_fd, encoding="utf-8", errors="replace")
    elif processes is not None:
        shared = processes.submit(env, job_path, lock_fd)
        process, events = shared.process, shared.events
    else:
        events_fd, write_fd = os.pipe()
        process = subprocess.Popen(
            [*worker, "--events-fd", str(write_fd)], env=env, pass_fds=(write_fd, lock_fd)
        )
        os.close(write_fd)
        events = os.fdopen(events_fd, encoding="utf-8", errors="replace")
    interrupted: list[int] = []

    def forward(number: int, _: object) -> None:
        interrupted.append(number)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the step finishes its update and checkpoints

    previous = {n: signal.signal(n, forward) for n in (signal.SIGINT, signal.SIGTERM)}
    errors: list[dict[str, Any]] = []
    failure: RankFailure | None = None
    try:
        status = None
        for raw in events:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("event") == JOB_EXIT:  # a shared worker finished this step
                status = int(line["status"])
                on_event(line)
                break
            if line.get("level") in ("error", "critical"):
                errors.append(line)
            on_event(line)
        if shared is None:
            events.close()
            status = process.wait()
        elif status != ExitCode.OK:  # failed, or died (no job_exit): not used again
            assert processes is not None
            processes.discard(shared)
            status = process.returncode if status is None else status
        if distributed and status != 0:
            failure = _torchrun_failure(launcher_log, status, on_event, errors, launch)
            status = failure.status if failure is not None else status
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        job_path.unlink(missing_ok=True)
        launcher_log.unlink(missing_ok=True)
    world_size = launch.world_size if distributed else 1
    return Outcome(status, errors, bool(interrupted), failure, world_size)


def _start_torchrun(
    launch: Launch, worker: list[str], env: dict[str, str], lock_fd: int, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """torchrun starting `worker` on each rank; returns it and the read end of the ranks' events."""
    if launch.nnodes == 1:
        # One machine: the ranks talk over loopback, whatever the host name resolves to.
        env = {"GLOO_SOCKET_IFNAME": "lo", **env}
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [*launch.command(), *worker[1:], "--events-fd", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            pass_fds=(lock_fd,),  # torchrun holds the step lock for its ranks
            preexec_fn=die_with_parent,
        )
    assert process.stdout is not None
    events_fd = os.dup(process.stdout.fileno())
    process.stdout.close()
    return process, events_fd


def _torchrun_failure(
    log: Path, status: int, on_event: Any, errors: list[dict[str, Any]], launch: Launch
) -> RankFailure | None:
    """Which rank brought torchrun down, from its log; the log's tail goes to the run record."""
    text = log.read_text(encoding="utf-8", errors="replace")
    tail = text.splitlines()[-LAUNCHER_LOG_LINES:]
    on_event({"event": "torchrun_failed", "level": "warning", "status": status, "log_tail": "\n".join(tail)})
    failure = root_cause(text)
    if failure is None:  # torchrun itself failed: a rendezvous that timed out, a bad endpoint
        hint = ""
        if launch.nnodes > 1:
            hint = (
                f"; the nodes did not all meet at {launch.rdzv_endpoint} within {launch.rdzv_timeout} s: "
                "check --rdzv-endpoint (node 0's address) and that every node runs the same command"
            )
        last = tail[-1] if tail else "no output"
        errors.append({"message": f"torchrun failed (exit {status}): {last}{hint}"})
    return failure


def raise_for_status(step: Step, outcome: Outcome, plan: Plan) -> None:
    status, failure = outcome.status, outcome.failure
    if status == ExitCode.OK:
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


def complete_eval_from_cache(store: Store, step: Step) -> dict[str, str] | None:
    """An evaluation of the same weights and data may already be in the store: no process needed.
    Called holding the step's lock; a damaged or foreign cache entry is set aside, never used."""
    from buildtrain.steps.eval import cache_key, entry_problem, publish

    try:
        key, _ = cache_key(step, store.output(step.inputs["weights"]), store.output(step.inputs["data"]))
    except (OSError, ValueError, KeyError):
        return None  # an input's manifest does not verify: the step process says which
    cached, problem = entry_problem(store.evals / f"{key}.json", key)
    if problem is not None:
        store.set_aside(store.evals / f"{key}.json")
    if cached is None:
        return None
    out = store.new_temp("eval")
    try:
        digests = publish(store, key, cached, out)
        objects.publish(out, store.output(step.hash), digests)
    finally:
        objects.remove_tree(out)
    return digests


def damaged_inputs(store: Store, plan: Plan, step: Step) -> list[Step]:
    """The upstream steps whose outputs do not verify when fully re-hashed (their stamps, which
    said otherwise, are dropped): what to rebuild when a step process finds an input damaged."""
    damaged = []
    for step_hash in dict.fromkeys(step.upstream.values()):
        if store.verify_output(step_hash):
            store.drop_stamp(step_hash)
            damaged.append(plan.step(step_hash))
    return damaged


def build_step(
    store: Store,
    plan: Plan,
    step: Step,
    threads: int,
    record: RunRecord,
    reporter: Reporter,
    options: RunOptions,
    processes: StepProcesses | None = None,
) -> dict[str, Any]:
    """A cache hit when the step's output verifies; else, under the step's lock, set aside
    whatever occupies its place (damaged, foreign, half-made) and build it. Inputs that a step
    process finds damaged (decay that a stamp could not see) are rebuilt and the step retried."""
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

    # Without the lock: a null build only reads (and works in a read-only store).
    if store.has_output(step.hash) and not store.check_output(step.hash):
        return result("cached")

    def waiting(holder: str) -> None:
        reporter.step(step.label, f"waiting: pid {holder} is building this step")
        record.event("waiting_for_lock", step=step.label, holder=holder)

    for attempt in (1, 2):
        with store.lock(step.hash, wait=options.wait, on_wait=waiting) as lock_fd:
            output = store.output(step.hash)
            if os.path.lexists(output):
                problems = store.check_output(step.hash)
                if not problems:
                    return result("cached", "built by another run")
                moved = store.quarantine(step.hash)
                if moved is not None:
                    reporter.step(
                        step.label, f"output damaged ({problems[0]}); moved to {moved} and rebuilding"
                    )
                    record.event(
                        "output_quarantined", step=step.label, problems=problems, moved_to=str(moved)
                    )
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
                outcome = spawn(
                    store, plan, step, threads, lock_fd, on_event, StepJob(), options.launch, processes
                )
            finally:
                reporter.train_finished()
            try:
                raise_for_status(step, outcome, plan)
                return result("executed")
            except CorruptObject:
                damaged = damaged_inputs(store, plan, step) if attempt == 1 else []
                if not damaged:
                    raise
        # Outside this step's lock: rebuild each damaged input under its own, then try again.
        for upstream in damaged:
            reporter.step(step.label, f"input {upstream.label} is damaged; rebuilding it")
            record.event("input_damaged", step=step.label, input=upstream.label, hash=upstream.hash)
            build_step(store, plan, upstream, threads, record, reporter, options, processes)
    raise AssertionError("unreachable: the second attempt returns or raises")


def join_step(
    store: Store, plan: Plan, step: Step, threads: int, record: RunRecord, reporter: Reporter, launch: Launch
) -> dict[str, Any]:
    """On a machine other than node 0: train with node 0, which writes the step's output there.

    A marker remembers that the step completed, so a later `bt run` here skips it exactly when
    node 0 finds it in its store, and the nodes keep meeting on the same steps.
    """
    marker = store.work_dir(step.hash) / "joined"
    entry = {"label": step.label, "hash": step.hash, "detail": "", "digests": {}, "duration_s": 0.0}
    if marker.exists():
        reporter.step(step.label, "cached (joined before)")
        return {**entry, "action": "cached", "detail": "joined before"}
    started = time.perf_counter()
    reporter.step(step.label, f"joining node 0 as node {launch.node_rank}")

    def on_event(line: dict[str, Any]) -> None:
        record.forward(line)

    with store.lock(step.hash) as lock_fd:
        outcome = spawn(store, plan, step, threads, lock_fd, on_event, StepJob(), launch)
    raise_for_status(step, outcome, plan)
    marker.parent.mkdir(parents=True, exist_ok=True)
    objects.write_bytes_durably(marker, b"")
    duration = round(time.perf_counter() - started, 3)
    reporter.step(step.label, "joined", f"{duration:.1f}s")
    return {**entry, "action": "joined", "duration_s": duration}


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


@contextlib.contextmanager
def signals_interrupt(plan: Plan) -> Iterator[None]:
    """Between step processes (waiting for a lock, reading the store) SIGINT and SIGTERM stop the
    run as an interruption (exit 3, recorded as such, not a bare death by signal); while a step
    process runs, `spawn` forwards them to it instead, so that it checkpoints first."""

    def stop(number: int, _: object) -> None:
        raise Interrupted(
            f"stopped by {signal.Signals(number).name} between steps or while waiting for a step's "
            f"lock; nothing partial was written; resume with: bt run {plan.hash}"
        )

    previous: dict[int, Any] = {}
    try:
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, stop)
    except ValueError:  # not the main thread: the signals are not ours to take
        pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def run_plan(store: Store, plan: Plan, options: RunOptions) -> int:
    started = time.perf_counter()
    launch = options.launch
    steps = steps_for(plan, options.target)
    if launch.follower:  # node 0 evaluates and exports; this node helps train
        steps = [step for step in steps if step.kind in ("tokenizer", "data", "train")]
    threads = resolve_threads(plan, options.threads, launch.nproc)
    check_toolchain(plan, threads, launch.world_size)
    check_world_size(steps, launch.world_size)
    record = RunRecord.create(options.experiments, plan, store.plan_meta(plan.hash))
    reporter = Reporter(options.progress, options.log_every)
    settings = plan_numerics(plan)
    per_process = numerics.intra_op_threads(settings.profile, settings.device, threads)
    if launch.world_size > 1:
        layout = f"{launch.world_size} processes x {per_process} threads"
    elif per_process != threads:
        layout = f"{threads} cores, one thread per process"
    else:
        layout = f"{threads} threads"
    node = f", node {launch.node_rank} of {launch.nnodes}" if launch.nnodes > 1 else ""
    reporter.say(
        f"bt run {plan.hash[:12]} '{plan.name}' ({len(steps)} steps, {layout}{node}) -> {record.folder}"
    )
    record.event("run_started", plan=plan.hash, threads=threads, pid=os.getpid(), **attrs.asdict(launch))
    cores = os.cpu_count() or 1
    if launch.nproc * per_process > cores and any(step.kind == "train" for step in steps):
        fix = (
            "this native plan pins its thread count: plan it with fewer numerics.threads"
            if pinned_threads(plan) is not None
            else f"--threads {max(1, cores // launch.nproc)} fits"
        )
        reporter.say(
            f"note: {launch.nproc} processes x {threads} threads exceed this machine's {cores} cores, "
            f"which slows training; {fix}"
        )
    outcome, code = "failed", int(ExitCode.FAILED)
    processes = StepProcesses()  # steps of one numerics environment share a process
    try:
        with signals_interrupt(plan):
            for step in steps:
                if launch.follower and step.kind == "train":
                    record.step_result(**join_step(store, plan, step, threads, record, reporter, launch))
                    continue
                record.step_result(
                    **build_step(store, plan, step, threads, record, reporter, options, processes)
                )
        outcome, code = "done", int(ExitCode.OK)
    except KeyboardInterrupt:  # SIGINT where no handler of ours was installed (another thread)
        outcome, code = "interrupted", int(ExitCode.INTERRUPTED)
        record.event("run_interrupted", message="interrupted")
        raise
    except BuildtrainError as exc:
        outcome = "interrupted" if isinstance(exc, Interrupted) else "failed"
        code = int(exc.exit_code)
        record.event("run_" + outcome, message=str(exc))
        raise
    finally:
        processes.close()
        duration = time.perf_counter() - started
        record.close(outcome, code, duration)
        if outcome == "done":
            counts = collections.Counter(s["action"] for s in record.steps)
            done = ", ".join(
                f"{counts[action]} {action}"
                for action in ("executed", "joined", "cached")
                if counts[action] or action != "joined"
            )
            reporter.say(f"done in {duration:.1f}s: {done}; record: {record.folder}")
    return code
