"""Planner latency: wall time of `bt plan` in a fresh process, and its hashing of a large data file.

Part 1 alternates, each in a fresh process: `python -c pass`, `python -c "import torch"` (for
scale) and `bt plan presets/tiny.toml` (goal: median < 0.15 s). `bt` is started through the
console script next to this interpreter; if `bt` on PATH is a different file (a pyenv shim, say),
that is timed as well, since it is what a user types. Then it plans once more under `python -X
importtime` and lists every buildtrain module and third-party package `bt plan` imported, so that
a regression shows which import brought it (a heavy library there is a failed goal).

Part 2 plans a preset (written into the temporary directory) that extends presets/tiny.toml and
reads one generated file of 1 GB (--quick: 200 MB): the first plan in an empty store hashes the
file (throughput in GB/s, end to end and net of the tiny plan's median), the second plan in the
same store only stats it (goal: median < 0.3 s), and the same bytes are hashed directly with the
`blake3` package in this process (mmap, all cores as buildtrain does, and one thread). The file is
in the page cache, so this measures hashing, not the disk.

Run: python benchmarks/plan_latency.py [--quick] [--startup-only]
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import blake3

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    Workspace,
    age_files,
    alternate,
    bt_prefix,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
    goal_line,
    make_parser,
    median,
    note,
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

GOAL_PLAN_S = 0.15  # a fresh `bt plan` of presets/tiny.toml
GOAL_SECOND_PLAN_S = 0.3  # the second plan of a large source: stats it, hashes nothing
CHUNK = 1 << 24


def write_file(path: Path, size: int) -> None:
    """`size` bytes of text-like data (hashing speed does not depend on the content)."""
    line = bytes(32 + (i * 7919) % 95 for i in range(4095)) + b"\n"
    block = line * (CHUNK // len(line))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        written = 0
        while written < size:
            piece = block[: min(len(block), size - written)]
            handle.write(piece)
            written += len(piece)
    age_files([path])


def big_preset(space: Workspace, data: Path) -> Path:
    preset = space.path("big.toml")
    preset.write_text(
        f'name = "plan-latency-big"\nextends = {json.dumps(str(TINY))}\n\n'
        f'[data]\nsource = "files"\nfiles = [{json.dumps(str(data))}]\n',
        encoding="utf-8",
    )
    return preset


def hash_direct(path: Path, threads: int) -> float:
    started = time.perf_counter()
    hasher = blake3.blake3(max_threads=threads)
    hasher.update_mmap(str(path))
    hasher.hexdigest()
    return time.perf_counter() - started


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--size-mb", type=int, help="size of the generated data file (default 1000, quick 200)"
    )
    parser.add_argument("--startup-only", action="store_true", help="part 1 only: no large data file")
    args = parser.parse_args()
    n = rounds(args, quick=5, full=11)
    n_big = rounds(args, quick=3, full=5)
    size = (args.size_mb or (200 if args.quick else 1000)) * 1_000_000

    with workspace("plan-latency", args) as space:
        print_header("bt plan latency", args, space)
        env = space.env()
        python = sys.executable
        contenders = [
            ("python -c pass", lambda: time_process([python, "-c", "pass"], env=env, cwd=space.root)[0]),
            (
                'python -c "import torch"',
                lambda: time_process([python, "-c", "import torch"], env=env, cwd=space.root)[0],
            ),
            ("bt plan presets/tiny.toml", lambda: space.run_bt("plan", "-q", str(TINY))[0]),
        ]
        on_path = shutil.which("bt")
        if on_path and Path(on_path).resolve() != Path(bt_prefix()[0]).resolve():
            contenders.append(
                (
                    "  same, via bt on PATH",
                    lambda: time_process(
                        [on_path, "--store", str(space.store), "plan", "-q", str(TINY)],
                        env=env,
                        cwd=space.root,
                    )[0],
                )
            )
        note(f"part 1: {n} alternating rounds of fresh processes")
        startup = alternate(contenders, n)
        base = median(startup["python -c pass"])
        print_table(
            f"fresh processes (median of {n}, alternated)",
            ["command", "median", "min..max", "vs python -c pass"],
            [
                [name, fmt_seconds(median(v)), fmt_spread(v), fmt_ratio(ratio(median(v), base))]
                for name, v in startup.items()
            ],
        )
        tiny_plan = median(startup["bt plan presets/tiny.toml"])
        argv = [python_prefix_for_bt()[0], "-X", "importtime", *python_prefix_for_bt()[1:]]
        _, done = time_process(
            [*argv, "--store", str(space.store), "plan", "-q", str(TINY)], env=env, cwd=space.root
        )
        heavy = print_imports("imported by bt plan presets/tiny.toml", done.stderr)
        startup_goals = [
            goal_line(
                f"bt plan presets/tiny.toml < {GOAL_PLAN_S} s",
                tiny_plan < GOAL_PLAN_S,
                fmt_seconds(tiny_plan),
            ),
            goal_line("bt plan imports no heavy library", not heavy, ", ".join(heavy) or "none"),
        ]
        if args.startup_only:
            print_goals(startup_goals)
            return 0

        note(f"part 2: generating {fmt_bytes(size)} of data")
        data = space.path("data", "big.txt")
        write_file(data, size)
        preset = big_preset(space, data)
        stores: list[Path] = []

        def first_plan() -> float:
            store = space.path(f"store-big-{len(stores)}")
            stores.append(store)
            return space.run_bt("plan", "-q", str(preset), store=store)[0]

        def second_plan() -> float:
            return space.run_bt("plan", "-q", str(preset), store=stores[-1])[0]

        note(f"part 2: {n_big} alternating rounds")
        big = alternate(
            [
                ("first plan (hashes the file)", first_plan),
                ("second plan (stat cache)", second_plan),
                ("blake3 direct, mmap, all cores", lambda: hash_direct(data, blake3.blake3.AUTO)),
                ("blake3 direct, mmap, 1 thread", lambda: hash_direct(data, 1)),
            ],
            n_big,
        )
        first, second = median(big["first plan (hashes the file)"]), median(big["second plan (stat cache)"])
        direct = median(big["blake3 direct, mmap, all cores"])
        gbps = {name: size / median(v) / 1e9 for name, v in big.items()}
        net_gbps = size / max(first - tiny_plan, 1e-9) / 1e9
        rows = []
        for name, values in big.items():
            rate = f"{gbps[name]:.2f}" if "second" not in name else "-"
            rows.append([name, fmt_seconds(median(values)), fmt_spread(values), rate])
        print_table(
            f"plan with a {fmt_bytes(size)} data file (median of {n_big}, alternated)",
            ["contender", "median", "min..max", "GB/s"],
            rows,
        )
        print(
            f"\nhashing inside bt plan (first plan minus the tiny plan's {fmt_seconds(tiny_plan)}): "
            f"{net_gbps:.2f} GB/s, {fmt_ratio(ratio(net_gbps, size / direct / 1e9))} of blake3 direct "
            f"(all cores); with process start-up and planning included: "
            f"{fmt_ratio(ratio(direct, first))}"
        )
        print_goals(
            [
                *startup_goals,
                goal_line(
                    f"second plan of a {fmt_bytes(size)} source < {GOAL_SECOND_PLAN_S} s",
                    second < GOAL_SECOND_PLAN_S,
                    fmt_seconds(second),
                ),
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
