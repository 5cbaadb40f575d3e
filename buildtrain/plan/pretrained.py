"""`model.init` applied to a loaded preset at plan time: the model's shape and every stage's
tokenizer come from the checkpoint (`config/pretrained.py` reads it); a preset key that says
otherwise is refused, naming the key and the file that set it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from buildtrain.config.loader import LoadedPreset
from buildtrain.config.pretrained import CONFIG, TOKENIZER, Checkpoint, CheckpointProblem, read_checkpoint
from buildtrain.config.schema import TokenizerConfig
from buildtrain.errors import ConfigError


def _set_by_user(loaded: LoadedPreset, key: tuple[Any, ...]) -> bool:
    return any(found[: len(key)] == key for found in loaded.provenance)


def apply_checkpoint(loaded: LoadedPreset) -> tuple[LoadedPreset, Checkpoint | None]:
    """The preset with its model shape and tokenizer taken from `model.init`'s checkpoint (as
    loaded when it names none); a key the preset sets to another value is refused by name."""
    init = loaded.config.model.init
    _refuse_untrained_from_nothing(loaded)
    if init is None:
        _refuse_chat_without_template(loaded)
        return loaded, None
    where = loaded.source_of(("model", "init", "hf"))
    try:
        checkpoint = read_checkpoint(Path(init.hf))
    except CheckpointProblem as exc:
        raise ConfigError([f"{where}: model.init.hf: {exc}"]) from None
    if checkpoint.tokenizer is None:
        raise ConfigError(
            [
                f"{where}: model.init.hf: {checkpoint.folder} has no {TOKENIZER}; save the checkpoint's "
                "tokenizer into it (tokenizer.save_pretrained)"
            ]
        )
    problems = []
    for name, value in checkpoint.model.items():
        mine = getattr(loaded.config.model, name)
        if _set_by_user(loaded, ("model", name)) and mine != value:
            problems.append(
                f"{loaded.source_of(('model', name))}: model.{name}: {mine!r} contradicts the checkpoint "
                f"({CONFIG} {checkpoint.hf_keys[name]} gives {value!r}); leave model.{name} out"
            )
    stages = []
    for index, stage in enumerate(loaded.config.stages):
        problems += _stage_problems(loaded, checkpoint, index)
        data = attrs.evolve(stage.data, tokenizer=_tokenizer(checkpoint))
        if data.format == "chat" and not data.chat_template and checkpoint.chat_template:
            data = attrs.evolve(data, chat_template=checkpoint.chat_template)  # the checkpoint's own
        stages.append(attrs.evolve(stage, data=data))
    if problems:
        raise ConfigError(problems)
    try:
        model = attrs.evolve(loaded.config.model, **checkpoint.model)
    except ValueError as exc:  # a shape buildtrain's model cannot take (an odd head size)
        raise ConfigError([f"{where}: model.init.hf: {checkpoint.folder / CONFIG}: {exc}"]) from None
    config = attrs.evolve(loaded.config, model=model, stages=tuple(stages))
    loaded = attrs.evolve(loaded, config=config)
    _refuse_chat_without_template(loaded)
    return loaded, checkpoint


def _refuse_untrained_from_nothing(loaded: LoadedPreset) -> None:
    """A stage of 0 steps is the weights it starts from, as they are: it needs some (a checkpoint
    or an earlier stage) and trains no adapters."""
    problems = []
    for index, stage in enumerate(loaded.config.stages):
        if stage.train.steps:
            continue
        own = ("stages", index, "train", "steps")  # set for this stage, else for every stage
        where = loaded.source_of(own if _set_by_user(loaded, own) else ("train", "steps"))
        if stage.init_from is None and loaded.config.model.init is None:
            problems.append(
                f"{where}: stages.{stage.name}.train.steps: 0 evaluates the weights a stage starts from, "
                'and this one starts from none; set model.init = { hf = "folder" } or init_from, or train '
                "at least 1 step"
            )
        if stage.train.lora is not None:
            problems.append(
                f"{where}: stages.{stage.name}.train.lora: a stage of 0 steps trains no adapters; drop "
                "train.lora or train at least 1 step"
            )
    if problems:
        raise ConfigError(problems)


def _refuse_chat_without_template(loaded: LoadedPreset) -> None:
    """Chat records need a template to render them and a given tokenizer to encode them."""
    for index, stage in enumerate(loaded.config.stages):
        data = stage.data
        if data.format != "chat" or data.source != "files":
            continue  # the synthetic corpus has no format
        where = loaded.source_of(("stages", index, "data", "format"))
        if not data.chat_template:
            raise ConfigError(
                [
                    f"{where}: stages.{stage.name}.data.chat_template: format is 'chat' but there is no "
                    "chat template; start from a checkpoint that has one (model.init) or set data.chat_template"
                ]
            )
        if not isinstance(data.tokenizer, TokenizerConfig) or data.tokenizer.file is None:
            raise ConfigError(
                [
                    f"{where}: stages.{stage.name}.data.tokenizer: format 'chat' needs the tokenizer the "
                    'template was written for; start from a checkpoint (model.init) or set data.tokenizer = { file = "tokenizer.json" }'
                ]
            )


def _tokenizer(checkpoint: Checkpoint) -> TokenizerConfig:
    assert checkpoint.tokenizer is not None  # checked per stage first
    eos = checkpoint.end_of_document or attrs.fields(TokenizerConfig).end_of_document.default
    return TokenizerConfig(file=str(checkpoint.tokenizer), end_of_document=eos)


def _stage_problems(loaded: LoadedPreset, checkpoint: Checkpoint, index: int) -> list[str]:
    """What a stage asks that the checkpoint cannot give: its own tokenizer, a longer window."""
    stage = loaded.config.stages[index]
    problems = []
    for key in (("stages", index, "data", "tokenizer"), ("data", "tokenizer")):
        if _set_by_user(loaded, key):
            problems.append(
                f"{loaded.source_of(key)}: data.tokenizer: the checkpoint's own tokenizer is used "
                f"({checkpoint.folder / TOKENIZER}); leave data.tokenizer out"
            )
            break
    window = checkpoint.sliding_window
    if window is not None and stage.train.seq_len > window:
        problems.append(
            f"{loaded.source_of(('train', 'seq_len'))}: stages.{stage.name}.train.seq_len: "
            f"{stage.train.seq_len} is longer than the checkpoint's sliding_window {window}, which "
            f"buildtrain does not implement; use at most {window}"
        )
    return problems
