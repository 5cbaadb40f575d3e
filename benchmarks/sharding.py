"""Sharded training: per-rank memory of the training state and throughput, fsdp against none.

Each round trains six contenders, alternated, on presets/tiny.toml with four micro-batches of 4
sequences per update (so world sizes 1, 2 and 4 all divide them), and (without --quick) again on a
wider model (width 256, 4 layers, about 3.0M parameters: 48 MB of weights, gradients and AdamW
moments), where the state moves the process's memory visibly:

  none, world size N   train.sharding = "none": every rank holds the whole model, its gradient
                       and both AdamW moments (N = 1, 2, 4)
  fsdp, world size N   train.sharding = "fsdp": FSDP2 shards weights, gradients and moments, so
                       a rank holds about 1/N of each (N = 1, 2, 4)

Every contender runs a new plan (a new train.seed, so nothing is cached) with `--target train:main`
and `--nproc N`, and everything reported is read back from its run record (train.log):

  training state   each rank logs one `rank_state` event after its first optimizer update, while
                   the gradients still exist: the bytes of the weights, gradients and AdamW
                   moments it holds, measured off the tensors (a shard's local part under FSDP2).
                   Reported per rank, the largest rank for fsdp (FSDP2 cuts shards between rows,
                   so they are uneven where the rows do not divide by N). The goal (the issue's):
                   the sharded state within 10% of 1/N of the unsharded state. Not in this
                   figure: activations, FSDP2's transient unsharded weights, exchange buffers.
  process RSS      rank 0's peak resident memory (`max_rss_mb` of its train_step events): the
                   whole process, torch itself included, so it moves little on a small model.
  throughput       the median tokens/s of rank 0's updates (train_step events), leaving out the
                   first updates, where the processes are still warming up; fsdp against none at
                   the same world size, as a ratio of the medians over the rounds.

The number of threads per process is bt's choice and is read from the run record. A world size
above the machine's cores oversubscribes it (on 2 cores, world size 4 runs 4 single-thread
processes): those rows show the cost of the exchanges, not a speed-up.

Run: python benchmarks/sharding.py [--quick] [--rounds N]
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    WARM_UPDATES,
    WIDE,
    Workspace,
    alternate,
    fmt_bytes,
    fmt_ratio,
    goal_line,
    make_parser,
    median,
    note,
    print_goals,
    print_header,
    print_table,
    ratio,
    record_events,
    rounds,
    updates_per_second,
    workspace,
)

WORLD_SIZES = (1, 2, 4)
SHARDINGS = ("none", "fsdp")
# 16 sequences in 4 micro-batches: every world size above divides them
BATCH = ("train.batch_size=16", "train.micro_batch_size=4")
GOAL = 1.10  # the goal: a rank's sharded state at most 10% above 1/N of the unsharded state
STATE_FIELDS = ("weights_bytes", "gradient_bytes", "optimizer_bytes")


@dataclasses.dataclass(frozen=True)
class Run:
    """What one contender's run record says."""

    tokens_per_s: float
    state_bytes: int  # weights + gradients + AdamW moments of the rank holding the most
    rss_mb: float  # rank 0's peak RSS, the whole process
    layout: str  # "processes x threads"


def read_run(experiments: Path, world: int) -> Run:
    events = record_events(experiments)
    states = [e for e in events if e["event"] == "rank_state"]
    if len(states) != world:
        raise RuntimeError(f"{len(states)} rank_state events under {experiments}, expected {world}")
    lead_steps = [e for e in events if e["event"] == "train_step" and e.get("rank", 0) == 0]
    (started,) = [e for e in events if e["event"] == "run_started"]
    return Run(
        tokens_per_s=updates_per_second(experiments),
        state_bytes=max(sum(e[field] for field in STATE_FIELDS) for e in states),
        rss_mb=max(e["max_rss_mb"] for e in lead_steps),
        layout=f"{started['nproc']} x {started['threads']}",
    )


def measure_all(
    space: Workspace, n: int, warmup: int, size: str, overrides: list[str], steps: int
) -> dict[str, list[Run]]:
    """Alternate the six contenders on one model size; every run of each (warm-up ones included)."""
    seeds = iter(range(1000, 1_000_000))
    runs: dict[str, list[Run]] = {}

    def contender(sharding: str, world: int) -> tuple[str, Callable[[], float]]:
        name = f"{sharding}, world size {world}"

        def measure() -> float:
            seed = next(seeds)
            sets = [f"train.seed={seed}", f"train.steps={steps}", f"train.sharding='{sharding}'"]
            flags = [part for value in [*sets, *BATCH, *overrides] for part in ("--set", value)]
            experiments = space.path("experiments", f"{size}-{sharding}-{world}-{seed}")
            space.run_bt(
                "run",
                str(TINY),
                *flags,
                "--nproc",
                str(world),
                "--target",
                "train:main",
                "--progress",
                "off",
                "--log-every",
                "1",
                experiments=experiments,
            )
            run = read_run(experiments, world)
            runs.setdefault(name, []).append(run)
            return run.tokens_per_s

        return name, measure

    contenders = [contender(sharding, world) for world in WORLD_SIZES for sharding in SHARDINGS]
    note(f"{size}: {n} alternating rounds of {len(contenders)} runs, {steps} updates each")
    alternate(contenders, n, warmup)
    return {name: measured[-n:] for name, measured in runs.items()}


def report(size: str, runs: dict[str, list[Run]], steps: int) -> list[str]:
    """Print the memory and throughput tables of one model size; its goal lines."""
    memory_rows, speed_rows, goals = [], [], []
    for world in WORLD_SIZES:
        plain, sharded = runs[f"none, world size {world}"], runs[f"fsdp, world size {world}"]
        # bytes measured off tensors are the same in every round: the largest, to be safe
        plain_bytes = max(r.state_bytes for r in plain)
        sharded_bytes = max(r.state_bytes for r in sharded)
        share = ratio(sharded_bytes, plain_bytes)
        against_ideal = share * world
        memory_rows.append(
            [
                world,
                sharded[-1].layout,
                fmt_bytes(plain_bytes),
                fmt_bytes(sharded_bytes),
                f"{share:.3f}",
                f"{1 / world:.3f}",
                f"{against_ideal:.3f}",
                f"{median([r.rss_mb for r in plain]):.0f} MiB",
                f"{median([r.rss_mb for r in sharded]):.0f} MiB",
            ]
        )
        plain_rates, sharded_rates = [r.tokens_per_s for r in plain], [r.tokens_per_s for r in sharded]
        speed = ratio(median(sharded_rates), median(plain_rates))
        speed_rows.append(
            [
                world,
                sharded[-1].layout,
                f"{median(plain_rates):,.0f}",
                f"{min(plain_rates):,.0f}..{max(plain_rates):,.0f}",
                f"{median(sharded_rates):,.0f}",
                f"{min(sharded_rates):,.0f}..{max(sharded_rates):,.0f}",
                fmt_ratio(speed),
            ]
        )
        if world > 1:
            goals.append(
                goal_line(
                    f"{size}, world size {world}: fsdp state per rank within 10% of 1/{world} of none",
                    against_ideal <= GOAL,
                    f"{against_ideal:.3f} x 1/{world}",
                )
            )
        goals.append(f"  info    {size}, world size {world}: fsdp / none throughput {fmt_ratio(speed)}")
    print_table(
        f"{size}: training state per rank (weights + gradients + AdamW moments, measured off each "
        "rank's tensors after its first update)",
        [
            "world size",
            "procs x threads",
            "none / rank",
            "fsdp / rank (max)",
            "fsdp / none",
            "ideal 1/N",
            "fsdp vs 1/N",
            "process RSS, none",
            "process RSS, fsdp",
        ],
        memory_rows,
    )
    print(
        "process RSS: rank 0's peak resident memory, the whole process (includes torch itself), median of the rounds"
    )
    print_table(
        f"{size}: training throughput, rank 0's tokens/s (median of {len(plain)} runs, each the median "
        f"of its updates {WARM_UPDATES + 1}..{steps})",
        [
            "world size",
            "procs x threads",
            "none tokens/s",
            "min..max",
            "fsdp tokens/s",
            "min..max",
            "fsdp / none",
        ],
        speed_rows,
    )
    return goals


def cores_line() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    line = f"{usable} usable cores; world size N runs N train processes (threads per process: the tables)"
    if max(WORLD_SIZES) > usable:
        line += (
            f"; world size {max(WORLD_SIZES)} oversubscribes the machine, so its throughput is not a speed-up"
        )
    return line


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    n = rounds(args, quick=1, full=3)
    warmup = 0 if args.quick else 1  # the memory figures need none; --quick stays within minutes
    sizes = [("tiny", [], 20 if args.quick else 40)]
    if not args.quick:
        sizes.append(("wide", WIDE, 20))

    with workspace("sharding", args) as space:
        print_header("sharded training: fsdp vs none, training state per rank and throughput", args, space)
        print(cores_line())
        goals = []
        for size, overrides, steps in sizes:
            goals += report(size, measure_all(space, n, warmup, size, overrides, steps), steps)
        print_goals(goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
