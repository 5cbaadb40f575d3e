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
from buildtrain.config.schema import BYTE_VOCAB_SIZE, END_OF_DOCUMENT, Config, DataConfig
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.toolchain import fingerprint, hashed_world_size
from buildtrain.store.sources import SourceFile

# Bump when an evaluation suite changes what it computes; results are cached by this version.
EVAL_SUITE_VERSIONS = {"heldout": 1}


def tokenizer_description(name: str) -> dict[str, Any]:
    assert name == "bytes", name  # the schema admits only byte-level tokenization so far
    return {"type": "bytes", "vocab_size": BYTE_VOCAB_SIZE, "end_of_document": END_OF_DOCUMENT}


def data_view(data: DataConfig) -> dict[str, Any]:
    """The data config without paths, and without the synthetic settings when they are unused."""
    view = converter.unstructure(data)
    view.pop("files")
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


def compile_plan(config: Config, sources: Mapping[str, list[SourceFile]], world_size: int = 1) -> Plan:
    """The plan for `config`; `sources` gives the content of each stage's data files, `world_size`
    the processes that will train (it enters only the hash of an `allreduce` train step)."""
    numerics = config.numerics
    view = config_view(config)
    model = converter.unstructure(config.model)
    eval_config = converter.unstructure(config.eval)
    steps: dict[str, Step] = {}

    def add(step: Step) -> Step:
        return steps.setdefault(step.hash, step)  # identical work is one step

    trained: dict[str, Step] = {}
    data_steps: dict[str, Step] = {}
    for stage in config.stages:
        data = add(
            Step.create(
                f"data:{stage.name}",
                "data",
                {"data": data_view(stage.data), "tokenizer": tokenizer_description(stage.data.tokenizer)},
                {"sources": _sources_input(list(sources.get(stage.name, [])))},
                fingerprint("data", numerics),
            )
        )
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
                    "tokenizer": tokenizer_description(final.data.tokenizer),
                },
                {"weights": trained[final.name].hash, "eval": evaluation.hash},
                fingerprint("export", numerics),
            )
        )
        targets = [export.hash]
    return Plan.create(config.name, view, tuple(steps.values()), tuple(targets))
