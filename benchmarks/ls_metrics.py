"""`bt ls --metrics` over 1,000 stored plans: the results table reads plan cards, not plans.

Stores 1,000 plans of presets/tiny.toml in one `bt plan --sweep` (10 learning rates x 10 seeds x 10
warmup lengths, about 20 s), gives every train step a metrics summary such as `bt run` writes (so
the table reads a result per plan, as after a real sweep), then alternates, each in a fresh
process: `python -c pass` (for scale), `bt ls --metrics` (goal: median well under 1 s) and plain
`bt ls` (which loads and re-hashes every plan). Last, `bt ls --metrics` once without cards (as for
plans stored before cards existed: each is computed from its plan and kept).

Run: python benchmarks/ls_metrics.py [--quick]
"""

from __future__ import annotations

import json
import shutil
import sys

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    alternate,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
    goal_line,
    make_parser,
    median,
    note,
    print_goals,
    print_header,
    print_table,
    ratio,
    rounds,
    time_process,
    workspace,
)

GOAL_S = 1.0
AXES = (
    "train.lr=" + ",".join(f"{k}e-4" for k in range(1, 11)),
    "train.seed=" + ",".join(str(k) for k in range(10)),
    "train.warmup_steps=" + ",".join(str(k) for k in range(1, 11)),
)


def fake_summaries(store, plans: list[str]) -> None:
    """A sealed step summary for each plan's train step, written as the executor writes them."""
    from buildtrain.store.store import Store

    sealed = Store(store)
    for index, plan_hash in enumerate(plans):
        plan = json.loads(sealed.plans.path(plan_hash).read_bytes())
        for step in plan["steps"]:
            if step["kind"] == "train":
                body = {
                    "label": step["label"],
                    "kind": "train",
                    "wall_s": 10.0 + index % 7,
                    "train": {"final_loss": 2.0 + index / 1000, "final_step": 200, "tokens_per_s": 30000.0},
                }
                sealed.results.save_step_metrics(step["hash"], body)


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    n = rounds(args, quick=3, full=9)
    with workspace("ls-metrics", args) as space:
        print_header("bt ls --metrics over 1,000 stored plans", args, space)
        sweep = [part for axis in AXES for part in ("--sweep", axis)]
        planned_s, done = space.run_bt("plan", "-q", str(TINY), *sweep)
        plans = done.stdout.split()
        note(f"stored {len(plans)} plans in {fmt_seconds(planned_s)}")
        fake_summaries(space.store, plans)
        env = space.env()
        contenders = [
            (
                "python -c pass",
                lambda: time_process([sys.executable, "-c", "pass"], env=env, cwd=space.root)[0],
            ),
            ("bt ls --metrics", lambda: space.run_bt("ls", "--metrics")[0]),
            ("bt ls", lambda: space.run_bt("ls")[0]),
        ]
        results = alternate(contenders, n)
        table = median(results["bt ls --metrics"])
        base = median(results["python -c pass"])
        shutil.rmtree(space.store / "metrics" / "plans")
        cold_s, _ = space.run_bt("ls", "--metrics")
        print_table(
            f"{len(plans)} plans, fresh processes (median of {n}, alternated)",
            ["command", "median", "min..max", "vs bt ls --metrics"],
            [
                [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), table))]
                for name, v in results.items()
            ],
        )
        print(
            f"\nbt ls --metrics without plan cards (computed from the plans once, then kept): {fmt_seconds(cold_s)}"
        )
        print(f"bt ls --metrics less python start-up: {fmt_seconds(table - base)}")
        print_goals(
            [goal_line(f"bt ls --metrics over 1,000 plans < {GOAL_S} s", table < GOAL_S, fmt_seconds(table))]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
