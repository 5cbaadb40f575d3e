"""Shared helpers for the side-by-side benchmarks in this folder.

Every benchmark measures its contenders in one script, alternating them (A B A B ...) so that the
noise of a busy machine lands on all of them alike, and reports medians and ratios, never a single
absolute time. Nothing here asserts on a time.

Isolation: each benchmark works in its own temporary directory (store, run records, generated
data), which is removed at exit, also on Ctrl-C or SIGTERM. By default buildtrain's source is
copied into that directory at start and the child processes import the copy (through PYTHONPATH,
with the temporary directory as working directory), so that edits to the working tree during a
measurement cannot change the toolchain fingerprint halfway; `--live` uses the installed package.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "buildtrain"
TINY = REPO / "presets" / "tiny.toml"
WARM_UPDATES = 3  # updates left out of a run's throughput: the processes are still warming up
# tiny at width 256 and depth 4: about 3.0M parameters, 12 MB per float32 copy (weights, gradient)
WIDE = ["model.dim=256", "model.n_layers=4", "model.ffn_hidden=704"]


# -- statistics and formatting --------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def fmt_seconds(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


def fmt_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def fmt_spread(values: Sequence[float], fmt: Callable[[float], str] = fmt_seconds) -> str:
    """min..max of the samples, to show how noisy a median is."""
    return f"{fmt(min(values))}..{fmt(max(values))}" if values else "-"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]
        return "  ".join(parts).rstrip()

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


def goal_line(description: str, met: bool, measured: str) -> str:
    """One line of the goals summary; a goal is reported, never asserted."""
    return f"  {'met   ' if met else 'MISSED'}  {description}  (measured: {measured})"


def print_goals(lines: Sequence[str]) -> None:
    print("\ngoals (noisy machine: read the medians and ratios, rerun on a quiet machine to decide)")
    for text in lines:
        print(text)
    sys.stdout.flush()


def note(text: str) -> None:
    """Progress and explanations go to stderr, so stdout holds only the tables."""
    print(text, file=sys.stderr, flush=True)


# -- the machine ----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str:
    """From package metadata: describing the machine must not import torch."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_line() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} cores ({usable} usable), torch {torch_version()}, "
        f"Python {platform.python_version()}, {platform.system()} {platform.machine()}, load avg {load}"
    )


def git_commit() -> str:
    """The checked-out commit. Asked of git, which only reads here: a worktree's .git is a file
    and a branch's ref may be packed, so reading .git/HEAD by hand said "unknown" there."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
    except OSError:  # no git on this machine
        return "unknown"
    return done.stdout.strip()[:12] if done.returncode == 0 else "unknown"


def print_header(title: str, args: argparse.Namespace, workspace: Workspace | None = None) -> None:
    print(title)
    print(machine_line())
    if workspace is None or workspace.src is None:
        source = "the installed package"
        if os.environ.get("PYTHONDONTWRITEBYTECODE"):
            source += " (PYTHONDONTWRITEBYTECODE is set: buildtrain may compile from source at each start)"
    else:
        source = "a precompiled snapshot of buildtrain/ taken at start"
    mode = "quick" if args.quick else "full"
    print(f"mode: {mode}; commit {git_commit()}; code under test: {source}")
    sys.stdout.flush()


# -- command line ---------------------------------------------------------------------------------


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help is the benchmark's docstring, with the options every benchmark has."""
    text = (doc or "").strip()
    summary, _, details = text.partition("\n\n")
    parser = argparse.ArgumentParser(
        description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="few repetitions and small sizes (about a minute)"
    )
    parser.add_argument("--rounds", type=int, metavar="N", help="override the number of alternating rounds")
    parser.add_argument(
        "--live",
        action="store_true",
        help="import the installed buildtrain instead of a snapshot copied at start",
    )
    return parser


def rounds(args: argparse.Namespace, quick: int, full: int) -> int:
    return max(1, args.rounds) if args.rounds else (quick if args.quick else full)


def in_process_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a benchmark whose contenders alternate in one measuring process
    (`measure_in_child`): the usual options, --threads, and the child's own flag."""
    parser = make_parser(doc)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: the measuring process
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    return parser


def measure_in_child(script: str, threads: int, rounds: int) -> Any:
    """What `script --child` prints last (JSON: its measurements), run in a process started with
    the `native` numerics environment for `threads`, which MKL, OpenMP and the allocator read when
    torch loads; None, after its error output, if it failed."""
    from buildtrain.executor.process import numerics

    env = {**os.environ, **numerics.environment("native", "cpu", threads)}
    spec = json.dumps({"threads": threads, "rounds": rounds})
    done = subprocess.run(
        [sys.executable, script, "--child", spec], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return None
    return json.loads(done.stdout.splitlines()[-1])


# -- processes ------------------------------------------------------------------------------------


def bt_prefix() -> list[str]:
    """How to start `bt` without a shell shim in front (pyenv shims alone cost ~100 ms)."""
    script = Path(sys.executable).parent / "bt"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "buildtrain"]


def python_prefix_for_bt() -> list[str]:
    """`bt` as arguments to the interpreter, so interpreter flags (-X importtime) can go first."""
    prefix = bt_prefix()
    return [sys.executable, prefix[0]] if len(prefix) == 1 else prefix


def time_process(
    argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, check: bool = True
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Wall time of a fresh process from start to exit, with its output captured."""
    started = time.perf_counter()
    done = subprocess.run(list(argv), env=env, cwd=cwd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if check and done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited with {done.returncode}:\n{done.stderr[-3000:]}{done.stdout[-1000:]}"
        )
    return elapsed, done


def alternate(
    contenders: Sequence[tuple[str, Callable[[], float]]],
    rounds: int,
    warmup: int = 1,
    *,
    on_value: Callable[[str, int, float], None] | None = None,
    deadline: float | None = None,
) -> dict[str, list[float]]:
    """Call each contender once per round, in turn (A B A B ...); the first `warmup` rounds are
    discarded. A contender returns its own measurement (seconds, or a rate).

    `on_value(name, round, value)` hears each kept measurement the moment it exists (a short GPU
    lease must not end with nothing printed). With a `deadline` (time.monotonic()), a round
    starts only if the slowest round so far would still end before it; the first always runs."""
    results: dict[str, list[float]] = {name: [] for name, _ in contenders}
    total = warmup + rounds
    slowest = 0.0
    for index in range(total):
        if deadline is not None and index > 0 and time.monotonic() + slowest > deadline:
            note(f"  the budget leaves no time for another round: stopping after {index - warmup}")
            break
        started = time.monotonic()
        label = "warm-up" if index < warmup else f"round {index - warmup + 1}/{rounds}"
        note(f"  {label}: " + ", ".join(name for name, _ in contenders))
        for name, measure in contenders:
            value = measure()
            if index >= warmup:
                results[name].append(value)
                if on_value is not None:
                    on_value(name, index - warmup + 1, value)
        slowest = max(slowest, time.monotonic() - started)
    return results


# -- the temporary workspace ----------------------------------------------------------------------


def _raise_on_sigterm(number: int, _: object) -> None:
    raise SystemExit(128 + number)


class Workspace:
    """A temporary directory holding the store, run records, generated data and (by default) a
    snapshot of buildtrain's source; removed on exit."""

    def __init__(self, name: str, *, live: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"bt-bench-{name}-")).resolve()
        self.store = self.root / "store"
        self.experiments = self.root / "experiments"
        self.src: Path | None = None
        if not live:
            self.src = self.root / "src"
            shutil.copytree(PACKAGE, self.src / "buildtrain", ignore=shutil.ignore_patterns("__pycache__"))
            # Bytecode up front, as an installed package has it: with PYTHONDONTWRITEBYTECODE set
            # (as here), every `bt` would otherwise compile buildtrain from source at start.
            compileall.compile_dir(self.src, quiet=1)

    def __enter__(self) -> Workspace:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so that the cleanup below runs
        return self

    def __exit__(self, *_: object) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    def env(self, store: Path | None = None, experiments: Path | None = None, **extra: str) -> dict[str, str]:
        """The environment of a child: no inherited BT_* settings, the store and records in here,
        and the snapshot first on the import path."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("BT_")}
        env["BT_STORE"] = str(store or self.store)
        env["BT_EXPERIMENTS"] = str(experiments or self.experiments)
        if self.src is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.src), env.get("PYTHONPATH")]))
        env.update(extra)
        return env

    def bt(self, *args: str, store: Path | None = None) -> list[str]:
        return [*bt_prefix(), "--store", str(store or self.store), *args]

    def run_bt(
        self,
        *args: str,
        store: Path | None = None,
        experiments: Path | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> tuple[float, subprocess.CompletedProcess[str]]:
        """Run `bt ARGS` in a fresh process (working directory: the workspace); (seconds, result)."""
        full_env = self.env(store, experiments, **(env or {}))
        return time_process(self.bt(*args, store=store), env=full_env, cwd=self.root, check=check)

    def plan(self, preset: Path, *overrides: str, store: Path | None = None) -> str:
        sets = [part for value in overrides for part in ("--set", value)]
        _, done = self.run_bt("plan", "-q", str(preset), *sets, store=store)
        return done.stdout.strip()

    def import_buildtrain(self) -> None:
        """Make this process import the code under test (call before importing buildtrain)."""
        if self.src is not None:
            sys.path.insert(0, str(self.src))
        loaded = sys.modules.get("buildtrain")
        if loaded is not None and self.src is not None and str(self.src) not in str(loaded.__file__):
            raise RuntimeError("buildtrain was imported before the snapshot was put on the path")


@contextlib.contextmanager
def workspace(name: str, args: argparse.Namespace) -> Iterator[Workspace]:
    with Workspace(name, live=args.live) as space:
        yield space


def tree_size(path: Path) -> tuple[int, int]:
    """(bytes, files) under a directory."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
                files += 1
    return total, files


def age_files(paths: Sequence[Path], seconds: float = 3600.0) -> None:
    """Set mtimes in the past, so that the planner's stat cache trusts them at once (it skips files
    written in the last two seconds)."""
    past = time.time() - seconds
    for path in paths:
        os.utime(path, (past, past))


# -- run records ----------------------------------------------------------------------------------


def record_events(experiments: Path) -> list[dict[str, Any]]:
    """The events (train.log, JSON lines) of the one run record under `experiments`."""
    (record,) = experiments.iterdir()
    return [json.loads(line) for line in (record / "train.log").read_text().splitlines() if line.strip()]


def updates_per_second(experiments: Path) -> float:
    """Median tokens/s over the updates rank 0 logged in a run record, after the first few."""
    rates = [
        float(event["tokens_per_s"])
        for event in record_events(experiments)
        if event.get("event") == "train_step" and event["step"] > WARM_UPDATES
    ]
    if not rates:
        raise RuntimeError(f"no train_step events under {experiments}")
    return median(rates)


# -- what a command imports -----------------------------------------------------------------------

# Third-party packages a start-up path must not import, and what they cost when one slips in.
SITE_HOOKS = ("sitecustomize", "usercustomize")  # the interpreter's, not the command's
HEAVY = ("torch", "numpy", "tokenizers", "pyarrow", "matplotlib", "safetensors", "structlog", "pandas")


def parse_importtime(stderr: str) -> list[tuple[str, int, int, int]]:
    """(module, self us, cumulative us, depth) for each `-X importtime` line."""
    modules = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) != 3:
            continue
        self_us, cumulative_us, raw_name = parts
        depth = (len(raw_name) - len(raw_name.lstrip(" ")) - 1) // 2
        modules.append((raw_name.strip(), int(self_us), int(cumulative_us), depth))
    return modules


def print_imports(title: str, stderr: str) -> list[str]:
    """List what a command imported (its `-X importtime` output): every buildtrain module, and each
    third-party package with the time its import took, so that a regression shows which import
    brought it. Returns the heavy packages among them."""
    modules = parse_importtime(stderr)
    ours = sorted(name for name, *_ in modules if name == "buildtrain" or name.startswith("buildtrain."))
    third: dict[str, int] = {}
    for name, _, cumulative, _ in modules:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top.startswith("_") or top in ("buildtrain", *SITE_HOOKS):
            continue
        third[top] = max(third.get(top, 0), cumulative)  # the package's own import line covers it
    print(f"\n{title}: {len(modules)} modules, {len(ours)} of them buildtrain's")
    short = [name.removeprefix("buildtrain.") for name in ours]
    line = "  buildtrain:"
    for name in short:
        if len(line) + len(name) > 98:
            print(line)
            line = "   "
        line += f" {name}"
    print(line)
    costs = ", ".join(
        f"{name} {cost / 1000:.1f} ms" for name, cost in sorted(third.items(), key=lambda x: -x[1])
    )
    print(f"  third-party (import time under -X importtime): {costs or 'none'}")
    return [name for name in third if name in HEAVY]
