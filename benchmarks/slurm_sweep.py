"""The Slurm engine against the local executor, on a real single-node Slurm started for the run.

The Slurm half of the cluster benchmark (benchmarks/cluster_sweep.py calls `measure_slurm`; this
file also runs alone). It starts munged, slurmctld and slurmd with the tests' helper
(tests/slurm.py: one node on 127.0.0.1 with this machine's cores, free ports, stopped by pid at
the end) and reports, alternating the contenders round by round, each in a fresh store:

- sweep: the wall time of `bt run` of a 4-point sweep of the micro preset (train.lr x
  train.steps, 2 x 2: one shared data step and four train, eval and export steps) with the local
  executor and with `--executor slurm` (ratio Slurm / local; the Slurm engine runs independent
  steps at once, on as many cores as the node has);
- per step: a single step (the micro preset's data step, `--target data:main`) built locally and
  as a Slurm job, against a plain `sbatch --wait --wrap true`; the engine's overhead per step is
  its time minus the local time, set beside what Slurm itself takes to run a job that does nothing;
- the engine's start: what it costs to have Slurm at all (the daemons up and the node idle), and
  the first `scontrol ping` a run pays before its first submission.

Nothing here asserts on a time. Run: python benchmarks/slurm_sweep.py [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    REPO,
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

sys.path.insert(0, str(REPO / "tests"))
import slurm  # noqa: E402  (the tests' Slurm helper: munged, slurmctld, slurmd, stopped by pid)

MICRO = REPO / "tests" / "presets" / "micro.toml"
SWEEP = ("--sweep", "train.lr=3e-3,1e-2", "--sweep", "train.steps=8,12")


def _fresh(space: Workspace, name: str, counter: list[int]) -> Any:
    counter[0] += 1
    return space.path(f"{name}-{counter[0]}", ".bt")


def measure_sweep(space: Workspace, cluster: slurm.Slurm, count: int) -> list[list[str]]:
    """A 4-point sweep, local against Slurm, each round in fresh stores."""
    counter = [0]
    on_slurm = cluster.env()

    def local() -> float:
        seconds, _ = space.run_bt(
            "run", str(MICRO), *SWEEP, "--progress", "off", store=_fresh(space, "l", counter)
        )
        return seconds

    def engine() -> float:
        store = _fresh(space, "s", counter)
        seconds, _ = space.run_bt(
            "run", str(MICRO), *SWEEP, "--executor", "slurm", "--progress", "off", store=store, env=on_slurm
        )
        return seconds

    results = alternate([("local", local), ("slurm", engine)], count)
    here, there = median(results["local"]), median(results["slurm"])
    return [
        ["4-point sweep (micro)", fmt_seconds(here), fmt_spread(results["local"]), fmt_seconds(there),
         fmt_spread(results["slurm"]), fmt_ratio(ratio(there, here))],
    ]  # fmt: skip


def measure_step(space: Workspace, cluster: slurm.Slurm, count: int) -> tuple[list[list[str]], float, float]:
    """One step locally, as a Slurm job, and a plain `sbatch --wait` of `true`."""
    counter = [0]
    on_slurm = cluster.env()
    target = ("--target", "data:main", "--progress", "off")

    def local() -> float:
        seconds, _ = space.run_bt("run", str(MICRO), *target, store=_fresh(space, "dl", counter))
        return seconds

    def engine() -> float:
        store = _fresh(space, "ds", counter)
        seconds, _ = space.run_bt(
            "run", str(MICRO), *target, "--executor", "slurm", store=store, env=on_slurm
        )
        return seconds

    def sbatch() -> float:
        started = time.perf_counter()
        subprocess.run(
            ["sbatch", "--wait", "--quiet", "--output", "/dev/null", "--wrap", "true"],
            env={**os.environ, **on_slurm},
            check=True,
        )
        return time.perf_counter() - started

    results = alternate([("local", local), ("slurm", engine), ("sbatch", sbatch)], count)
    here, there, plain = (median(results[name]) for name in ("local", "slurm", "sbatch"))
    rows = [
        ["data step, local", fmt_seconds(here), fmt_spread(results["local"])],
        ["data step, --executor slurm", fmt_seconds(there), fmt_spread(results["slurm"])],
        ["sbatch --wait --wrap true", fmt_seconds(plain), fmt_spread(results["sbatch"])],
    ]
    return rows, there - here, plain


def measure_start(space: Workspace) -> list[list[str]]:
    """Slurm's daemons from nothing to an idle node, and one `scontrol ping` against them."""
    started = time.perf_counter()
    with slurm.running(space.path("slurm-start")) as cluster:
        up = time.perf_counter() - started
        began = time.perf_counter()
        subprocess.run(
            ["scontrol", "ping"], env={**os.environ, **cluster.env()}, capture_output=True, check=True
        )
        ping = time.perf_counter() - began
    return [
        ["daemons up, node idle (once per cluster)", fmt_seconds(up)],
        ["scontrol ping (once per run)", fmt_seconds(ping)],
    ]


def measure_slurm(space: Workspace, count: int) -> None:
    """Every Slurm measurement of this file, printed as tables."""
    missing = slurm.missing_binaries()
    if missing:
        note(
            f"Slurm half skipped: not installed ({', '.join(missing)}; apt-get install slurmctld slurmd munge)"
        )
        return
    start_rows = measure_start(space)
    with slurm.running(space.path("slurm")) as cluster:
        sweep_rows = measure_sweep(space, cluster, count)
        step_rows, overhead, plain = measure_step(space, cluster, count)
    print_table(
        f"bt run of a 4-point sweep, medians of {count} alternated rounds (single-node Slurm, {cluster.cpus} CPUs)",
        ["what", "local", "spread", "slurm", "spread", "slurm / local"],
        sweep_rows,
    )
    print_table(f"one step, medians of {count} alternated rounds", ["what", "median", "spread"], step_rows)
    print_table("starting the engine", ["what", "time"], start_rows)
    print(
        f"per-step overhead of the Slurm engine (slurm - local): {fmt_seconds(overhead)}; "
        f"a plain sbatch of true: {fmt_seconds(plain)} ({fmt_ratio(ratio(overhead, plain))} of it)"
    )


def main() -> None:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    count = rounds(args, quick=2, full=5)
    with workspace("slurm-sweep", args) as space:
        print_header("bt run --executor slurm against the local executor", args, space)
        measure_slurm(space, count)


if __name__ == "__main__":
    main()
