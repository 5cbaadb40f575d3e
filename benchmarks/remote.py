"""Pull throughput from a remote: a checked pull against the client library's own download.

Seals a step output of random files (128 MB in 4 MB files; `--quick`: 32 MB) in a local store,
and builds a train step's output with bt (micro at width 256, 8 updates: 72 MB in 7 files, two
checkpoints of weights and AdamW state); pushes both to a SeaweedFS started for the run at nice 19
(127.0.0.1, stopped by pid at the end) and to a shared folder, then alternates, per round: a pull
into a fresh store, and the raw download of the same blobs with the same library on the same 8
threads into plain files (obstore `get` for S3, a file copy for the folder; no hashing, no
fsync). The random files' pull is the library's (`Remote.pull_output`: download on 8 threads,
every piece hashed as it is written, each file fsynced, the folder checked, renamed into place)
and the store's check before first use; the train output's is what `bt run` does
(`RemoteCache.pull`: that, and every declared digest re-derived from the files, the kept
checkpoints against the trace, before the folder enters the store), timed from a store that
already holds the plan and a client already open, as in a run and as the raw side's (opening the
client and saving the plan durably took about 10 ms of a 100 ms pull, once per run in `bt run`).
Reports medians, their ratio, and the figure: the median of each round's own ratio raw time /
pull time (goal: >= 0.8x).

Then, with `bt` itself against the same SeaweedFS: the wall time of a `bt run` whose every step is
pulled from the remote (a fresh store) against a local null build of the same plan; and the train
step's time with a remote (checkpoints pushed as it trains, lease held, output pushed) against
the same training without one, each in a fresh store and a fresh prefix, over 2 x rounds + 1
alternated rounds (goal: the median of the rounds' own ratios <= 5% more).

Run: python benchmarks/remote.py [--quick]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    REPO,
    alternate,
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
    print_table,
    ratio,
    rounds,
    workspace,
)

sys.path.insert(0, str(REPO / "tests"))
import seaweed  # noqa: E402  (the tests' SeaweedFS helper: free ports, 127.0.0.1, stop by pid)

GOAL = 0.8
FILE_MB = 4
STEP = "be" * 32  # the output's step hash: any 64 hex digits
MICRO = REPO / "tests" / "presets" / "micro.toml"
# micro at width 256 for 8 updates: a train output of 72 MB (two checkpoints of weights and AdamW state)
TRAIN_SETS = ["model.dim=256", "model.n_layers=4", "model.ffn_hidden=704", "train.steps=8"]
PUSH_GOAL = 0.05
PULL_ROUNDS = 3  # alternated rounds of raw and pull per round of the rest (9 with --quick)


def make_output(store: object, total_mb: int) -> None:
    """A sealed step output of random 4 MB files under `store.output(STEP)`."""
    from buildtrain.store import objects

    folder = store.new_temp("bench")  # type: ignore[attr-defined]
    for index in range(total_mb // FILE_MB):
        (folder / f"shard-{index:03d}.bin").write_bytes(os.urandom(FILE_MB << 20))
    objects.publish(folder, store.outputs.path(STEP))  # type: ignore[attr-defined]


def raw_download(remote: object, blobs: list[str], into: Path) -> float:
    """The library's own download of every blob into plain files, on the pull's thread count."""
    from buildtrain.store.remote import keys
    from buildtrain.store.remote.blobs import TRANSFERS

    backend = remote.backend  # type: ignore[attr-defined]
    into.mkdir(parents=True)
    if backend.url.scheme == "s3":
        import obstore

        def one(blob: str) -> None:
            (into / blob).write_bytes(obstore.get(backend.client.store, keys.blob(blob)).bytes())
    else:

        def one(blob: str) -> None:
            shutil.copyfile(backend.root / keys.blob(blob), into / blob)

    started = time.perf_counter()
    with ThreadPoolExecutor(TRANSFERS) as pool:
        list(pool.map(one, blobs))
    elapsed = time.perf_counter() - started
    shutil.rmtree(into)
    return elapsed


PullInto = Callable[[object], Callable[[], object]]
"""Given a fresh store, what a run has done before it pulls a step (untimed), returning the
pull itself (timed)."""


def pull(pull_into: PullInto, store_root: Path) -> float:
    from buildtrain.store.store import Store

    store = Store(store_root)
    run = pull_into(store)
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    shutil.rmtree(store_root)
    return elapsed


def measure(
    name: str,
    remote: object,
    source: object,
    step: str,
    space: object,
    count: int,
    pull_into: PullInto,
) -> list[object]:
    """Raw download against `pull_into(fresh store)` of the step output `step` of `source`."""
    from buildtrain.store import objects

    note(f"{name}: pushing")
    remote.push_output(source, step)  # type: ignore[attr-defined]
    blobs = sorted({e["blake3"] for e in objects.read_manifest(source.outputs.path(step))["files"].values()})  # type: ignore[attr-defined]
    serial = iter(range(10**6))
    times = alternate(
        [
            ("raw", lambda: raw_download(remote, blobs, space.path(f"raw-{next(serial)}"))),  # type: ignore[attr-defined]
            ("pull", lambda: pull(pull_into, space.path(f"pull-{next(serial)}", ".bt"))),  # type: ignore[attr-defined]
        ],
        PULL_ROUNDS * count,  # a pull takes a tenth of a second: rounds are cheap
    )
    raw, pulled = median(times["raw"]), median(times["pull"])
    # The raw download's median moved from 62 to 115 ms between runs of this script on a loaded
    # 2-core machine (the server at nice 19 waits for whatever else runs), the pull's from 88 to
    # 103 ms: the ratio of medians swung 0.60x-1.20x. Each round's own ratio (raw and pull back
    # to back, under the same load) cancels that drift; its median is the figure.
    own = median([r / p for r, p in zip(times["raw"], times["pull"], strict=True)])
    return [
        name,
        fmt_seconds(raw),
        fmt_spread(times["raw"]),
        fmt_seconds(pulled),
        fmt_spread(times["pull"]),
        fmt_ratio(ratio(raw, pulled)),
        fmt_ratio(own),
    ]


def files_pull(remote: object) -> PullInto:
    """The library's pull of the random files, then the store's check before first use."""

    def pull_into(store: object) -> Callable[[], object]:
        def run() -> object:
            remote.pull_output(store, STEP)  # type: ignore[attr-defined]
            return store.outputs.check(STEP)  # type: ignore[attr-defined]

        return run

    return pull_into


def train_output(space: object) -> tuple[object, object, str]:
    """A train step's output built with bt (micro at width 256: two kept checkpoints of weights
    and AdamW state): (its store, the plan, the step)."""
    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    built = space.path("train-built", ".bt")  # type: ignore[attr-defined]
    plan = space.plan(MICRO, *TRAIN_SETS, store=built)  # type: ignore[attr-defined]
    space.run_bt("run", plan, "--progress", "off", store=built)  # type: ignore[attr-defined]
    store = Store(built)
    step = next(step for step in load_plan(store, plan).steps if step.kind == "train")
    return store, load_plan(store, plan), step


def checked_pull(url: object, plan: object, step: object) -> PullInto:
    """What `bt run` does to pull a step: every blob hashed as it is written, every declared
    digest re-derived from the files, kept checkpoints against the trace, then the store's check.
    Untimed, as in a run before its first pull and as on the raw side: the plan saved in the
    store, and the remote's client opened (`bt run` opens it once per run, not per step; it
    took 4-5 ms of a 100 ms pull, and saving the plan durably about as much)."""
    from buildtrain.executor.remote.remote import RemoteCache

    def pull_into(store: object) -> Callable[[], object]:
        store.plans.save(plan.hash, plan.canonical())  # type: ignore[attr-defined]
        cache = RemoteCache(url, lambda label, text: note(f"{label}: {text}"))  # type: ignore[arg-type]
        assert cache.remote is not None  # opened here: the raw side's client is open too

        def run() -> None:
            if not cache.pull(store, step):  # type: ignore[arg-type]
                raise RuntimeError("the checked pull refused the benchmark's own output")

        return run

    return pull_into


def train_seconds(space: object, preset: list[str], serial: int, remote: str | None) -> float:
    """The train step's duration in a fresh store (and, with `remote`, a fresh prefix)."""
    import json

    records = space.path(f"records-{serial}")  # type: ignore[attr-defined]
    env = {"BT_REMOTE": f"{remote}/{serial}"} if remote else {}
    store = space.path(f"store-{serial}", ".bt")  # type: ignore[attr-defined]
    space.run_bt("run", *preset, "--progress", "off", store=store, experiments=records, env=env)  # type: ignore[attr-defined]
    summary = json.loads(next(records.glob("*/summary.json")).read_text())
    return next(step["duration_s"] for step in summary["steps"] if step["label"].startswith("train"))


def measure_runs(space: object, remote: str, count: int, quick: bool) -> None:
    """`bt run` fully pulled against a local null build; training with and without a remote."""
    steps = 24 if quick else 96
    sets = [f"train.steps={steps}", "train.checkpoint_every=4"]
    preset = [str(MICRO), *(part for value in sets for part in ("--set", value))]
    built = space.path("built", ".bt")  # type: ignore[attr-defined]
    plan = space.plan(MICRO, *sets, store=built)  # type: ignore[attr-defined]
    space.run_bt("run", plan, "--progress", "off", store=built)  # type: ignore[attr-defined]
    space.run_bt("push", plan, "--remote", f"{remote}/hits", store=built)  # type: ignore[attr-defined]
    serial = iter(range(10**6))

    def pulled() -> float:
        store = space.path(f"pulled-{next(serial)}", ".bt")  # type: ignore[attr-defined]
        return space.run_bt("run", plan, "--progress", "off", "--remote", f"{remote}/hits", store=store)[0]  # type: ignore[attr-defined]

    runs = alternate(
        [
            ("pulled", pulled),
            ("null", lambda: space.run_bt("run", plan, "--progress", "off", store=built)[0]),
        ],  # type: ignore[attr-defined]
        count,
    )
    # Training times move by 10-20% between rounds on a shared machine: more rounds, and each
    # round's own ratio (the two contenders ran back to back), whose median cancels the drift.
    trains = alternate(
        [
            ("local", lambda: train_seconds(space, preset, next(serial), None)),
            ("remote", lambda: train_seconds(space, preset, next(serial), f"{remote}/train")),
        ],
        2 * count + 1,
    )
    local, pushed = median(trains["local"]), median(trains["remote"])
    paired = sorted(r / loc - 1 for loc, r in zip(trains["local"], trains["remote"], strict=True))
    print_table(
        f"bt run against the remote (micro, {steps} updates, a checkpoint every 4), medians of {count} "
        f"rounds (training: {2 * count + 1})",
        ["what", "median", "spread"],
        [
            [
                "bt run, every step pulled (fresh store)",
                fmt_seconds(median(runs["pulled"])),
                fmt_spread(runs["pulled"]),
            ],
            ["bt run, local null build", fmt_seconds(median(runs["null"])), fmt_spread(runs["null"])],
            ["train step, no remote", fmt_seconds(local), fmt_spread(trains["local"])],
            ["train step, remote (checkpoints pushed)", fmt_seconds(pushed), fmt_spread(trains["remote"])],
        ],
    )
    overhead = median(paired)
    spread = f"{overhead:+.1%}, each round's {paired[0]:+.1%}..{paired[-1]:+.1%}; medians {pushed / local - 1:+.1%}"
    print_goals([goal_line(f"push overhead on training <= {PUSH_GOAL:.0%}", overhead <= PUSH_GOAL, spread)])


def main() -> None:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    total_mb = 32 if args.quick else 128
    count = rounds(args, quick=3, full=5)
    with workspace("remote", args) as space:
        space.import_buildtrain()
        from buildtrain.store.remote.remote import Remote
        from buildtrain.store.store import Store

        print_header("bt remote: pull throughput against the client library's raw download", args, space)
        source = Store(space.path("source", ".bt"))
        make_output(source, total_mb)
        built, plan, step = train_output(space)
        size = fmt_bytes(total_mb << 20)
        files, trains = [], []
        # The server stands in for one elsewhere: at nice 19 it takes no core that training wants
        # on this machine, which a real remote never does (the push overhead is the client's).
        with seaweed.running(space.path("seaweed"), niceness=19) as server:
            os.environ.update(server.env())
            s3 = Remote.open(server.url("bench"))
            files.append(measure("s3 (SeaweedFS)", s3, source, STEP, space, count, files_pull(s3)))
            pull_into = checked_pull(s3.url, plan, step)
            trains.append(measure("s3 (SeaweedFS)", s3, built, step.hash, space, count, pull_into))  # type: ignore[attr-defined]
            measure_runs(space, server.url("runs"), count, args.quick)
        folder = space.path("shared")
        folder.mkdir()
        shared = Remote.open(f"file://{folder}")
        files.append(
            measure("file:// (shared folder)", shared, source, STEP, space, count, files_pull(shared))
        )
        pull_into = checked_pull(shared.url, plan, step)
        trains.append(measure("file:// (shared folder)", shared, built, step.hash, space, count, pull_into))  # type: ignore[attr-defined]
        headers = ["remote", "raw download", "spread", "pull (checked)", "spread", "of medians", "raw / pull"]
        print_table(
            f"pull of a {size} step output ({total_mb // FILE_MB} random files, hashed), medians of "
            f"{PULL_ROUNDS * count} alternated rounds; raw / pull: the median of each round's own ratio",
            headers,
            files,
        )
        print_table(
            "checked pull of a train step's output as bt run pulls it (every digest re-derived), "
            f"{fmt_bytes(tree_bytes(built.outputs.path(step.hash)))}, medians of {PULL_ROUNDS * count} "  # type: ignore[attr-defined]
            "alternated rounds; raw / pull: the median of each round's own ratio",
            headers,
            trains,
        )
        print_goals(
            [
                goal_line(f"{what}, {row[0]}: pull >= {GOAL}x the raw download's speed", r >= GOAL, row[-1])
                for what, rows in (("random files", files), ("train output", trains))
                for row, r in zip(rows, [float(row[-1].rstrip("x")) for row in rows], strict=True)
            ]
        )


def tree_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


if __name__ == "__main__":
    main()
