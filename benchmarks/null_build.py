"""Null build: `bt run HASH` of a fully built plan, in a fresh process, and whether it imports torch.

Builds presets/tiny.toml once (about 20 s; --quick: 20 training steps), then alternates, each in a
fresh process: `python -c pass` (for scale), `bt --help` (the CLI's own start-up) and `bt run HASH`
of the built plan (every step a cache hit; goal: median < 0.15 s). Then runs the null build once more
under `python -X importtime`, lists every buildtrain module and third-party package it imported (so
that a regression shows which import brought it) and the slowest top-level imports, and checks that
no `torch` module (nor another heavy library) was imported: the design requires a null build not to
import torch.

Run: python benchmarks/null_build.py [--quick]
"""

from __future__ import annotations

import json
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
    parse_importtime,
    print_goals,
    print_header,
    print_imports,
    print_table,
    python_prefix_for_bt,
    ratio,
    rounds,
    time_process,
    workspace,
)

GOAL_NULL_S = 0.15


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    n = rounds(args, quick=5, full=11)

    with workspace("null-build", args) as space:
        print_header("bt run of a fully built plan (null build)", args, space)
        # --quick trains 20 steps instead of 200: the outputs a null build verifies keep their shape
        # (same model, same number of checkpoints), only their trace is shorter.
        overrides = ("train.steps=20", "train.warmup_steps=5") if args.quick else ()
        plan = space.plan(TINY, *overrides)
        note(f"building {plan[:12]} (presets/tiny.toml {' '.join(overrides)}) once")
        build_s, _ = space.run_bt("run", plan, "--progress", "off")
        env = space.env()
        contenders = [
            (
                "python -c pass",
                lambda: time_process([sys.executable, "-c", "pass"], env=env, cwd=space.root)[0],
            ),
            ("bt --help", lambda: space.run_bt("--help")[0]),
            ("bt run HASH (null build)", lambda: space.run_bt("run", plan, "--progress", "off")[0]),
        ]
        note(f"{n} alternating rounds of fresh processes")
        results = alternate(contenders, n)
        base = median(results["python -c pass"])
        null = median(results["bt run HASH (null build)"])
        print_table(
            f"fresh processes (median of {n}, alternated; the build itself took {fmt_seconds(build_s)})",
            ["command", "median", "min..max", "vs python -c pass"],
            [
                [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), base))]
                for name, v in results.items()
            ],
        )

        argv = [python_prefix_for_bt()[0], "-X", "importtime", *python_prefix_for_bt()[1:]]
        argv += ["--store", str(space.store), "run", plan, "--progress", "off"]
        records = space.path("experiments-importtime")
        _, done = time_process(argv, env=space.env(experiments=records), cwd=space.root)
        (summary_path,) = records.glob("*/summary.json")
        summary = json.loads(summary_path.read_text())
        modules = parse_importtime(done.stderr)
        heavy = print_imports("imported by the null build", done.stderr)
        torch_modules = [m for m, *_ in modules if m == "torch" or m.startswith("torch.")]
        top = sorted((m for m in modules if m[3] == 0), key=lambda m: -m[2])[:8]
        print_table(
            f"slowest top-level imports of the null build ({len(modules)} modules imported)",
            ["module", "cumulative", "self"],
            [[name, fmt_seconds(cum / 1e6), fmt_seconds(own / 1e6)] for name, own, cum, _ in top],
        )
        print(
            f"\nnull build: {summary['cached']} steps cached, {summary['executed']} executed; "
            f"torch imported: {'YES: ' + ', '.join(torch_modules[:5]) if torch_modules else 'no'}"
        )
        print_goals(
            [
                goal_line(f"null build < {GOAL_NULL_S} s", null < GOAL_NULL_S, fmt_seconds(null)),
                goal_line(
                    "null build does not import torch",
                    not torch_modules and summary["executed"] == 0,
                    f"{len(torch_modules)} torch modules, {summary['executed']} steps executed",
                ),
                goal_line("null build imports no heavy library", not heavy, ", ".join(heavy) or "none"),
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
