"""Tokenizing a JSONL corpus: buildtrain's data step against the tokenizer library's own batch encode.

Writes a JSONL corpus of generated prose (documents of 0.5-4 KB), trains a byte-level BPE of
8,192 tokens on its first 4 MB with the tokenizer step's own settings, then at each corpus size runs,
side by side and each in a fresh process:

- library: the whole text already in memory as a list of strings (no reading, no splitting, no
  writing), encoded with `Tokenizer.encode_batch_fast` in batches of 4 MB of text (as the data step
  batches) and then in one call over the whole list; the ratio is taken against the faster of the
  two;
- data step: `buildtrain.steps.data.step.build` with that tokenizer: read the JSONL line by line, cut
  and split the text, encode in batches, write uint16 shards and the index;
- ngrams step: the contamination check's 13-gram filter of the same JSONL (`steps/ngrams/`), a
  step of its own since issue 46 (the data step records none; with it inline the data step took
  1.16x its time here).

Prints wall time, throughput (MB of text per second), the ratio (goal: data step >= 0.8x the
library's throughput) and each process's peak resident memory (goal: the data step's bounded,
independent of corpus size; the library's holds the corpus and its ids).

Each size runs the two side by side in alternated rounds (`--rounds`, default 3) and reports
medians, and the data step's time per MB at the largest size over the smallest (1.00: linear).

Run: python benchmarks/bpe_data_step.py [--sizes 25,100] [--rounds N] (MB of JSONL)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "from",
    "have",
    "or",
    "by",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "tokenizer",
    "gradient",
    "checkpoint",
    "reproducible",
    "deterministic",
]

LIBRARY = """
import json, sys, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(line)["text"] for line in open(sys.argv[2], encoding="utf-8")]
start = time.perf_counter()
batched, batch, size = 0, [], 0
for text in texts:  # the same texts in batches of 4 MB, as the data step sizes them
    batch.append(text)
    size += len(text)
    if size >= 4 << 20:
        batched += sum(len(e.ids) for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
        batch, size = [], 0
batched += sum(len(e.ids) for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
middle = time.perf_counter()
encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
tokens = sum(len(e.ids) for e in encodings)
assert tokens == batched
print(json.dumps({"batched": middle - start, "seconds": time.perf_counter() - middle, "tokens": tokens}))
"""

DATA_STEP = """
import json, sys, time
from pathlib import Path
from buildtrain.steps.data import step as data
class Log:
    def info(self, *a, **k): pass
config = {"source": "files", "format": "jsonl", "text_field": "text", "split_block": 1024,
          "heldout_fraction": 0.05, "split_seed": 0, "shard_tokens": 1 << 20,
          "tokenizer": {"kind": "file", "end_of_document": "<|endoftext|>"}}
start = time.perf_counter()
data.build_from_plan({"data": config}, [Path(sys.argv[2])], Path(sys.argv[3]), Log(), Path(sys.argv[1]))
index = json.loads((Path(sys.argv[3]) / "data.json").read_bytes())
tokens = sum(split["tokens"] for split in index["splits"].values()) - index["documents"]  # no EODs
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""
# The ngrams step over the same JSONL (one filter of 13-grams, as a plan with one suite records).
NGRAMS_STEP = """
import json, sys, time
from pathlib import Path
from buildtrain.config.steps import NgramsStep, TextSettings
from buildtrain.steps.ngrams.step import record
class Log:
    def info(self, *a, **k): pass
text = TextSettings.from_config({"source": "files", "format": "jsonl", "text_field": "text",
                                 "split_block": 1024, "heldout_fraction": 0.05, "split_seed": 0})
start = time.perf_counter()
record(NgramsStep(text=text, ngrams=(13,)), [Path(sys.argv[2])], Path(sys.argv[3]), Log())
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """JSONL of generated documents; returns the bytes of text (UTF-8) it holds."""
    rng = random.Random(seed)
    text_bytes, target = 0, megabytes << 20
    with open(path, "w", encoding="utf-8") as handle:
        while text_bytes < target:  # the JSONL is a little larger than its text
            sentences = []
            for _ in range(rng.randrange(8, 60)):
                words = [rng.choice(WORDS) for _ in range(rng.randrange(4, 16))]
                sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
            text = " ".join(sentences) + ("\n\n" if rng.random() < 0.3 else "")
            handle.write(json.dumps({"id": text_bytes, "text": text}) + "\n")
            text_bytes += len(text.encode("utf-8"))
    return text_bytes


def train_tokenizer(corpus: Path, folder: Path) -> None:
    from tokenizers import pre_tokenizers, trainers

    from buildtrain.canonical import canonical_bytes
    from buildtrain.steps.tokenizer.files import DESCRIPTION, TOKENIZER
    from buildtrain.steps.tokenizer.step import describe, new_bpe

    texts, size = [], 0
    with open(corpus, encoding="utf-8") as handle:
        for line in handle:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size > 4 << 20:
                break
    tokenizer = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    folder.mkdir()
    (folder / TOKENIZER).write_text(tokenizer.to_str(), encoding="utf-8")
    (folder / DESCRIPTION).write_bytes(canonical_bytes(describe(tokenizer, "file", "<|endoftext|>")))


def run(script: str, *args: str) -> tuple[dict, int]:
    """Run `script` in a fresh process: its JSON result and its own peak RSS in bytes (wait4)."""
    process = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise SystemExit(f"benchmark process failed (status {status})")
    return json.loads(output), usage.ru_maxrss * 1024


def measure(root: Path, size: int, rounds: int) -> tuple[int, dict, int, dict, int]:
    """Library and data step alternated `rounds` times on one corpus: the medians of their times
    (the library's faster way per round), the text size, and each one's peak RSS."""
    corpus = root / f"corpus-{size}.jsonl"
    text_bytes = write_corpus(corpus, size)
    tokenizer = root / "tokenizer"
    if not tokenizer.exists():
        train_tokenizer(corpus, tokenizer)
    seen: dict[str, tuple[dict, int]] = {}

    def library() -> float:
        seen["library"] = run(LIBRARY, str(tokenizer / "tokenizer.json"), str(corpus))
        return min(seen["library"][0]["batched"], seen["library"][0]["seconds"])

    def step(script: str = DATA_STEP, name: str = "step") -> float:
        out = root / f"out-{size}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        seen[name] = run(script, str(tokenizer), str(corpus), str(out))
        return seen[name][0]["seconds"]

    contenders = [
        ("library", library),
        ("data step", step),
        ("ngrams step", lambda: step(NGRAMS_STEP, "ngrams")),
    ]
    times = common.alternate(contenders, rounds, warmup=0)
    lib = {**seen["library"][0], "best": common.median(times["library"]), "all": times["library"]}
    own = {**seen["step"][0], "seconds": common.median(times["data step"]), "all": times["data step"]}
    own["ngrams"] = common.median(times["ngrams step"])
    corpus.unlink()
    return text_bytes, lib, seen["library"][1], own, seen["step"][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,100", help="corpus sizes in MB of JSONL (default 25,100)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per size (default 3)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"tokenizers {__import__('tokenizers').__version__}, RSS via wait4; {common.machine_line()}")
    with tempfile.TemporaryDirectory(prefix="bt-tokenize-") as scratch:
        root = Path(scratch)
        rows = [(size, *measure(root, size, args.rounds)) for size in sizes]
        header = f"{'JSONL MB':>8} {'text MB':>8} {'tokens':>11} {'library s':>9} {'MB/s':>6} {'RSS MB':>7}"
        header += f" {'data step s':>11} {'MB/s':>6} {'RSS MB':>7} {'ratio':>6} {'ngrams step s':>13} {'of data':>7}"
        print(
            f"medians of {args.rounds} alternated rounds (library: the faster of 4 MB batches and one call)"
        )
        print(header)
        for size, text_bytes, library, library_rss, step, step_rss in rows:
            mb = text_bytes / 2**20
            best = library["best"]
            print(
                f"{size:>8} {mb:>8.1f} {library['tokens']:>11,} {best:>9.2f} {mb / best:>6.2f} "
                f"{library_rss / 2**20:>7.0f} {step['seconds']:>11.2f} {mb / step['seconds']:>6.2f} "
                f"{step_rss / 2**20:>7.0f} {best / step['seconds']:>5.2f}x {step['ngrams']:>13.2f} "
                f"{step['ngrams'] / step['seconds']:>6.2f}x"
            )
        if len(rows) > 1:
            small, large = rows[0], rows[-1]  # (size, text bytes, library, its RSS, step, its RSS)
            growth = (large[4]["seconds"] / small[4]["seconds"]) / (large[1] / small[1])
            print(f"data step time per MB at {large[0]} MB / at {small[0]} MB: {growth:.2f} (1.00 = linear)")
        print(
            "ratio: data step throughput / the library's faster throughput (goal >= 0.80x). The data step encodes the "
            "text cut into <= 1 KB pieces (the train/held-out split), so its token count differs slightly. "
            "of data: the ngrams step's time over the data step's (a step of its own, beside training; the "
            "data step records no n-grams, so issue 46's <= 1.15x holds by construction)."
        )
        print(common.machine_line())


if __name__ == "__main__":
    main()
