"""A 4-point sweep of the micro preset on each cluster engine (Ray, Slurm) vs the local executor.

Ray: each round builds the same 2x2 sweep (tests/presets/micro.toml, train.lr x train.steps) from
an empty store, once per contender, alternating (local, ray): wall time of `bt run` from start to
exit, and the ratio to local. The Ray contender runs against a two-node cluster started once by
this script (as the tests do), so its figure is the steady cost; `engine start` reports separately
what a run without RAY_ADDRESS pays to start a Ray instance of its own. `scheduling` compares the
per-step overhead of the engine with a plain Ray task of `true` (subprocess), per task.

Slurm: the same sweep on a real single-node Slurm started for the run, the per-step overhead
against a plain `sbatch --wait --wrap true`, and what starting the daemons costs
(benchmarks/slurm_sweep.py, which also runs alone). An engine that is not installed is skipped
with a note. Nothing here asserts on a time. Run: python benchmarks/cluster_sweep.py [--quick]
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    REPO,
    Workspace,
    alternate,
    fmt_ratio,
    fmt_seconds,
    make_parser,
    median,
    note,
    print_header,
    print_table,
    rounds,
    workspace,
)
from slurm_sweep import measure_slurm  # noqa: E402

MICRO = REPO / "tests" / "presets" / "micro.toml"
SWEEP = ("--sweep", "train.lr=1e-3,3e-3", "--sweep", "train.steps=8,12")
DISTINCT_STEPS = 13  # one data step, and a train, eval and export step per point


@contextlib.contextmanager
def ray_cluster(root: Path) -> Iterator[dict[str, str]]:
    """The tests' two-node Ray cluster, up for the Ray half; the env a `bt run` needs to use it."""
    sys.path.insert(0, str(REPO / "tests"))
    import raycluster

    root.mkdir(parents=True, exist_ok=True)
    cluster = raycluster.start(root)
    try:
        yield {**cluster.env(), "BT_EXECUTOR": "ray"}
    finally:
        raycluster.stop(cluster)


def main() -> int:
    args = make_parser(__doc__).parse_args()
    with workspace("cluster-sweep", args) as space:
        print_header("4-point sweep: cluster engines vs the local executor", args, space)
        if importlib.util.find_spec("ray") is None:
            note("Ray half skipped: not installed (pip install -e '.[ray]')")
        else:
            measure_ray(space, rounds(args, quick=1, full=3))
        measure_slurm(space, rounds(args, quick=2, full=5))
    return 0


def measure_ray(space: Workspace, count: int) -> None:
    """The sweep locally and on a two-node Ray cluster, the engine's start and its per-step cost."""
    with ray_cluster(space.path("ray")) as on_ray:
        envs: dict[str, dict[str, str]] = {"local": {}, "ray": on_ray}
        serial = iter(range(10_000))

        def sweep(env: dict[str, str]) -> Callable[[], float]:
            def measure() -> float:
                store = space.path(f"store-{next(serial)}")
                seconds, _ = space.run_bt("run", str(MICRO), *SWEEP, "--threads", "1", store=store, env=env)
                return seconds

            return measure

        results = alternate([(name, sweep(env)) for name, env in envs.items()], count)
        base = median(results["local"])
        rows = [
            [name, fmt_seconds(median(times)), fmt_ratio(median(times) / base)]
            for name, times in results.items()
        ]
        print_table(
            "bt run of a 2x2 sweep (13 distinct steps)", ["executor", "wall (median)", "vs local"], rows
        )
        start_cost(space)
        extra = (median(results["ray"]) - base) / DISTINCT_STEPS
        scheduling(on_ray["RAY_ADDRESS"], count, extra)


def start_cost(space: Workspace) -> None:
    """What `bt run --executor ray` without RAY_ADDRESS pays to start (and stop) its own instance:
    a null build of one step forced to build (`--target data:main` in a fresh store) on ray vs local."""
    times: dict[str, list[float]] = {"local": [], "ray (own instance)": []}
    for index in range(2):
        for name, env in (("local", {}), ("ray (own instance)", {"BT_EXECUTOR": "ray", "RAY_ADDRESS": ""})):
            store = space.path(f"start-{name[:3]}-{index}")
            seconds, _ = space.run_bt("run", str(MICRO), "--target", "data:main", store=store, env=env)
            times[name].append(seconds)
    local, ray = median(times["local"]), median(times["ray (own instance)"])
    print_table(
        "one data step, fresh store",
        ["executor", "wall (median)", "engine start + stop"],
        [
            ["local", fmt_seconds(local), "-"],
            ["ray (own instance)", fmt_seconds(ray), fmt_seconds(ray - local)],
        ],
    )


def scheduling(address: str, count: int, extra_per_step: float) -> None:
    """Per step: what the Ray sweep cost beyond the local one, per distinct step (wall time, so
    the engine's parallelism is netted in), against a plain Ray task running `true` as a
    subprocess: the floor any engine-placed step pays."""
    import os
    import subprocess

    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:

        @ray.remote(num_cpus=1)
        def plain() -> int:
            return subprocess.run(["true"], check=False).returncode

        ray.get(plain.remote())  # a warm worker
        tasks = 8 * count
        started = time.perf_counter()
        ray.get([plain.remote() for _ in range(tasks)])
        per_task = (time.perf_counter() - started) / tasks
        rows = [
            ["plain Ray task of `true` (subprocess)", fmt_seconds(per_task)],
            ["bt step on ray, beyond local (sweep wall / 13)", fmt_seconds(extra_per_step)],
        ]
        print_table("per-step scheduling overhead", ["what", "per step"], rows)
        note("a buildtrain step adds its worker's start (python, imports) and the remote's pull/push on top")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
