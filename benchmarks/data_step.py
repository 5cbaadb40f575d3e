"""The byte data step against reading and blake3-hashing the same bytes, and against the least
any byte data step must do with them.

Writes a plain-text corpus (lines of generated words; 80 MB, `--quick` 40 MB), then alternates,
in this process and on a warm page cache:

- read + blake3: the file read in 1 MB chunks and hashed, single-threaded: the least work any
  step that checks its source against the plan must do;
- floor: that, and the bytes widened to uint16 tokens in shards of 1M tokens, each shard written
  to a file and hashed: the least work of a step that also trusts nothing it writes, whatever
  its split and bookkeeping (it writes and hashes twice the bytes it reads);
- data step: `buildtrain.steps.data.step.build` with the file as a checked `Source` (read, hashed and
  refused if it changed), 1,024-token split blocks, 5% held out, shards of 1M tokens: widen to
  uint16 tokens, split, write and hash the shards, write the index;
- data step, no n-grams: the same without the n-gram filter of the contamination check
  (`steps/ngrams.py`; goal: the data step at most 1.15x this, issue 46).

Prints the medians, their spread and the ratios of throughputs (goals: data step >= 0.5x read +
blake3, the issue's; >= 0.75x the floor, what is left once the writing and hashing that the output
needs are counted) and, with `--profile`, the functions that took the data step's time (cProfile,
one run).

Run: python benchmarks/data_step.py [--quick] [--megabytes N] [--profile]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CHUNK = 1 << 20
SHARD_TOKENS = 1 << 20


class Log:
    def info(self, *_: Any, **__: Any) -> None:
        pass


def write_corpus(path: Path, megabytes: int) -> None:
    """Lines of 4-16 words from a vocabulary of 2,000, in blocks of 64 KB written at once."""
    rng = random.Random(0)
    words = [f"{rng.choice('bcdfghklmnprstvz')}{rng.choice('aeiou')}{i}" for i in range(2000)]
    with open(path, "wb") as handle:
        written = 0
        while written < megabytes * 1_000_000:
            lines = [" ".join(rng.choices(words, k=rng.randrange(4, 17))) for _ in range(2000)]
            block = ("\n".join(lines) + "\n").encode() * 8  # repeated: generation is not measured
            handle.write(block)
            written += len(block)


def read_and_hash(path: Path) -> float:
    import blake3

    started = time.perf_counter()
    hasher = blake3.blake3()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            hasher.update(chunk)
    hasher.hexdigest()
    return time.perf_counter() - started


def floor(path: Path, out: Path) -> float:
    """Read and hash the text, widen it into shards of 1M uint16 tokens, write and hash each."""
    import blake3
    import numpy as np

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    started = time.perf_counter()
    source, shard, filled, shards = blake3.blake3(), np.empty(SHARD_TOKENS, dtype="<u2"), 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            source.update(chunk)
            tokens = np.frombuffer(chunk, dtype=np.uint8)
            while len(tokens):
                take = min(SHARD_TOKENS - filled, len(tokens))
                shard[filled : filled + take] = tokens[:take]
                filled, tokens = filled + take, tokens[take:]
                if filled == SHARD_TOKENS:
                    shards = write_shard(out, shards, shard)
                    filled = 0
    write_shard(out, shards, shard[:filled])
    source.hexdigest()
    return time.perf_counter() - started


def write_shard(out: Path, number: int, tokens: Any) -> int:
    import blake3

    raw = tokens.data.cast("B")
    (out / f"{number:05d}.bin").write_bytes(raw)
    blake3.blake3(raw).hexdigest()
    return number + 1


def data_step(space: common.Workspace, source: Any, out: Path, ngrams: bool = True) -> float:
    from buildtrain.config.steps import DataStep
    from buildtrain.steps.data import step as data

    config = {
        "source": "files",
        "split_block": 1024,
        "heldout_fraction": 0.05,
        "split_seed": 0,
        "shard_tokens": SHARD_TOKENS,
        "tokenizer": "bytes",
    }
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    started = time.perf_counter()
    data.build(DataStep.from_config({"data": config}), [source], out, Log(), ngrams=ngrams)
    return time.perf_counter() - started


def profile(space: common.Workspace, source: Any, out: Path) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    data_step(space, source, out)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    print("\ndata step, cProfile by own time (one run):")
    print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--megabytes", type=int, help="corpus size in MB (default 80, --quick 40)")
    parser.add_argument("--profile", action="store_true", help="also profile one data step run")
    args = parser.parse_args()
    megabytes = args.megabytes or (40 if args.quick else 80)
    with common.workspace("data-step", args) as space:
        common.print_header("byte data step vs read + blake3", args, space)
        space.import_buildtrain()
        from buildtrain.sources.stat_cache import hash_regular
        from buildtrain.steps.sources import Source

        corpus = space.path("corpus.txt")
        write_corpus(corpus, megabytes)
        digest, size = hash_regular(corpus)
        source = Source(path=corpus, blake3=digest, size=size)
        out = space.path("out")
        contenders = [
            ("read + blake3", lambda: read_and_hash(corpus)),
            ("floor", lambda: floor(corpus, out)),
            ("data step", lambda: data_step(space, source, out)),
            ("data step, no n-grams", lambda: data_step(space, source, out, ngrams=False)),
        ]
        results = common.alternate(contenders, common.rounds(args, 5, 9))
        base, step = common.median(results["read + blake3"]), common.median(results["data step"])
        least = common.median(results["floor"])
        rows = [
            (
                name,
                common.fmt_seconds(common.median(times)),
                common.fmt_spread(times),
                f"{size / common.median(times) / 1e6:.0f}",
            )
            for name, times in results.items()
        ]
        common.print_table(
            f"{common.fmt_bytes(size)} of text, medians of alternated rounds",
            ["", "median", "spread", "MB/s"],
            rows,
        )
        ratio, of_floor = common.ratio(base, step), common.ratio(least, step)
        cost = step / common.median(results["data step, no n-grams"])
        common.print_goals(
            [
                common.goal_line("data step >= 0.5x read + blake3", ratio >= 0.5, common.fmt_ratio(ratio)),
                common.goal_line(
                    "data step >= 0.75x the floor", of_floor >= 0.75, common.fmt_ratio(of_floor)
                ),
                common.goal_line(
                    "n-grams: data step <= 1.15x its time without", cost <= 1.15, f"{cost:.2f}x"
                ),
            ]
        )
        print(common.machine_line())
        if args.profile:
            profile(space, source, out)


if __name__ == "__main__":
    main()
