"""The names of everything in a store, and the torch-free facts about the files inside outputs.

Named here and nowhere else: the store (`Store`), fsck, gc, the step code that writes these files
and the tables that read them all take the names from this module, which imports nothing heavy,
so the CLI and the views read what a torch-side step wrote without importing torch or a step.

    STORE.json                    the marker: this folder is a buildtrain store (see plan/stored.claim_store)
    plans/<plan hash>.json        canonical plan bytes; <plan hash>.meta.json: when and from where
    sweeps/<sweep hash>.json      a sweep's axes and plans (content-addressed)
    steps/<step hash>/            completed step outputs, sealed by MANIFEST.json
    work/<step hash>/checkpoints/step-NNNNNN/   checkpoints of a step in progress
    work/<step hash>/trace/<blake3>.jsonl       every trace segment they sealed (store/trace.py)
    evals/<key>.json              evaluation results by (suite, version, weights, data)
    metrics/plans/<plan hash>.json   plan cards (what tables need of a plan)
    metrics/steps/<step hash>.json   a built step's summary (final loss, tokens/s, wall time)
    locks/<step hash>.lock        one writer per step; locks/plan-<plan hash>.lock: a run of a plan
    tmp/                          outputs being built; renamed into steps/ when complete
    quarantine/                   damaged objects moved aside, never loaded
    cache/files.json              stat cache of source file digests
    cache/verified/<step>.json    stamps: an output's file stats at its last full re-hash
    cache/sources/<blake3>        data files fetched from a bucket, named by their content
    cache/plans/<hh>/<plan hash>  the plan index by prefix (store/plan_index.py); INDEX.json: complete
    cache/workers/<key>.json      an engine's workers' toolchain, as last asked (executor/engines/probes.py)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

# Hex digits a hash is shown with in tables, messages and default export names.
SHORT = 12

MARKER = "STORE.json"
PLANS = "plans"
SWEEPS = "sweeps"
STEPS = "steps"
WORK = "work"
EVALS = "evals"
METRICS = "metrics"
LOCKS = "locks"
TMP = "tmp"
QUARANTINE = "quarantine"
CACHE = "cache"
# Every folder of a store, parents first; each must be a real folder, never a link or a file.
FOLDERS = (
    PLANS,
    SWEEPS,
    STEPS,
    WORK,
    EVALS,
    METRICS,
    f"{METRICS}/plans",
    f"{METRICS}/steps",
    LOCKS,
    TMP,
    QUARANTINE,
    CACHE,
    f"{CACHE}/verified",
    f"{CACHE}/sources",
    f"{CACHE}/plans",
)
# What the top of a store may hold (a store made by an earlier bt has no marker).
TOP_LEVEL = frozenset({MARKER, *(folder.split("/")[0] for folder in FOLDERS)})
STAT_CACHE = f"{CACHE}/files.json"
STAMPS = f"{CACHE}/verified"
SOURCE_CACHE = f"{CACHE}/sources"
PLAN_INDEX = f"{CACHE}/plans"
WORKER_PROBES = f"{CACHE}/workers"
CARDS = f"{METRICS}/plans"
STEP_METRICS = f"{METRICS}/steps"
PLAN_LOCK_PREFIX = "plan-"

HASH_NAME = re.compile(r"^[0-9a-f]{64}$")

# -- inside a work folder and a train step's output ------------------------------------------------
CHECKPOINTS = "checkpoints"
CHECKPOINT = re.compile(r"^step-(\d{6,})$")
# A checkpoint's files (resume, verify, export and fsck read them).
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
# Weights that do not train (LoRA's base model), apart from those that do (`MODEL`): written by
# the first checkpoint of a process, hard-linked by the later ones (the same bytes every time).
FROZEN = "frozen.safetensors"
# A sharded checkpoint (train.sharding = "fsdp") holds, instead of those two, one safetensors file
# per rank of the weights' and AdamW state's rows it owned (torch.distributed.checkpoint's layout).
SHARDS = "shards"
TRAIN_STATE = "train_state.json"
TRACE = "trace.jsonl"  # in an output: the whole trace; in a checkpoint: its segment (store/trace.py)
STATE_FORMAT = 2  # 2: the checkpoint's trace is a segment, not the whole trace so far
# Beside a work folder's checkpoints: every trace segment, by its blake3.
TRACE_SEGMENTS = "trace"
# In a work folder: written when a checkpoint was pulled from a remote for this step. A build
# that resumed from another machine's checkpoint is not an independent build: it never attests.
PULLED_CHECKPOINT = "pulled-checkpoint.json"
SEGMENT_SUFFIX = ".jsonl"
# A train step's summary of its output (final update, weights path, digests).
RESULT = "result.json"
# An eval step's output, and the copy an export package carries.
EVAL_RESULT = "eval.json"
# In a data step's output: the digest of every document it read (steps/data/documents.py); its digest
# in the output's manifest is named after the file, as a shard's is.
DOCUMENTS = "documents.u64"
TOKENIZER_FILE = "tokenizer.json"  # a tokenizer step output's tokenizer (steps/tokenizer/files.py)
TOKENIZER_DESCRIPTION = "description.json"  # and what its tokens are
DATA_INDEX = "data.json"  # a data step output's index: its splits and their shards (steps/data/index.py)
# In an ngrams step's output (and a data step's from before that kind): the Bloom filter of a
# stage's n-grams of words (steps/ngrams/), named in the manifest as DOCUMENTS is.
NGRAMS = "ngrams.bloom"
DEFAULT_NGRAM = 13  # words per n-gram of NGRAMS (GPT-3's and lm-eval's); other n: `ngram_file`


def ngram_file(n: int) -> str:
    """The file of an ngrams step's filter of `n`-grams (a suite's `ngram` asks for one)."""
    return NGRAMS if n == DEFAULT_NGRAM else f"ngrams-{n}.bloom"


def is_ngram_file(name: str) -> bool:
    return name == NGRAMS or (name.startswith("ngrams-") and name.endswith(".bloom"))


# An export package's weights and its `<blake3>  <file>` lines (`bt why` reads both).
EXPORT_WEIGHTS = "model.safetensors"
CHECKSUMS = "BLAKE3SUMS"
# An import step's copy of its checkpoint's config and tokenizer files (an export ships them again).
IMPORT_BASE = "base"


def checkpoint_name(update: int) -> str:
    """The folder name of the checkpoint taken after `update` (at least six digits, zero-padded)."""
    return f"step-{update:06d}"


def checkpoint_update(name: str) -> int | None:
    """The update a checkpoint folder name stands for; None for any other name (temporary,
    set aside, foreign)."""
    match = CHECKPOINT.match(name)
    return int(match.group(1)) if match else None


def newest_first(paths: Iterable[Path]) -> list[tuple[int, Path]]:
    """(update, path) of the checkpoint folder names among `paths`, newest first. By number, never
    as strings: `step-1000000` is newer than `step-999999`."""
    found = [(update, path) for path in paths if (update := checkpoint_update(path.name)) is not None]
    return sorted(found, key=lambda item: item[0], reverse=True)


def trace_segments(checkpoints: Path) -> Path:
    """The pool of trace segments that belongs with a folder of checkpoints."""
    return checkpoints.parent / TRACE_SEGMENTS


def json_name(stem: str) -> str:
    return f"{stem}.json"


def hash_of(name: str, suffix: str = ".json") -> str | None:
    """The 64-hex hash a store file is named by (`<hash><suffix>`), or None for any other name."""
    stem = name[: -len(suffix)] if name.endswith(suffix) else ""
    return stem if HASH_NAME.match(stem) else None
