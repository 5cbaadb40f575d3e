"""Evaluation beside training: `bt run` wall time with each kept checkpoint scored beside training
(`eval.checkpoints_every`) against the same run scoring the final weights only.

presets/tiny.toml with one benchmark suite (tests/suites/arithmetic.jsonl, subset 0.5) and four
kept checkpoints (updates 50, 100, 150, 200): "with" scores the suite at 50, 100 and 150 in the
evaluation worker while training goes on (200 is the eval step's, in both); "without" sets
checkpoints_every = 0. Each run starts from an empty store (data, training, eval, export all
execute); the two alternate. Goal: with / without <= 1.2x when a second core is free (the worker
computes on one thread, the portable train step on the other). The train step's weights digest
is printed for both: it must be the same.

Run: python benchmarks/eval_beside.py [--quick] [--rounds N]
"""

from __future__ import annotations

import json
import resource
import shutil
import sys

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    REPO,
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
    workspace,
)

GOAL_RATIO = 1.2
SUITE = REPO / "tests" / "suites" / "arithmetic.jsonl"


def preset_text(every: int) -> str:
    return (
        f'extends = "{TINY}"\n\n[train]\nkeep_checkpoints = 4\n\n[eval]\n'
        f'suites = [{{ name = "arith", file = "arithmetic.jsonl" }}]\nsubset = 0.5\ncheckpoints_every = {every}\n'
    )


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    n = rounds(args, quick=2, full=3)
    with workspace("eval-beside", args) as space:
        print_header("bt run with and without evaluation beside training", args, space)
        shutil.copyfile(SUITE, space.path("arithmetic.jsonl"))
        weights: dict[str, set[str]] = {"with": set(), "without": set()}
        cpu: dict[str, list[float]] = {"with": [], "without": []}  # CPU seconds of bt and its children
        counter = iter(range(10**6))

        def run(name: str, every: int) -> float:
            index = next(counter)
            preset = space.path(f"{name}.toml")
            preset.write_text(preset_text(every))
            store, records = space.path(f"store-{index}"), space.path(f"records-{index}")
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            seconds, _ = space.run_bt(
                "run", str(preset), "--progress", "off", store=store, experiments=records
            )
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            for manifest in store.glob("steps/*/MANIFEST.json"):
                digests = json.loads(manifest.read_text()).get("digests", {})
                if "state" in digests:  # the train step's output
                    weights[name].add(digests["weights"])
            shutil.rmtree(store)
            return seconds

        contenders = [("without", lambda: run("without", 0)), ("with", lambda: run("with", 50))]
        note(f"{n} alternating rounds (after one warm-up), each bt run from an empty store")
        results = alternate(contenders, n)
        base, beside = median(results["without"]), median(results["with"])
        print_table(
            f"bt run of tiny + one suite, 4 kept checkpoints (median of {n}, alternated)",
            ["contender", "median", "min..max", "vs without"],
            [
                [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), base))]
                for name, v in results.items()
            ],
        )
        # On a busy machine the wall time says how long the evaluation worker waited for a core;
        # the CPU time says what it costs, whatever the load (the warm-up round's included).
        print_table(
            "CPU time of bt run and every process it started (median, warm-up included)",
            ["contender", "median", "min..max", "vs without"],
            [
                [
                    name,
                    fmt_seconds(median(v)),
                    fmt_spread(v),
                    fmt_ratio(ratio(median(v), median(cpu["without"]))),
                ]
                for name, v in cpu.items()
            ],
        )
        same = len(weights["with"] | weights["without"]) == 1
        note(f"train weights digests: {sorted(weights['with'] | weights['without'])}")
        print_goals(
            [
                goal_line(
                    f"with / without <= {GOAL_RATIO}x",
                    ratio(beside, base) <= GOAL_RATIO,
                    fmt_ratio(ratio(beside, base)),
                ),
                goal_line("the same train weights with and without", same, "same" if same else "DIFFERENT"),
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
