"""What a plan may run on, decided before any step starts: threads per process, ranks for a train
step, and the checks that refuse a plan compiled for another toolchain or world size."""

from __future__ import annotations

import os

import attrs

from buildtrain.config.schema import NumericsConfig
from buildtrain.errors import ToolchainMismatch, UsageError
from buildtrain.executor.process import numerics
from buildtrain.executor.process.launch import Launch
from buildtrain.kinds import kind_of
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.toolchain import cpu_facts, differences, portable_target


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
    settings = plan.numerics
    lines: list[str] = []
    for step in plan.steps:
        current = kind_of(step.kind).toolchain(step.config, settings, world_size, threads)
        for line in differences(dict(step.toolchain), current):
            if line not in lines:
                lines.append(line)
    portable_cpu = numerics.portable_cpu(settings.profile, settings.device)
    if portable_cpu and portable_target().startswith("x86_64-avx2") and cpu_facts()["isa"] == "baseline":
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
    """Every step that runs on ranks must share its work evenly among the processes (exit 2)."""
    problems = []
    for step in steps:
        problem = kind_of(step.kind).world_size_problem(step.config, world_size)
        if problem is not None:
            problems.append(f"{step.label}: {problem}")
    if problems:
        raise UsageError("\n  ".join(problems))


MEMORY_FOR_RANKS = 0.8  # the share of the machine's memory the ranks of one step may count on


def step_launch(settings: NumericsConfig, step: Step, threads: int, launch: Launch) -> Launch:
    """The processes a step runs on: `launch` as given, except that a portable step that can run
    on ranks, given one process, shares its `threads` cores out as single-threaded ranks (see
    `numerics`); `--threads 1` keeps it on one."""
    kind = kind_of(step.kind)
    if not kind.ranks or launch.world_size > 1:
        return launch
    if not numerics.portable_cpu(settings.profile, settings.device) or threads == 1:
        return launch
    budget = kind.rank_budget(step.config)
    if budget is None:
        return launch
    # Only once a step computes: the preset loader is not on the path of a null build.
    from buildtrain.config.preflight import machine_memory

    # Every rank holds the whole model and optimizer: no more ranks than the memory holds.
    fitting = max(1, int(machine_memory() * MEMORY_FOR_RANKS) // budget.rank_memory)
    nproc = numerics.portable_ranks(min(threads, fitting), budget.micro_batches, budget.flop)
    return attrs.evolve(launch, nproc=nproc)


def prepare(plan: Plan, requested: int | None, launch: Launch, steps: list[Step], here: bool = True) -> int:
    """Threads per process for running `steps` of `plan` on `launch`, once the plan is known to fit
    this toolchain and world size (raises otherwise): the checks every run and verify start with.
    `here`: the steps execute on this machine; an engine's nodes check their own toolchain."""
    threads = resolve_threads(plan, requested, launch.nproc)
    if here:
        check_toolchain(plan, threads, launch.world_size)
    check_world_size(steps, launch.world_size)
    return threads
