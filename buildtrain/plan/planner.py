"""`bt plan` as a function: preset -> validated config -> source digests -> stored plan.

Never imports torch: everything here has to answer in a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs

from buildtrain.config.loader import LoadedPreset, load_preset
from buildtrain.config.preflight import preflight
from buildtrain.config.pretrained import Checkpoint
from buildtrain.config.schema import TokenizerConfig
from buildtrain.config.steps import SUITE_PATHS
from buildtrain.config.suites import suite_kind
from buildtrain.errors import ConfigError, StepFailed
from buildtrain.kinds.planning import CheckpointFiles
from buildtrain.plan.card import save_card
from buildtrain.plan.compile import compile_plan
from buildtrain.plan.plan import Plan
from buildtrain.plan.pretrained import apply_checkpoint
from buildtrain.plan.stored import save_plan
from buildtrain.plan.toolchain import WorkerProbe
from buildtrain.sources.data_url import ObjectVersion
from buildtrain.sources.stat_cache import SourceFile, StatCache
from buildtrain.store.store import Store


@attrs.frozen
class Planned:
    plan: Plan
    loaded: LoadedPreset
    threads: int  # the preset's numerics.threads, an execution setting under `portable`
    hashed_bytes: int  # source bytes hashed (0 when the stat cache knew every file)


def plan_preset(
    path: str | Path,
    overrides: Iterable[str],
    store: Store,
    world_size: int = 1,
    workers: WorkerProbe | None = None,
) -> Planned:
    overrides = list(overrides)
    return plan_loaded(load_preset(path, overrides), overrides, store, world_size, workers)


def plan_loaded(
    loaded: LoadedPreset,
    overrides: list[str],
    store: Store,
    world_size: int = 1,
    workers: WorkerProbe | None = None,
) -> Planned:
    """`plan_preset` for a preset already loaded (with `overrides`, which the metadata records);
    `workers`: an engine's probe of the machine its nodes execute steps on (default: this one)."""
    loaded, checkpoint = apply_checkpoint(loaded)  # the model's shape and tokenizer from a checkpoint
    cache = store.stat_cache()
    source_paths, problems = preflight(loaded, world_size, cache)
    if problems:
        raise ConfigError(problems)

    locations: dict[str, list[str]] = {}
    sources = _source_digests(source_paths, cache, locations)
    tokenizer_files = _tokenizer_files(loaded, cache, locations)
    imported = None if checkpoint is None else _checkpoint_files(cache, checkpoint, locations)
    suite_files = _suite_digests(loaded, cache, locations)
    cache.save()

    machine = workers(loaded.config.numerics.device) if workers is not None else None
    plan = compile_plan(
        loaded.config,
        sources,
        world_size,
        tokenizer_files,
        checkpoint=imported,
        suite_files=suite_files,
        machine=machine,
    )
    record = save_plan(store, plan, preset=str(loaded.path), overrides=overrides, sources=locations)
    save_card(store, plan, record["created"])  # what bt ls --metrics reads
    return Planned(
        plan=plan, loaded=loaded, threads=loaded.config.numerics.threads, hashed_bytes=cache.hashed_bytes
    )


def _source_digests(
    source_paths: dict[str, list[Path | ObjectVersion]], cache: StatCache, locations: dict[str, list[str]]
) -> dict[str, list[SourceFile]]:
    """Each stage's data files digested (through the stat cache), in order; where each digest was
    found is added to `locations` (the plan's metadata records it)."""
    sources: dict[str, list[SourceFile]] = {}
    for stage, paths in source_paths.items():
        sources[stage] = []
        for source_path in paths:
            source, where = _source_digest(cache, source_path)
            sources[stage].append(source)
            known = locations.setdefault(source.blake3, [])
            if where not in known:
                known.append(where)
    return sources


def _tokenizer_files(
    loaded: LoadedPreset, cache: StatCache, locations: dict[str, list[str]]
) -> dict[str, SourceFile]:
    """The tokenizer file of each stage that names one, digested; a stage that starts from
    another's weights must keep its tokenizer (one line naming the setting, otherwise)."""
    tokenizer_files: dict[str, SourceFile] = {}
    for index, stage in enumerate(loaded.config.stages):
        tokenizer = stage.data.tokenizer
        if stage.init_from is not None and tokenizer != loaded.config.stage(stage.init_from).data.tokenizer:
            key = ("stages", index, "data", "tokenizer")
            where = loaded.source_of(key if key in loaded.provenance else key[2:])
            raise ConfigError(
                [
                    f"{where}: stages.{stage.name}.data.tokenizer: differs from the tokenizer of stage "
                    f"'{stage.init_from}', whose weights it starts from; a stage keeps its parent's "
                    "tokenizer (the ids must mean the same tokens), so leave it out"
                ]
            )
        if isinstance(tokenizer, TokenizerConfig) and tokenizer.file is not None:
            path = Path(tokenizer.file)
            try:
                tokenizer_files[stage.name] = source = cache.digest_of(path)
            except OSError as exc:
                key = ("stages", index, "data", "tokenizer", "file")
                where = loaded.source_of(key if key in loaded.provenance else key[2:])
                raise ConfigError(
                    [
                        f"{where}: data.tokenizer.file: cannot read {path}: {exc.strerror}; give a tokenizer.json"
                    ]
                ) from None
            known = locations.setdefault(source.blake3, [])
            if str(path.absolute()) not in known:
                known.append(str(path.absolute()))
    return tokenizer_files


def _checkpoint_files(
    cache: StatCache, checkpoint: Checkpoint, locations: dict[str, list[str]]
) -> CheckpointFiles:
    """The checkpoint's files by content (the stat cache makes a second plan only stat them)."""
    digests = {}
    for path in checkpoint.files():
        try:
            digests[path] = cache.digest_of(path)
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read checkpoint file: {exc.strerror}"]) from None
        known = locations.setdefault(digests[path].blake3, [])
        if str(path.absolute()) not in known:
            known.append(str(path.absolute()))
    return CheckpointFiles(
        architecture=checkpoint.architecture,
        base={name: digests[path] for name, path in checkpoint.base_files.items()},
        shards=tuple(digests[path] for path in checkpoint.shards),
    )


def _source_digest(cache: StatCache, found: Path | ObjectVersion) -> tuple[SourceFile, str]:
    """A data file's content and where it was seen (a hint for the run, in no hash): a local
    file's absolute path, or an object's URL (hashed from its streamed bytes, see
    `sources/bucket_sources.py`)."""
    if isinstance(found, ObjectVersion):
        from buildtrain.sources.bucket_sources import digest

        return digest(cache, found), found.url
    try:
        return cache.digest_of(found), str(found.absolute())
    except OSError as exc:
        raise ConfigError([f"{found}: cannot read data file: {exc.strerror}"]) from None


def _suite_digests(
    loaded: LoadedPreset, cache: StatCache, locations: dict[str, list[str]]
) -> list[tuple[SourceFile, ...]]:
    """Each eval suite's files by content (in suite order; `config.steps.SUITE_PATHS` in each);
    where each was seen is a hint for the run."""
    found = []
    for index, suite in enumerate(loaded.config.eval.suites):
        files = []
        for key in SUITE_PATHS:
            name = getattr(suite, key)
            if name is None:
                continue
            path = Path(name)
            try:
                source = cache.digest_of(path)
            except OSError as exc:
                where = loaded.source_of(("eval", "suites", index, key))
                raise ConfigError(
                    [
                        f"{where}: eval.suites[{index}].{key}: cannot read {path}: {exc.strerror}; give a file there"
                    ]
                ) from None
            files.append(source)
            known = locations.setdefault(source.blake3, [])
            if str(path.absolute()) not in known:
                known.append(str(path.absolute()))
        found.append(tuple(files))
        _check_suite(loaded, index)
    return found


def _check_suite(loaded: LoadedPreset, index: int) -> None:
    """Read a suite's files as the eval step will (its kind's `check`), so that a malformed
    line or a task that is more than data stops the plan, not the eval step after training."""
    suite = loaded.config.eval.suites[index]
    kind = suite_kind(suite.kind)
    files = {key: getattr(suite, key) for key in kind.config_keys()}
    try:
        kind.check(files, loaded.config.final_stage.train.seq_len)  # the eval step's context (kinds/eval.py)
    except StepFailed as exc:
        where = loaded.source_of(("eval", "suites", index))
        raise ConfigError([f"{where}: eval.suites[{index}]: {exc}"]) from None
    except OSError as exc:
        where = loaded.source_of(("eval", "suites", index))
        raise ConfigError([f"{where}: eval.suites[{index}]: cannot read: {exc.strerror}"]) from None
