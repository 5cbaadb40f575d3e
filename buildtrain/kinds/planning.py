"""What a kind sees while the planner compiles a config: the config, the content of the files it
reads, and the steps planned so far, by kind and stage.

Each kind's `plan` reads its own slice of the config from here and adds its step; a step asks for
its inputs by kind (`planned("data", stage)`), so the DAG is wired by what each kind consumes,
never by the planner knowing who follows whom.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from buildtrain.config.schema import Config
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import Machine
from buildtrain.sources.stat_cache import SourceFile


@attrs.frozen(kw_only=True)
class CheckpointFiles:
    """A checkpoint folder (`model.init.hf`) as a plan sees it: its files' content, by role."""

    architecture: str  # config.json's model_type
    base: Mapping[str, SourceFile]  # config.json, tokenizer_config.json, ... by file name
    shards: tuple[SourceFile, ...]  # the safetensors weights


@attrs.define(kw_only=True)
class Planning:
    config: Config
    view: Mapping[str, Any]  # the config as the plan hash records it (no paths)
    sources: Mapping[str, list[SourceFile]]  # each stage's data files, by content
    tokenizer_files: Mapping[str, SourceFile]  # each stage's given tokenizer file, by content
    suite_files: tuple[tuple[SourceFile, ...], ...] = ()  # each eval suite's files, by content
    world_size: int  # processes that will train (hashed only where a result depends on it)
    machine: Machine | None = None  # the workers' machine, where an engine's nodes execute the steps
    checkpoint: CheckpointFiles | None = None  # the pretrained checkpoint the model starts from
    steps: dict[str, Step] = attrs.Factory(dict)  # by hash, in plan order
    _by_kind: dict[tuple[str, str | None], Step | None] = attrs.Factory(dict)

    def add(self, kind: str, stage: str | None, step: Step | None) -> Step | None:
        """Record `kind`'s step for `stage` (None: none); identical work is one step."""
        if step is not None:
            step = self.steps.setdefault(step.hash, step)
        self._by_kind[(kind, stage)] = step
        return step

    def planned(self, kind: str, stage: str | None = None) -> Step | None:
        """The step `kind` planned for `stage` (None: its plan-wide step), if any."""
        return self._by_kind.get((kind, stage))

    def required(self, kind: str, stage: str | None = None) -> Step:
        step = self.planned(kind, stage)
        assert step is not None, f"a {kind} step is planned before its consumers ({stage})"
        return step

    def weights(self, stage: str) -> Step:
        """The step whose output holds a stage's final weights: its train step, or for a stage
        of 0 updates (no train step) the weights it starts from, as they are: its `init_from`
        stage's, or the imported checkpoint's (whose output a train step's result reads alike)."""
        trained = self.planned("train", stage)
        if trained is not None:
            return trained
        init_from = self.config.stage(stage).init_from
        return self.weights(init_from) if init_from is not None else self.required("import_hf", stage)

    def sources_input(self, stage: str) -> list[dict[str, Any]]:
        """A stage's data files as a step input: (blake3, size) sorted by digest, which is also
        the order the data step reads them in, so renaming or moving a file changes nothing."""
        files = sorted(self.sources.get(stage, []), key=lambda s: (s.blake3, s.size))
        return [{"blake3": s.blake3, "size": s.size} for s in files]
