"""Pull throughput from a remote: `Remote.pull_output` against the client library's own download.

Seals a step output of random files (128 MB in 4 MB files; `--quick`: 32 MB) in a local store,
pushes it to a SeaweedFS started for the run (127.0.0.1, stopped by pid at the end) and to a
shared folder, then alternates, per round: a pull into a fresh store (download on 8 threads, every
piece hashed as it is written, each file fsynced, the assembled folder re-hashed by
`objects.verify`, renamed into place), and the raw download of the same blobs with the same
library on the same 8 threads into plain files (obstore `get` for S3, a file copy for the folder;
no hashing, no fsync). Reports medians and the ratio raw time / pull time (goal: >= 0.8x).

Then, with `bt` itself against the same SeaweedFS: the wall time of a `bt run` whose every step is
pulled from the remote (a fresh store) against a local null build of the same plan; and the train
step's time with a remote (checkpoints pushed as it trains, lease held, output pushed) against
the same training without one, each in a fresh store and a fresh prefix (goal: <= 5% more).

Run: python benchmarks/remote.py [--quick]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
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
PUSH_GOAL = 0.05


def make_output(store: object, total_mb: int) -> None:
    """A sealed step output of random 4 MB files under `store.output(STEP)`."""
    from buildtrain.store import objects

    folder = store.new_temp("bench")  # type: ignore[attr-defined]
    for index in range(total_mb // FILE_MB):
        (folder / f"shard-{index:03d}.bin").write_bytes(os.urandom(FILE_MB << 20))
    objects.publish(folder, store.output(STEP))  # type: ignore[attr-defined]


def raw_download(remote: object, blobs: list[str], into: Path) -> float:
    """The library's own download of every blob into plain files, on the pull's thread count."""
    from buildtrain.store.remote import keys
    from buildtrain.store.remote.remote import TRANSFERS

    backend = remote.backend  # type: ignore[attr-defined]
    into.mkdir(parents=True)
    if backend.url.scheme == "s3":
        import obstore

        def one(blob: str) -> None:
            (into / blob).write_bytes(obstore.get(backend.store, keys.blob(blob)).bytes())
    else:

        def one(blob: str) -> None:
            shutil.copyfile(backend.root / keys.blob(blob), into / blob)

    started = time.perf_counter()
    with ThreadPoolExecutor(TRANSFERS) as pool:
        list(pool.map(one, blobs))
    elapsed = time.perf_counter() - started
    shutil.rmtree(into)
    return elapsed


def pull(remote: object, store_root: Path) -> float:
    from buildtrain.store.store import Store

    store = Store(store_root)
    started = time.perf_counter()
    remote.pull_output(store, STEP)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - started
    shutil.rmtree(store_root)
    return elapsed


def measure(name: str, remote: object, source: object, space: object, count: int) -> list[object]:
    from buildtrain.store import objects

    note(f"{name}: pushing")
    remote.push_output(source, STEP)  # type: ignore[attr-defined]
    blobs = sorted({e["blake3"] for e in objects.read_manifest(source.output(STEP))["files"].values()})  # type: ignore[attr-defined]
    serial = iter(range(10**6))
    times = alternate(
        [
            ("raw", lambda: raw_download(remote, blobs, space.path(f"raw-{next(serial)}"))),  # type: ignore[attr-defined]
            ("pull", lambda: pull(remote, space.path(f"pull-{next(serial)}", ".bt"))),  # type: ignore[attr-defined]
        ],
        count,
    )
    raw, pulled = median(times["raw"]), median(times["pull"])
    return [
        name,
        fmt_seconds(raw),
        fmt_spread(times["raw"]),
        fmt_seconds(pulled),
        fmt_spread(times["pull"]),
        fmt_ratio(ratio(raw, pulled)),
    ]


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
    trains = alternate(
        [
            ("local", lambda: train_seconds(space, preset, next(serial), None)),
            ("remote", lambda: train_seconds(space, preset, next(serial), f"{remote}/train")),
        ],
        count,
    )
    local, pushed = median(trains["local"]), median(trains["remote"])
    print_table(
        f"bt run against the remote (micro, {steps} updates, a checkpoint every 4), medians of {count} rounds",
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
    overhead = pushed / local - 1
    print_goals(
        [
            goal_line(
                f"push overhead on training <= {PUSH_GOAL:.0%}", overhead <= PUSH_GOAL, f"{overhead:+.1%}"
            )
        ]
    )


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
        size = fmt_bytes(total_mb << 20)
        rows = []
        with seaweed.running(space.path("seaweed")) as server:
            os.environ.update(server.env())
            rows.append(measure("s3 (SeaweedFS)", Remote.open(server.url("bench")), source, space, count))
            measure_runs(space, server.url("runs"), count, args.quick)
        folder = space.path("shared")
        folder.mkdir()
        rows.append(measure("file:// (shared folder)", Remote.open(f"file://{folder}"), source, space, count))
        print_table(
            f"pull of a {size} step output ({total_mb // FILE_MB} files), medians of {count} alternated rounds",
            ["remote", "raw download", "spread", "pull (checked)", "spread", "raw / pull"],
            rows,
        )
        ratios = [float(row[-1].rstrip("x")) for row in rows]
        print_goals(
            [
                goal_line(f"{row[0]}: pull >= {GOAL}x the raw download's speed", r >= GOAL, row[-1])
                for row, r in zip(rows, ratios, strict=True)
            ]
        )


if __name__ == "__main__":
    main()
