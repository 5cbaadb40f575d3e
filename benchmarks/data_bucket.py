"""Data files in a bucket: what hashing at plan time and the checked fetch at run time cost.

Puts one object of random bytes (256 MB; `--quick`: 64 MB) into a SeaweedFS started for the run
(127.0.0.1, stopped by pid at the end), then alternates, per round:

- plan: `bucket_sources.digest` with an empty stat cache (the object streamed and hashed, nothing
  written) against the client library's own streamed read of the same object, discarded;
- fetch: `source_cache.fetch` into a fresh store (streamed, hashed as written, fsynced, renamed
  into `cache/sources/`) against the library's streamed read into a plain file (no hash, no fsync).

Reports medians and the ratio raw time / buildtrain's time (goal: >= 0.8x), and the cost of planning
again with the object unchanged (the stat cache's ETag hint: one HEAD, nothing read).

Run: python benchmarks/data_bucket.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    REPO,
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

sys.path.insert(0, str(REPO / "tests"))
import seaweed  # noqa: E402  (the tests' SeaweedFS helper: free ports, 127.0.0.1, stop by pid)

GOAL = 0.8
KEY = "bench/corpus.bin"


def raw_read(bucket: object, into: Path | None) -> float:
    """The library's streamed read of the object, into a plain file or discarded."""
    import obstore

    from buildtrain.sources.s3_settings import CHUNK

    start = time.perf_counter()
    pieces = obstore.get(bucket.client.store, KEY).stream(min_chunk_size=CHUNK)  # type: ignore[attr-defined]
    if into is None:
        for _ in pieces:
            pass
    else:
        with open(into, "wb") as out:
            for piece in pieces:
                out.write(piece)
    return time.perf_counter() - start


def timed(function: object, *args: object) -> float:
    start = time.perf_counter()
    function(*args)  # type: ignore[operator]
    return time.perf_counter() - start


def measure(space: object, size_mb: int, count: int) -> None:
    from buildtrain.sources import bucket_sources
    from buildtrain.sources.stat_cache import StatCache
    from buildtrain.store import source_cache
    from buildtrain.store.store import Store

    bucket = bucket_sources.bucket_client(seaweed.BUCKET)
    import obstore

    note(f"putting {size_mb} MB")
    obstore.put(bucket.client.store, KEY, os.urandom(size_mb << 20))
    version = bucket.version(KEY)
    serial = iter(range(10**6))
    source = bucket_sources.digest(StatCache(space.path("warm.json")), version)  # type: ignore[attr-defined]
    plans = alternate(
        [
            ("raw", lambda: raw_read(bucket, None)),
            (
                "plan",
                lambda: timed(
                    bucket_sources.digest,
                    StatCache(space.path(f"c-{next(serial)}.json")),
                    version,  # type: ignore[attr-defined]
                ),
            ),
        ],
        count,
    )
    fetches = alternate(
        [
            ("raw", lambda: raw_read(bucket, space.path(f"raw-{next(serial)}.bin"))),  # type: ignore[attr-defined]
            (
                "fetch",
                lambda: timed(
                    source_cache.fetch,
                    Store(space.path(f"s-{next(serial)}", ".bt")),
                    source,
                    bucket.url_of(KEY),  # type: ignore[attr-defined]
                ),
            ),
        ],
        count,
    )
    warm = StatCache(space.path("warm.json"))  # type: ignore[attr-defined]
    bucket_sources.digest(warm, version)
    again = alternate(
        [("again", lambda: timed(lambda: bucket_sources.digest(warm, bucket.version(KEY))))], count
    )
    rows = []
    for name, times, ours in (
        ("plan (hash)", plans, "plan"),
        ("fetch (hash, write, fsync)", fetches, "fetch"),
    ):
        raw, mine = median(times["raw"]), median(times[ours])
        rows.append(
            [
                name,
                fmt_seconds(raw),
                fmt_spread(times["raw"]),
                fmt_seconds(mine),
                fmt_spread(times[ours]),
                fmt_ratio(ratio(raw, mine)),
            ]
        )
    print_table(
        f"one {size_mb} MB object from SeaweedFS, medians of {count} alternated rounds",
        ["what", "raw read", "spread", "buildtrain", "spread", "raw / buildtrain"],
        rows,
    )
    print_table(
        "planning again, object unchanged (HEAD + stat cache hint)",
        ["what", "median", "spread"],
        [["re-plan one object", fmt_seconds(median(again["again"])), fmt_spread(again["again"])]],
    )
    print_goals(
        [
            goal_line(
                f"{row[0]} >= {GOAL}x of a raw read", ratio(median(t["raw"]), median(t[o])) >= GOAL, row[-1]
            )
            for row, t, o in ((rows[0], plans, "plan"), (rows[1], fetches, "fetch"))
        ]
    )


def main() -> None:
    args = make_parser(__doc__).parse_args()
    size_mb = 64 if args.quick else 256
    count = rounds(args, 3, 5)
    with workspace("data-bucket", args) as space:
        print_header("data files in a bucket", args, space)
        with seaweed.running(space.path("seaweed")) as server:
            os.environ.update(server.env())
            measure(space, size_mb, count)


if __name__ == "__main__":
    main()
