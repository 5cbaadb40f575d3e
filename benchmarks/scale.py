"""Scaling: no cost that grows faster than the work. Three parts (`--part`, default all):

planner: `bt plan` time and store size against the number of training stages and of data files
(planning only). Stages: presets/tiny.toml extended by N chained [[stages]], N = 1, 10, 100.
Files: data.source = "files" over N generated ~1 kB text files, N = 10, 1,000, 10,000 (--quick: up
to 1,000). For each N, alternated: the first plan into an empty store and a second plan into the
same store (plan stored; the stat cache answers).

plans: a store holding N plans (N = 10, 100, 1,000) that share their steps (a sweep over the plan's
name, built once, so every run below is a null build); alternated: plain `bt ls`, `bt show PREFIX`
(a 12-digit prefix of one plan) and a null build of all N plans (`bt run` of the sweep file).
Reported per item: `bt ls` and the null build per plan, `bt show` per call; the ratio of the
largest N to the smallest says whether the per-item cost stays flat.

trace: checkpoints of a run at U updates (U = 200, 2,000, 20,000; checkpoint every 50 updates,
2 kept, a trace line per update shaped like the trainer's): the run up to U - 50 is written
first, then the checkpoint at U is saved and pruned, and resumed from, 5 times each (medians),
in a fresh process per U. Reported per checkpoint and per resume, with the ratio largest/smallest.

`--before REV` also measures the parts plans and trace with the buildtrain of git revision REV
(exported into the workspace; each version plans and builds its own stores), alternated with the
working tree's, and prints both.

Run: python benchmarks/scale.py [--quick] [--part planner|plans|trace] [--before b62e712]
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    REPO,
    TINY,
    Workspace,
    age_files,
    alternate,
    fmt_bytes,
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
    tree_size,
    workspace,
)


def stages_preset(space: Workspace, count: int) -> Path:
    lines = [f'name = "scale-{count}-stages"', f"extends = {json.dumps(str(TINY))}", ""]
    for index in range(count):
        lines += ["[[stages]]", f'name = "s{index}"']
        if index:
            lines.append(f'init_from = "s{index - 1}"')
        lines.append("")
    path = space.path(f"stages-{count}.toml")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def files_preset(space: Workspace, count: int) -> Path:
    folder = space.path(f"files-{count}")
    folder.mkdir()
    paths = []
    for index in range(count):
        path = folder / f"doc-{index:05d}.txt"
        path.write_text("".join(f"{index}+{j}={index + j}\n" for j in range(100))[:1000], encoding="ascii")
        paths.append(path)
    age_files(paths)
    preset = space.path(f"files-{count}.toml")
    pattern = json.dumps(str(folder / "*.txt"))
    preset.write_text(
        f'name = "scale-{count}-files"\nextends = {json.dumps(str(TINY))}\n\n'
        f'[data]\nsource = "files"\nfiles = [{pattern}]\n',
        encoding="utf-8",
    )
    return preset


def measure(space: Workspace, kind: str, presets: dict[int, Path], n: int) -> None:
    sizes: dict[int, tuple[int, int]] = {}
    stores: dict[int, Path] = {}
    counter = iter(range(1_000_000))

    def first(count: int) -> float:
        store = space.path(f"store-{kind}-{count}-{next(counter)}")
        if count in stores:
            shutil.rmtree(stores[count], ignore_errors=True)
        stores[count] = store
        seconds = space.run_bt("plan", "-q", str(presets[count]), store=store)[0]
        sizes[count] = tree_size(store)
        return seconds

    def second(count: int) -> float:
        return space.run_bt("plan", "-q", str(presets[count]), store=stores[count])[0]

    contenders = []
    for count in presets:
        contenders.append((f"{count} {kind}: first plan", lambda c=count: first(c)))
        contenders.append((f"{count} {kind}: second plan", lambda c=count: second(c)))
    note(f"{kind}: {n} alternating rounds over N = {', '.join(map(str, presets))}")
    results = alternate(contenders, n)
    smallest = min(presets)
    rows = []
    for count in presets:
        one, two = results[f"{count} {kind}: first plan"], results[f"{count} {kind}: second plan"]
        size, files = sizes[count]
        rows.append(
            [
                f"{count:,}",
                fmt_seconds(median(one)),
                fmt_spread(one),
                fmt_ratio(median(one) / median(results[f"{smallest} {kind}: first plan"])),
                fmt_seconds(median(two)),
                fmt_spread(two),
                fmt_ratio(median(two) / median(results[f"{smallest} {kind}: second plan"])),
                f"{fmt_bytes(size)} in {files} files",
            ]
        )
    print_table(
        f"bt plan with N {kind} (median of {n}, alternated; growth against N = {smallest})",
        [
            "N",
            "first plan",
            "min..max",
            "growth",
            "second plan",
            "min..max",
            "growth",
            "store after first plan",
        ],
        rows,
    )


# -- plans: lookups and null builds against the number of stored plans -----------------------------

PLAN_COUNTS = (10, 100, 1_000)
TRACE_UPDATES = (200, 2_000, 20_000)
CHECKPOINT_EVERY = 50
KEEP = 2
TRACE_REPEATS = 5


class Version:
    """A buildtrain to measure: the workspace's snapshot of the working tree, or a git revision."""

    def __init__(self, space: Workspace, label: str, src: Path | None) -> None:
        self.space, self.label, self.src = space, label, src

    def env(self, store: Path) -> dict[str, str]:
        env = self.space.env(store, self.space.path(f"experiments-{self.label}"))
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src)
        return env

    def bt(self, store: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
        argv = [sys.executable, "-m", "buildtrain", "--store", str(store), *args]
        started = time.perf_counter()
        done = subprocess.run(argv, env=self.env(store), cwd=self.space.root, capture_output=True, text=True)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(
                f"{self.label}: bt {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}"
            )
        return elapsed, done


def export_revision(space: Workspace, revision: str) -> Path:
    """`buildtrain/` as of `revision`, exported (not checked out) into the workspace."""
    target = space.path(f"before-{revision}")
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "buildtrain"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def plan_stores(version: Version) -> dict[int, tuple[Path, Path, str]]:
    """(store, sweep file, a plan's prefix) per N: the steps are built once, in the first store,
    which the larger ones start as a copy of."""
    stores: dict[int, tuple[Path, Path, str]] = {}
    base: Path | None = None
    for count in PLAN_COUNTS:
        store = version.space.path(f"plans-{version.label}-{count}")
        if base is not None:
            shutil.copytree(base, store, symlinks=True)
        names = ",".join(f"p{index}" for index in range(count))
        _, done = version.bt(store, "plan", str(TINY), "--sweep", f"name={names}")
        sweep = version.space.path(f"plans-{version.label}-{count}.txt")
        sweep.write_text(done.stdout, encoding="utf-8")
        if base is None:
            note(f"{version.label}: building the steps the plans share (presets/tiny.toml, once)")
            version.bt(store, "run", str(sweep))
            base = store
        stores[count] = (store, sweep, done.stdout.split()[count // 2][:12])
    return stores


def measure_plans(space: Workspace, versions: list[Version], n: int, warmup: int) -> None:
    stores = {v.label: plan_stores(v) for v in versions}
    commands = {
        "bt ls": ("per plan", lambda s, p: ("ls",)),
        "bt show PREFIX": ("per call", lambda s, p: ("show", p)),
        "null build": ("per plan", lambda s, p: ("run", str(s))),
    }
    contenders = []
    for version in versions:
        for count in PLAN_COUNTS:
            store, sweep, prefix = stores[version.label][count]
            for what, (_, argv) in commands.items():
                args = argv(sweep, prefix)
                contenders.append(
                    (f"{version.label} {what} {count}", lambda v=version, s=store, a=args: v.bt(s, *a)[0])
                )
    note(f"plans: {n} alternating rounds over N = {', '.join(map(str, PLAN_COUNTS))}")
    results = alternate(contenders, n, warmup=warmup)
    rows = []
    for version in versions:
        for what, (item, _) in commands.items():
            totals = [median(results[f"{version.label} {what} {c}"]) for c in PLAN_COUNTS]
            costs = [t / c if item == "per plan" else t for t, c in zip(totals, PLAN_COUNTS, strict=True)]
            # What each added plan costs, without the process start that dominates at N = 10.
            added = [
                (totals[i + 1] - totals[i]) / (PLAN_COUNTS[i + 1] - PLAN_COUNTS[i])
                for i in range(len(totals) - 1)
            ]
            per_plan = item == "per plan"
            rows.append(
                [
                    f"{version.label}: {what}",
                    item,
                    *(fmt_item(cost) for cost in costs),
                    fmt_ratio(ratio(costs[-1], costs[0])),
                    *((fmt_item(a) for a in added) if per_plan else ["-"] * len(added)),
                    fmt_ratio(ratio(added[-1], added[0])) if per_plan else "-",
                    *(fmt_seconds(total) for total in totals),
                ]
            )
    print_table(
        f"stored plans: cost per item (median of {n}, alternated; one process per command)",
        [
            "command",
            "item",
            *(f"N={c:,}" for c in PLAN_COUNTS),
            "largest/smallest",
            *(f"added {a:,}->{b:,}" for a, b in itertools.pairwise(PLAN_COUNTS)),
            "ratio",
            *(f"total N={c:,}" for c in PLAN_COUNTS),
        ],
        rows,
    )


def fmt_item(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else fmt_seconds(seconds)


# -- trace: checkpoint save and resume against the number of updates --------------------------------


def measure_trace(space: Workspace, versions: list[Version], n: int) -> None:
    contenders = []
    for version in versions:
        for updates in TRACE_UPDATES:
            contenders.append((f"{version.label} {updates}", lambda v=version, u=updates: trace_child(v, u)))
    note(f"trace: {n} alternating rounds over U = {', '.join(map(str, TRACE_UPDATES))} (a process each)")
    measured: dict[str, list[dict[str, float]]] = {name: [] for name, _ in contenders}

    def recorder(name: str, measure: Any) -> Any:
        def run() -> float:
            result = measure()
            measured[name].append(result)
            return result["save"]

        return run

    alternate([(name, recorder(name, measure)) for name, measure in contenders], n, warmup=0)
    rows = []
    for version in versions:
        for what in ("save", "resume"):
            costs = [median([m[what] for m in measured[f"{version.label} {u}"]]) for u in TRACE_UPDATES]
            item = "per checkpoint (save + prune)" if what == "save" else "per resume (read the newest)"
            rows.append(
                [
                    f"{version.label}: {what}",
                    item,
                    *(fmt_item(c) for c in costs),
                    fmt_ratio(ratio(costs[-1], costs[0])),
                ]
            )
    print_table(
        f"trace: cost per checkpoint and per resume at U updates (checkpoint every {CHECKPOINT_EVERY}; "
        f"medians of {TRACE_REPEATS} in a process, {n} round(s))",
        ["measure", "item", *(f"U={u:,}" for u in TRACE_UPDATES), "largest/smallest"],
        rows,
    )


def trace_child(version: Version, updates: int) -> dict[str, float]:
    env = {k: v for k, v in version.env(version.space.store).items()}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--trace-child", str(updates)],
        env=env,
        cwd=version.space.root,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{version.label}: the trace measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def trace_line(update: int, names: list[str]) -> dict[str, Any]:
    """A line shaped like the trainer's at digest_every = 1 (digests made up)."""
    due = update % CHECKPOINT_EVERY == 0
    line: dict[str, Any] = {
        "step": update,
        "loss": "40a00000",
        "grad_norm": "3f800000",
        "lr": 1e-3,
        "cursor": update * 16,
        "weights": f"{update:064x}",
        "tensors": {name: f"{(update * 2654435761 + i) % (1 << 64):016x}" for i, name in enumerate(names)},
    }
    if due:
        line["state"] = f"{update + 1:064x}"
    return line


def run_trace_child(updates: int) -> dict[str, float]:
    """In a process that imports the buildtrain under test (PYTHONPATH): write a run's checkpoints
    up to `updates - CHECKPOINT_EVERY`, then time the save (and prune) of the checkpoint at
    `updates` and a resume from it."""
    import torch

    from buildtrain.config.schema import BYTE_VOCAB_SIZE, ModelConfig
    from buildtrain.steps.train import checkpoint
    from buildtrain.steps.train.model import Transformer
    from buildtrain.steps.train.optimizer import AdamW
    from buildtrain.steps.train.state import state_tensors
    from buildtrain.steps.train.trainer import param_groups

    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176)  # presets/tiny.toml

    def fresh() -> tuple[Any, Any]:
        model = Transformer.build(config, BYTE_VOCAB_SIZE, torch.Generator().manual_seed(0))
        return model, AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    model, optimizer = fresh()
    names = sorted(state_tensors(model, optimizer))
    identity = {"step_hash": "scale-benchmark"}
    folder = Path(tempfile.mkdtemp(prefix="bt-scale-trace-")) / "work" / "checkpoints"
    segmented = hasattr(checkpoint.Trace, "seal")  # the working tree; before: Trace(entries)
    history = checkpoint.Trace(folder) if segmented else checkpoint.Trace()

    def state(at: int) -> dict[str, Any]:
        return {**identity, "step": at, "cursor": at * 16, "tokens": at * 1024}

    for update in range(1, updates + 1):
        history.append(trace_line(update, names))
        if update % CHECKPOINT_EVERY == 0 and update < updates:
            checkpoint.save(folder, update, model, optimizer, state(update), history)
            checkpoint.prune(folder, KEEP)
    saves, resumes = [], []
    for _ in range(TRACE_REPEATS):
        started = time.perf_counter()
        checkpoint.save(folder, updates, model, optimizer, state(updates), copy.copy(history))
        checkpoint.prune(folder, KEEP)
        saves.append(time.perf_counter() - started)
        other, other_optimizer = fresh()
        started = time.perf_counter()
        resumed = checkpoint.load_newest(folder, other, other_optimizer, identity, lambda p, why: None)
        resumes.append(time.perf_counter() - started)
        if resumed is None or resumed.update != updates:
            raise RuntimeError("the checkpoint just written was not resumed from")
    shutil.rmtree(folder.parent.parent, ignore_errors=True)
    return {"save": median(saves), "resume": median(resumes)}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--trace-child":
        print(json.dumps(run_trace_child(int(sys.argv[2]))))
        return 0
    parser = make_parser(__doc__)
    parser.add_argument("--part", choices=("planner", "plans", "trace"), help="measure one part only")
    parser.add_argument("--before", metavar="REV", help="also measure buildtrain as of this git revision")
    args = parser.parse_args()
    n = rounds(args, quick=1, full=3)
    parts = [args.part] if args.part else ["planner", "plans", "trace"]

    with workspace("scale", args) as space:
        print_header("scaling: planner, stored plans, trace", args, space)
        versions = [Version(space, "after" if args.before else "tree", space.src)]
        if args.before:
            versions.insert(0, Version(space, "before", export_revision(space, args.before)))
        if "planner" in parts:
            n_planner = rounds(args, quick=3, full=5)
            measure(
                space, "stages", {count: stages_preset(space, count) for count in (1, 10, 100)}, n_planner
            )
            note("generating data files")
            file_counts = (10, 1_000) if args.quick else (10, 1_000, 10_000)
            measure(space, "files", {count: files_preset(space, count) for count in file_counts}, n_planner)
        if "plans" in parts:
            measure_plans(space, versions, n, warmup=0 if args.quick else 1)
        if "trace" in parts:
            measure_trace(space, versions, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
