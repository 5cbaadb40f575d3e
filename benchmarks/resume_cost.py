"""Resume cost: time from `bt run` start to the first trained update after an interruption, against
a fresh start.

Each round, on presets/tiny.toml (whose data step is built once and then cached, so neither
contender pays for it):

  fresh     `bt run` of a plan not built before (a new train.seed, so a new train step): time from
            starting the process to the first `train_step` event on its stderr (update 1).
  resumed   a plan (another new seed) is started with BT_TEST_STEP_DELAY set so that updates are
            slow, stopped with SIGTERM once it has done 20 updates (--quick: 10; buildtrain
            finishes the update, checkpoints and exits with code 3), then `bt run` again: time
            from starting that process to its first `train_step` event (the update after the
            checkpoint).

The interrupted run is preparation and is not timed. Both timed runs are stopped with SIGTERM right
after their first update. The `--progress off --log-every 1` output is read line by line, so the
moment is taken when the executor relays the event. A breakdown per phase comes from the
timestamps in each timed run's train.log, measured from the process start: executor start-up
(to run_started), cached steps (to the train step's step_started), worker start-up and
`import torch` (to numerics_applied), checkpoint loading (to resumed, when resuming) and the
first update (to train_step, as written by the worker).

Run: python benchmarks/resume_cost.py [--quick]
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    Workspace,
    alternate,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
    make_parser,
    median,
    note,
    print_header,
    print_table,
    ratio,
    rounds,
    workspace,
)

STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")
DELAY_S = "0.05"
PHASES = ("run_started", "step_started", "numerics_applied", "resumed", "train_step")


def watch(
    space: Workspace, plan: str, experiments: Path, until_step: int | None, env: dict[str, str] | None = None
) -> tuple[float, int, float]:
    """Start `bt run PLAN`, wait for a train_step line (the first one, or one at `until_step` or
    later), SIGTERM it and wait for it to exit. Returns (seconds from start to that line, exit
    status, wall-clock time of the start)."""
    argv = space.bt("run", plan, "--progress", "off", "--log-every", "1")
    wall_start = time.time()
    started = time.perf_counter()
    process = subprocess.Popen(
        argv,
        env=space.env(experiments=experiments, **(env or {})),
        cwd=space.root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: float | None = None
    tail: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:
            tail = [*tail[-20:], line]
            match = STEP_LINE.search(line)
            if match and (until_step is None or int(match.group(1)) >= until_step):
                seen = time.perf_counter() - started
                process.send_signal(signal.SIGTERM)
                break
        for line in process.stderr:  # drain, so the process never blocks on a full pipe
            tail = [*tail[-20:], line]
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if seen is None:
        raise RuntimeError(
            f"bt run {plan[:12]} ended ({process.returncode}) before a train_step:\n{''.join(tail)}"
        )
    return seen, code, wall_start


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def phases(experiments: Path, origin: float) -> dict[str, float]:
    """Seconds from the process start (`origin`, wall clock) to the first of each phase's events."""
    (record,) = experiments.iterdir()
    events = [json.loads(line) for line in (record / "train.log").read_text().splitlines() if line.strip()]
    first: dict[str, float] = {}
    for event in events:
        name = event.get("event")
        if name == "step_started" and not str(event.get("step", "")).startswith("train"):
            continue
        if name in PHASES and name not in first:
            first[name] = stamp(event["timestamp"])
    return {name: first[name] - origin for name in PHASES if name in first}


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    n = rounds(args, quick=3, full=7)
    interrupt_at = 10 if args.quick else 20

    with workspace("resume-cost", args) as space:
        print_header("time to the first trained update: resume vs fresh start", args, space)
        note("building the data step once (a plan with 1 update)")
        warm = space.plan(TINY, "train.steps=1", "train.warmup_steps=0", "train.seed=999999")
        space.run_bt("run", warm, "--progress", "off")
        seeds = iter(range(1000, 1_000_000))
        breakdown: dict[str, list[dict[str, float]]] = {"fresh": [], "resumed": []}

        def fresh() -> float:
            plan = space.plan(TINY, f"train.seed={next(seeds)}")
            experiments = space.path("experiments", f"fresh-{plan[:12]}")
            seconds, _, origin = watch(space, plan, experiments, None)
            breakdown["fresh"].append(phases(experiments, origin))
            return seconds

        def resumed() -> float:
            plan = space.plan(TINY, f"train.seed={next(seeds)}")
            _, code, _ = watch(
                space,
                plan,
                space.path("experiments", f"interrupted-{plan[:12]}"),
                interrupt_at,
                env={"BT_TEST_STEP_DELAY": DELAY_S},
            )
            if code != 3:
                raise RuntimeError(f"the interrupted run exited with {code}, not 3 (interrupted, resumable)")
            experiments = space.path("experiments", f"resumed-{plan[:12]}")
            seconds, _, origin = watch(space, plan, experiments, None)
            breakdown["resumed"].append(phases(experiments, origin))
            return seconds

        note(f"{n} alternating rounds")
        results = alternate([("fresh start", fresh), ("resumed after SIGTERM", resumed)], n)
        base = median(results["fresh start"])
        print_table(
            f"bt run start to the first train_step event (median of {n}, alternated)",
            ["contender", "median", "min..max", "vs fresh start"],
            [
                [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), base))]
                for name, v in results.items()
            ],
        )
        rows = []
        for kind, label in (("fresh", "fresh start"), ("resumed", "resumed after SIGTERM")):
            runs = breakdown[kind][-n:]
            cells = [label]
            for name in PHASES:
                values = [r[name] for r in runs if name in r]
                cells.append(fmt_seconds(median(values)) if values else "-")
            rows.append(cells)
        print_table(
            "median time from the process start to each phase (train.log timestamps)",
            [
                "contender",
                "executor ready",
                "train step started",
                "torch imported",
                "checkpoint loaded",
                "first update",
            ],
            rows,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
