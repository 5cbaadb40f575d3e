"""Compile a resolved config into a plan: data -> train stage(s) -> eval -> export.

Each step receives only the slice of config it reads, so a change reaches exactly the steps it
affects: a finetune learning rate invalidates finetune, eval and export, never data or pretrain.
Paths never enter a step; data files enter only as (blake3, size), sorted by digest, which is also
the order the data step reads them in, so renaming or moving a file changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from buildtrain.config.convert import converter
from buildtrain.config.schema import BYTE_VOCAB_SIZE, END_OF_DOCUMENT, Config, DataConfig, TokenizerConfig
from buildtrain.errors import ConfigError
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.tokenizers import format_view, tokenizer_step, tokenizer_view
from buildtrain.plan.toolchain import fingerprint, hashed_world_size, library_facts
from buildtrain.store.sources import SourceFile

# Bump when an evaluation suite changes what it computes; results are cached by this version.
EVAL_SUITE_VERSIONS = {"heldout": 1}


def tokenizer_description(name: str | TokenizerConfig) -> dict[str, Any]:
    """The byte tokenizer (other tokenizers are described by their tokenizer step's output)."""
    assert name == "bytes", name
    return {"type": "bytes", "vocab_size": BYTE_VOCAB_SIZE, "end_of_document": END_OF_DOCUMENT}


def data_view(data: DataConfig) -> dict[str, Any]:
    """The data config without paths, and without the synthetic settings when they are unused."""
    view = converter.unstructure(data)
    view.pop("files")
    for key in ("format", "text_field", "text_column"):  # only when they say something (plan hashes)
        view.pop(key)
    view.update(format_view(data))
    if isinstance(data.tokenizer, TokenizerConfig):
        view["tokenizer"] = tokenizer_view(data.tokenizer)  # no path
    if data.source != "synthetic":
        view.pop("synthetic")
    return view


def config_view(config: Config) -> dict[str, Any]:
    """The resolved config as it enters the plan hash: no paths, no portable thread count."""
    view = converter.unstructure(config)
    for stage, resolved in zip(view["stages"], config.stages, strict=True):
        stage["data"] = data_view(resolved.data)
    if config.numerics.profile == "portable":
        view["numerics"].pop("threads")  # an execution setting: portable results do not depend on it
    return view


def _sources_input(sources: list[SourceFile]) -> list[dict[str, Any]]:
    return [{"blake3": s.blake3, "size": s.size} for s in sorted(sources, key=lambda s: (s.blake3, s.size))]


def compile_plan(
    config: Config,
    sources: Mapping[str, list[SourceFile]],
    world_size: int = 1,
    tokenizer_files: Mapping[str, SourceFile] | None = None,
) -> Plan:
    """The plan for `config`; `sources` gives the content of each stage's data files, `world_size`
    the processes that will train (it enters only the hash of an `allreduce` train step),
    `tokenizer_files` the content of each stage's given tokenizer file."""
    numerics = config.numerics
    view = config_view(config)
    model = converter.unstructure(config.model)
    eval_config = converter.unstructure(config.eval)
    steps: dict[str, Step] = {}

    def add(step: Step) -> Step:
        return steps.setdefault(step.hash, step)  # identical work is one step

    trained: dict[str, Step] = {}
    data_steps: dict[str, Step] = {}
    tokenizers: dict[str, Step | None] = {}
    for stage in config.stages:
        stage_view = data_view(stage.data)
        stage_sources = _sources_input(list(sources.get(stage.name, [])))
        tokenizer = _stage_tokenizer(
            config, stage.name, stage_view, stage_sources, tokenizers, tokenizer_files
        )
        tokenizers[stage.name] = tokenizer = add(tokenizer) if tokenizer else None
        if tokenizer is None:
            data_config = {"data": stage_view, "tokenizer": tokenizer_description(stage.data.tokenizer)}
            data_inputs: dict[str, Any] = {"sources": stage_sources}
            data_toolchain = fingerprint("data", numerics)
        else:  # the description (vocabulary size, end-of-document id) comes from the tokenizer step
            data_config = {"data": stage_view}
            data_inputs = {"sources": stage_sources, "tokenizer": tokenizer.hash}
            data_toolchain = {**fingerprint("data", numerics), **library_facts("data", data_config)}
        data = add(Step.create(f"data:{stage.name}", "data", data_config, data_inputs, data_toolchain))
        data_steps[stage.name] = data
        train_config: dict[str, Any] = {"model": model, "train": converter.unstructure(stage.train)}
        if config.eval.every:
            train_config["eval"] = eval_config
        parent = trained[stage.init_from].hash if stage.init_from else None
        trained[stage.name] = add(
            Step.create(
                f"train:{stage.name}",
                "train",
                train_config,
                {"data": data.hash, "init": parent},
                fingerprint(
                    "train", numerics, world_size=hashed_world_size("train", train_config, world_size)
                ),
            )
        )

    final = config.final_stage
    eval_only = {k: v for k, v in eval_config.items() if k != "every"}
    evaluation = add(
        Step.create(
            "eval",
            "eval",
            {"eval": eval_only, "model": model, "version": EVAL_SUITE_VERSIONS[config.eval.suite]},
            {"weights": trained[final.name].hash, "data": data_steps[final.name].hash},
            fingerprint("eval", numerics),
        )
    )
    targets = [evaluation.hash]
    if config.export.enabled:
        final_tokenizer = tokenizers[final.name]
        export_inputs = {"weights": trained[final.name].hash, "eval": evaluation.hash}
        if final_tokenizer is not None:
            export_inputs["tokenizer"] = final_tokenizer.hash
        export = add(
            Step.create(
                "export",
                "export",
                {
                    "export": converter.unstructure(config.export),
                    "model": model,
                    "train": converter.unstructure(final.train),
                    "data": data_view(final.data),
                    "numerics": view["numerics"],
                    "tokenizer": tokenizer_description(final.data.tokenizer)
                    if final_tokenizer is None
                    else data_view(final.data)["tokenizer"],
                },
                export_inputs,
                fingerprint("export", numerics),
            )
        )
        targets = [export.hash]
    return Plan.create(config.name, view, tuple(steps.values()), tuple(targets))


def _stage_tokenizer(
    config: Config,
    name: str,
    view: dict[str, Any],
    stage_sources: list[dict[str, Any]],
    planned: Mapping[str, Step | None],
    files: Mapping[str, SourceFile] | None,
) -> Step | None:
    """A stage's tokenizer step; a stage that starts from another's weights keeps its tokenizer
    (the ids must mean the same tokens), so it may not ask for a different one."""
    stage = config.stage(name)
    if stage.init_from is not None:
        if stage.data.tokenizer != config.stage(stage.init_from).data.tokenizer:
            raise ConfigError(
                [
                    f"stages.{name}.data.tokenizer: differs from the tokenizer of stage '{stage.init_from}', "
                    "whose weights it starts from; a stage keeps its parent's tokenizer, so leave it out"
                ]
            )
        return planned[stage.init_from]
    return tokenizer_step(
        f"tokenizer:{name}",
        stage.data,
        view.get("synthetic"),
        stage_sources,
        (files or {}).get(name),
        config.numerics,
    )
