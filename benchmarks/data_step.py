"""The data step against reading and blake3-hashing the same bytes, and the ngrams step (the
contamination check's n-gram filters, issue 46) against the data step, on the same text.

Writes a plain-text corpus (lines of generated words; 80 MB, `--quick` 40 MB), then alternates,
in this process and on a warm page cache:

- read + blake3: the file read in 1 MB chunks and hashed, single-threaded: the least work any
  step that checks its source against the plan must do;
- floor: that, and the bytes widened to uint16 tokens in shards of 1M tokens, each shard written
  to a file and hashed: the least work of a step that also trusts nothing it writes, whatever
  its split and bookkeeping (it writes and hashes twice the bytes it reads);
- data step: `buildtrain.steps.data.step.build` with the file as a checked `Source` (read, hashed and
  refused if it changed), 1,024-token split blocks, 5% held out, shards of 1M tokens: widen to
  uint16 tokens, split, write and hash the shards, write the index. It records no n-gram filter
  (since issue 46's move: 1.0x by construction; with the filter inline it took 4.2x);
- ngrams step: `buildtrain.steps.ngrams.step.record` over the same file, 13-grams (what a plan
  with a suite adds, in a step of its own that training does not wait for).

Then the BPE path (skip with `--bytes-only`): a JSONL corpus of the same size (generated prose,
`bpe_data_step.py`'s), an 8,192-token BPE trained on its first 4 MB, and the data step with it
alternated with the ngrams step over the same JSONL.

Then end to end (skip with `--no-run`): `bt run` of presets/tiny.toml reading the plain-text
corpus, without a suite and with one (tests/suites/arithmetic.jsonl), each from an empty store,
alternated. With a suite the plan holds the ngrams step, which the local engine builds beside
training on the second core (its time, read from the run's events, is printed), and the eval
step scores the suite.

Prints medians, spreads and ratios (goals: data step >= 0.5x read + blake3; >= 0.75x the floor;
issue 46's, the data step with n-gram recording <= 1.15x its time without: met by construction
now that the recording is the ngrams step's). With `--profile`, the data step's functions (cProfile).

Run: python benchmarks/data_step.py [--quick] [--megabytes N] [--bytes-only] [--no-run] [--profile]
"""

from __future__ import annotations

import cProfile
import io
import json
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
TEXT = {"split_block": 1024, "heldout_fraction": 0.05, "split_seed": 0}


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

    fresh(out)
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


def fresh(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()


def data_step(source: Any, out: Path, tokenizer: Path | None = None) -> float:
    """The data step over `source` (plain text with bytes; JSONL with a tokenizer folder)."""
    from buildtrain.steps.data import step as data

    config: dict[str, Any] = {"source": "files", **TEXT, "shard_tokens": SHARD_TOKENS, "tokenizer": "bytes"}
    if tokenizer is not None:
        config.update(format="jsonl", text_field="text")
        config["tokenizer"] = {"kind": "file", "end_of_document": "<|endoftext|>"}
    fresh(out)
    started = time.perf_counter()
    data.build_from_plan({"data": config}, [source], out, Log(), tokenizer)
    return time.perf_counter() - started


def ngrams_step(source: Any, out: Path, jsonl: bool = False) -> float:
    """The ngrams step over `source`: one filter of 13-grams, as a plan with one suite has it."""
    from buildtrain.config.steps import NgramsStep, TextSettings
    from buildtrain.steps.ngrams.step import record

    extra = {"format": "jsonl", "text_field": "text"} if jsonl else {}
    text = TextSettings.from_config({"source": "files", **TEXT, **extra})
    fresh(out)
    started = time.perf_counter()
    record(NgramsStep(text=text, ngrams=(13,)), [source], out, Log())
    return time.perf_counter() - started


def checked(path: Path) -> Any:
    from buildtrain.sources.stat_cache import hash_regular
    from buildtrain.steps.sources import Source

    digest, size = hash_regular(path)
    return Source(path=path, blake3=digest, size=size)


def table(title: str, results: dict[str, list[float]], size: int) -> None:
    rows = [
        (
            name,
            common.fmt_seconds(common.median(t)),
            common.fmt_spread(t),
            f"{size / common.median(t) / 1e6:.0f}",
        )
        for name, t in results.items()
    ]
    common.print_table(title, ["", "median", "spread", "MB/s"], rows)


def byte_path(space: common.Workspace, megabytes: int, rounds: int) -> tuple[Any, dict[str, list[float]]]:
    corpus = space.path("corpus.txt")
    write_corpus(corpus, megabytes)
    source, out = checked(corpus), space.path("out")
    contenders = [
        ("read + blake3", lambda: read_and_hash(corpus)),
        ("floor", lambda: floor(corpus, out)),
        ("data step", lambda: data_step(source, out)),
        ("ngrams step", lambda: ngrams_step(source, space.path("ngrams"))),
    ]
    results = common.alternate(contenders, rounds)
    table(
        f"byte path: {common.fmt_bytes(source.size)} of text, medians of alternated rounds",
        results,
        source.size,
    )
    return source, results


def bpe_path(space: common.Workspace, megabytes: int, rounds: int) -> dict[str, list[float]]:
    import bpe_data_step

    corpus, tokenizer = space.path("corpus.jsonl"), space.path("tokenizer")
    text_bytes = bpe_data_step.write_corpus(corpus, megabytes)
    bpe_data_step.train_tokenizer(corpus, tokenizer)
    source, out = checked(corpus), space.path("out")
    contenders = [
        ("data step (BPE)", lambda: data_step(source, out, tokenizer)),
        ("ngrams step (JSONL)", lambda: ngrams_step(source, space.path("ngrams"), jsonl=True)),
    ]
    results = common.alternate(contenders, rounds)
    table(
        f"BPE path: {common.fmt_bytes(text_bytes)} of text in JSONL, medians of alternated rounds",
        results,
        text_bytes,
    )
    return results


def preset(space: common.Workspace, corpus: Path, suite: bool) -> Path:
    path = space.path(f"{'suite' if suite else 'plain'}.toml")
    text = f'extends = "{common.TINY}"\n\n[data]\nsource = "files"\nfiles = ["{corpus}"]\n'
    if suite:
        text += '\n[eval]\nsuites = [{ name = "arith", file = "arithmetic.jsonl" }]\n'
    path.write_text(text)
    return path


def beside_seconds(records: Path) -> tuple[float, float] | None:
    """(when the ngrams step's output was published, when training ended), in seconds after
    the train step started, from the run's events."""
    from datetime import datetime

    def at(event: dict[str, Any]) -> float:
        return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()

    events = [e for e in common.record_events(records) if "timestamp" in e]
    train = [e for e in events if str(e.get("step", "")).startswith("train:")]
    started = [e for e in train if e.get("event") == "step_started"]
    ended = [e for e in train if e.get("event") == "step_finished"]
    done = [
        e for e in events if e.get("event") == "step_done" and str(e.get("label", "")).startswith("ngrams:")
    ]
    if not started or not ended or not done:
        return None
    return at(done[0]) - at(started[0]), at(ended[0]) - at(started[0])


def end_to_end(space: common.Workspace, corpus: Path, rounds: int) -> None:
    shutil.copyfile(common.REPO / "tests" / "suites" / "arithmetic.jsonl", space.path("arithmetic.jsonl"))
    counter, beside, weights = iter(range(10**6)), [], set()
    steps: dict[tuple[bool, str], list[float]] = {}  # (with a suite, step kind): durations

    def run(suite: bool) -> float:
        index = next(counter)
        store, records = space.path(f"store-{index}"), space.path(f"records-{index}")
        seconds, _ = space.run_bt(
            "run", str(preset(space, corpus, suite)), "--progress", "off", store=store, experiments=records
        )
        if suite and (found := beside_seconds(records)) is not None:
            beside.append(found)
        for event in common.record_events(records):
            if event.get("event") == "step_finished":
                kind = str(event["step"]).split(":")[0]
                steps.setdefault((suite, kind), []).append(float(event["duration_s"]))
        for manifest in store.glob("steps/*/MANIFEST.json"):
            digests = json.loads(manifest.read_text()).get("digests", {})
            weights.add(digests["weights"]) if "state" in digests else None
        shutil.rmtree(store)
        return seconds

    results = common.alternate(
        [("without a suite", lambda: run(False)), ("with a suite", lambda: run(True))], rounds
    )
    base = common.median(results["without a suite"])
    common.print_table(
        "bt run of tiny on the plain-text corpus, from an empty store (medians, alternated)",
        ["", "median", "spread", "vs without"],
        [
            (
                name,
                common.fmt_seconds(common.median(t)),
                common.fmt_spread(t),
                common.fmt_ratio(common.median(t) / base),
            )
            for name, t in results.items()
        ],
    )
    if beside:
        ready, trained = (common.median([b[i] for b in beside]) for i in (0, 1))
        common.note(
            f"  with a suite, the ngrams step's output was published {common.fmt_seconds(ready)} after training "
            f"started, which took {common.fmt_seconds(trained)} (medians): "
            + ("hidden behind training" if ready < trained else "training ended first")
        )
    for kind in ("data", "train", "ngrams", "eval"):
        found = [
            common.median(steps[(suite, kind)]) if (suite, kind) in steps else None for suite in (False, True)
        ]
        shown = ["-" if f is None else common.fmt_seconds(f) for f in found]
        common.note(f"  {kind} step as the run saw it (median): without a suite {shown[0]}, with {shown[1]}")
    common.note(f"  train weights digests: {sorted(w[:12] for w in weights)} (one: the suite changes no bit)")


def profile(source: Any, out: Path) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    data_step(source, out)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    print("\ndata step, cProfile by own time (one run):")
    print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--megabytes", type=int, help="corpus size in MB (default 80, --quick 40)")
    parser.add_argument("--bytes-only", action="store_true", help="skip the BPE path")
    parser.add_argument("--no-run", action="store_true", help="skip the end-to-end bt run")
    parser.add_argument("--profile", action="store_true", help="also profile one data step run")
    args = parser.parse_args()
    megabytes = args.megabytes or (40 if args.quick else 80)
    with common.workspace("data-step", args) as space:
        common.print_header("data step and ngrams step vs read + blake3", args, space)
        space.import_buildtrain()
        source, results = byte_path(space, megabytes, common.rounds(args, 5, 9))
        median = {name: common.median(times) for name, times in results.items()}
        step, ngrams = median["data step"], median["ngrams step"]
        lines = [
            common.goal_line(
                "data step >= 0.5x read + blake3",
                median["read + blake3"] / step >= 0.5,
                common.fmt_ratio(median["read + blake3"] / step),
            ),
            common.goal_line(
                "data step >= 0.75x the floor",
                median["floor"] / step >= 0.75,
                common.fmt_ratio(median["floor"] / step),
            ),
            common.goal_line(
                "n-grams: data step <= 1.15x its time without", True, "1.00x (recorded by the ngrams step)"
            ),
        ]
        common.note(
            f"byte path: ngrams step / data step {ngrams / step:.2f}x; data + ngrams, one after the other: {(step + ngrams) / step:.2f}x the data step"
        )
        if not args.bytes_only:
            bpe = {
                name: common.median(t)
                for name, t in bpe_path(space, megabytes, common.rounds(args, 2, 3)).items()
            }
            encoded, recorded = bpe["data step (BPE)"], bpe["ngrams step (JSONL)"]
            common.note(
                f"BPE path: ngrams step / data step {recorded / encoded:.2f}x; one after the other {(encoded + recorded) / encoded:.2f}x"
            )
        common.print_goals(lines)
        if not args.no_run:
            end_to_end(space, source.path, common.rounds(args, 2, 3))
        print(common.machine_line())
        if args.profile:
            profile(source, space.path("out"))


if __name__ == "__main__":
    main()
