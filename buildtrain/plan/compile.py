"""Compile a resolved config into a plan: each stage's steps, then the plan-wide ones.

The planner knows no kind by name: it asks every registered kind, in registry order, for its step
of each stage (kinds planned per stage) and then for its plan-wide step, and each kind wires its
own inputs from the steps planned before it (`kinds/planning.py`). Each step receives only the
slice of config it reads, so a change reaches exactly the steps it affects: a finetune learning
rate invalidates finetune, eval and export, never data or pretrain. Paths never enter a step; data
files enter only as (blake3, size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from buildtrain.config.convert import converter
from buildtrain.config.schema import Config
from buildtrain.config.steps import eval_view
from buildtrain.kinds import KINDS
from buildtrain.kinds.data import data_view
from buildtrain.kinds.planning import CheckpointFiles, Planning
from buildtrain.plan.plan import Plan, Step
from buildtrain.plan.toolchain import Machine
from buildtrain.sources.stat_cache import SourceFile


def config_view(config: Config) -> dict[str, Any]:
    """The resolved config as it enters the plan hash: no paths, no portable thread count."""
    view = converter.unstructure(config)
    for stage, resolved in zip(view["stages"], config.stages, strict=True):
        stage["data"] = data_view(resolved.data)
    view["eval"] = eval_view(config.eval)  # suite files enter the eval step by content
    if config.numerics.profile == "portable":
        view["numerics"].pop("threads")  # an execution setting: portable results do not depend on it
    return view


def compile_plan(
    config: Config,
    sources: Mapping[str, list[SourceFile]],
    world_size: int = 1,
    tokenizer_files: Mapping[str, SourceFile] | None = None,
    checkpoint: CheckpointFiles | None = None,
    suite_files: Sequence[tuple[SourceFile, ...]] = (),
    machine: Machine | None = None,
) -> Plan:
    """The plan for `config`; `sources` gives the content of each stage's data files, `world_size`
    the processes that will train (hashed only where a result depends on it), `tokenizer_files`
    the content of each stage's given tokenizer file, `checkpoint` that of `model.init`'s files,
    `suite_files` that of each eval suite's files (in `eval.suites` order), `machine` the machine
    that will execute the steps (default: this one)."""
    view = config_view(config)
    planning = Planning(
        config=config,
        view=view,
        sources=sources,
        tokenizer_files=tokenizer_files or {},
        suite_files=tuple(suite_files),
        world_size=world_size,
        machine=machine,
        checkpoint=checkpoint,
    )
    per_stage = [kind for kind in KINDS.values() if kind.per_stage]
    for stage in config.stages:
        for kind in per_stage:
            planning.add(kind.name, stage.name, kind.plan(planning, stage))
    whole: list[Step] = []
    for kind in KINDS.values():
        if not kind.per_stage:
            step = planning.add(kind.name, None, kind.plan(planning, None))
            whole += [step] if step is not None else []
    return Plan.create(config.name, view, tuple(planning.steps.values()), targets(whole))


def targets(whole: list[Step]) -> tuple[str, ...]:
    """What a plan is built for: its plan-wide steps that no other step consumes (the export, or
    the evaluation where there is no export)."""
    consumed = {upstream for step in whole for upstream in step.upstream.values()}
    return tuple(step.hash for step in whole if step.hash not in consumed)
