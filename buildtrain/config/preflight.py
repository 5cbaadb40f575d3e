"""Pre-flight checks that need the machine, not just the preset: data presence, memory, device.

They run at `bt plan` time so that a doomed run fails in a fraction of a second instead of an hour
in. The memory estimate is `shape.memory_estimate`, with the vocabulary a given tokenizer file
really declares (`vocabulary`). Data and tokenizer files must be regular files: a FIFO, a device or
a socket (or a link to one) is refused here, never opened for reading.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from buildtrain.config.loader import LoadedPreset
from buildtrain.config.problems import KeyPath, Problem
from buildtrain.config.schema import Stage, TokenizerConfig, world_size_problem
from buildtrain.config.shape import memory_estimate, planned_vocab_size, rank_memory
from buildtrain.config.vocabulary import Vocabulary, VocabularyError, read_vocabulary
from buildtrain.sources.data_url import ObjectVersion, is_object_url
from buildtrain.sources.stat_cache import StatCache, kind_of

GIB = 1 << 30


def expand_sources(patterns: tuple[str, ...]) -> tuple[list[Path], list[str], list[str]]:
    """Files matched by the patterns, each once; the patterns that matched nothing; and what they
    matched that is no file to read (a FIFO, device or socket: folders are passed over)."""
    found: dict[tuple[int, int], Path] = {}  # by (device, inode): one stat per file, links count once
    empty: list[str] = []
    refused: list[str] = []
    for pattern in patterns:
        matched = False
        for match in sorted(glob.glob(pattern, recursive=True)):
            try:
                info = os.stat(match)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                matched = True
                found.setdefault((info.st_dev, info.st_ino), Path(match))
            elif not stat.S_ISDIR(info.st_mode):
                matched = True
                refused.append(
                    f"{match} is {kind_of(info.st_mode)}, not a regular file; remove it or narrow '{pattern}'"
                )
        if not matched:
            empty.append(pattern)
    return list(found.values()), empty, refused


def _expand_objects(patterns: tuple[str, ...]) -> tuple[list[ObjectVersion], list[str]]:
    """The objects that `s3://` entries name, each once, and why an entry names none. The S3
    client is loaded only here, for a preset that names a bucket."""
    if not patterns:
        return [], []
    from buildtrain.sources.bucket_sources import expand

    found: dict[str, ObjectVersion] = {}
    missing: list[str] = []
    for pattern in patterns:
        versions, problem = expand(pattern)
        found.update((version.url, version) for version in versions if version.url not in found)
        if problem is not None:
            missing.append(problem)
    return list(found.values()), missing


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_available() -> bool:
    """Whether a CUDA device is visible, asked without importing torch."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def preflight(
    loaded: LoadedPreset, world_size: int = 1, cache: StatCache | None = None
) -> tuple[dict[str, list[Path | ObjectVersion]], list[str]]:
    """Source files (and objects in a bucket) per stage, and every machine-level problem with the preset for a run on
    `world_size` processes (`cache` remembers what a tokenizer file's vocabulary is)."""
    config = loaded.config
    problems: list[Problem] = []
    sources: dict[str, list[Path | ObjectVersion]] = {}

    def stage_key(index: int, *key: str) -> KeyPath:
        """The key as the preset spelled it: in the stage's own table, or inherited from the top."""
        own = ("stages", index, *key)
        return own if own in loaded.provenance else key

    vocabularies: dict[str, tuple[str, Vocabulary]] = {}
    for index, stage in enumerate(config.stages):
        unfit = world_size_problem(stage.train, world_size)
        if unfit is not None:
            key = stage_key(index, "train", "micro_batch_size")
            source = loaded.blame(key, stage_key(index, "train", "batch_size"))
            problems.append(Problem(source, key, unfit))
        given = _given_vocabulary(
            loaded, stage, stage_key(index, "data", "tokenizer", "file"), problems, cache
        )
        if given is not None:
            vocabularies[stage.name] = given
        if stage.data.source != "files":
            sources[stage.name] = []
            continue
        local = tuple(pattern for pattern in stage.data.files if not is_object_url(pattern))
        files, empty, refused = expand_sources(local)
        key = stage_key(index, "data", "files")
        objects, missing = _expand_objects(tuple(p for p in stage.data.files if is_object_url(p)))
        sources[stage.name] = [*files, *objects]
        problems.extend(Problem(loaded.source_of(key), key, message) for message in missing)
        for pattern in empty:
            hint = (
                f"; it is a folder: give a glob such as '{pattern.rstrip('/')}/*.txt'"
                if os.path.isdir(pattern)
                else ""
            )
            problems.append(Problem(loaded.source_of(key), key, f"'{pattern}' matches no file{hint}"))
        problems.extend(Problem(loaded.source_of(key), key, message) for message in refused)

    problems.extend(_memory_problems(loaded, vocabularies, stage_key, world_size))
    if config.numerics.device == "cuda" and not cuda_available():
        problems.append(
            Problem(
                loaded.source_of(("numerics", "device")),
                ("numerics", "device"),
                "is 'cuda' but no CUDA device is visible on this machine; use device = \"cpu\"",
            )
        )
    return sources, [str(problem) for problem in dict.fromkeys(problems)]


def _given_vocabulary(
    loaded: LoadedPreset, stage: Stage, key: KeyPath, problems: list[Problem], cache: StatCache | None
) -> tuple[str, Vocabulary] | None:
    """The vocabulary of the stage's given tokenizer file, if it has one; a file that cannot be
    read as a tokenizer is a problem at `key`."""
    tokenizer = stage.data.tokenizer
    if not isinstance(tokenizer, TokenizerConfig) or tokenizer.file is None:
        return None
    if is_object_url(tokenizer.file):
        message = f"{tokenizer.file}: a tokenizer file is read from disk only (data.files may be in a bucket); download it and give its path"
        problems.append(Problem(loaded.source_of(key), key, message))
        return None
    try:
        return tokenizer.file, read_vocabulary(Path(tokenizer.file), cache)
    except VocabularyError as exc:
        message = f"{tokenizer.file}: {exc}"
    except OSError as exc:
        message = f"cannot read {tokenizer.file}: {exc.strerror or exc}; give a tokenizer.json"
    except ValueError:  # a path no system call takes
        message = f"{tokenizer.file!r} is not a path a file can have (a NUL byte); give a tokenizer.json"
    problems.append(Problem(loaded.source_of(key), key, message))
    return None


def _memory_problems(
    loaded: LoadedPreset,
    vocabularies: dict[str, tuple[str, Vocabulary]],
    stage_key: Callable[..., KeyPath],
    world_size: int = 1,
) -> list[Problem]:
    """The first training stage that needs more memory than the machine has, if one does: blamed
    on a given tokenizer file when its vocabulary is what makes the model large. On the CPU the
    ranks share the machine's memory, so each rank's need counts `world_size` times."""
    config = loaded.config
    available = machine_memory()
    ranks = world_size if config.numerics.device == "cpu" else 1

    def needs(stage: Stage, vocab_size: int) -> int:
        return memory_estimate(config.model, stage.train, vocab_size, world_size) * ranks

    for index, stage in enumerate(config.stages):
        file, given = vocabularies.get(stage.name, ("", None))
        vocab_size = given.size if given is not None else planned_vocab_size(stage.data)
        needed = needs(stage, vocab_size)
        if needed <= available:
            continue
        numbers = f"about {needed / GIB:,.1f} GiB but this machine has {available / GIB:.1f} GiB"
        if given is not None and needs(stage, planned_vocab_size(stage.data)) <= available:
            key = stage_key(index, "data", "tokenizer", "file")
            fix = "number its ids from 0 without gaps" if given.tokens < given.size else "give a smaller one"
            message = (
                f"{file} declares a vocabulary of {given.size:,} ids (its largest id is "
                f"{given.size - 1:,}; it lists {given.tokens:,} tokens), so training stage '{stage.name}' needs "
                f"{numbers}; {fix}"
            )
            return [Problem(loaded.source_of(key), key, message)]
        parts = rank_memory(config.model, stage.train, vocab_size, world_size)
        per_rank = f" per rank x {ranks} ranks" if ranks > 1 else ""
        fix = (
            'set train.sharding = "fsdp" (state split across ranks) or '
            if stage.train.sharding == "none" and stage.train.reduction == "invariant"
            else ""
        )
        if not stage.train.activation_checkpointing:
            fix += "train.activation_checkpointing = true, or "
        message = (
            f"training stage '{stage.name}' needs {numbers} ({parts.describe()} GiB{per_rank}; vocabulary "
            f"{vocab_size:,}); {fix}reduce model.dim, model.n_layers, train.micro_batch_size or train.seq_len"
        )
        return [Problem(loaded.source_of(("model",)), ("model",), message)]
    return []
