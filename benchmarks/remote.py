"""Pull throughput from a remote: `Remote.pull_output` against the client library's own download.

Seals a step output of random files (128 MB in 4 MB files; `--quick`: 32 MB) in a local store,
pushes it to a SeaweedFS started for the run (127.0.0.1, stopped by pid at the end) and to a
shared folder, then alternates, per round: a pull into a fresh store (download on 8 threads, every
piece hashed as it is written, each file fsynced, the assembled folder re-hashed by
`objects.verify`, renamed into place), and the raw download of the same blobs with the same
library on the same 8 threads into plain files (obstore `get` for S3, a file copy for the folder;
no hashing, no fsync). Reports medians and the ratio raw time / pull time (goal: >= 0.8x).

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
