"""The data kind: a stage's sources read, tokenized, split into train and held-out, and written as
token shards. Needs no torch; its bits depend on buildtrain's code and, where a tokenizer step's
BPE encodes the text, on the `tokenizers` release."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from buildtrain.config.schema import DataConfig, Stage
from buildtrain.config.steps import BYTES, DataSettings, DataStep
from buildtrain.kinds.kind import StepKind
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import Machine

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


def data_view(data: DataConfig) -> dict[str, Any]:
    """The data section as the plan records it (in every data step and in the plan's config)."""
    return DataSettings.of(data).to_config()


class DataKind(StepKind):
    name = "data"
    computes = "buildtrain.steps.data"
    headline = "data"
    per_stage = True
    reads_sources = True

    def library_facts(self, config: Mapping[str, Any], machine: Machine) -> dict[str, str]:
        # Encoding with a tokenizer step's BPE: the token ids are that library's numbers.
        facts = {} if "tokenizer" in config else {"tokenizers": machine.tokenizers}
        if config["data"].get("format") == "chat":  # records rendered by jinja2's template engine
            from importlib.metadata import version

            facts["jinja2"] = version("jinja2")
        return facts

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        assert stage is not None
        tokenizer = planning.planned("tokenizer", stage.name)
        inputs: dict[str, Any] = {"sources": planning.sources_input(stage.name)}
        # The tokenizer step's output describes its tokens; the byte tokenizer is described here.
        described = BYTES if tokenizer is None else None
        config = DataStep(data=DataSettings.of(stage.data), tokenizer=described).to_config()
        if tokenizer is not None:
            inputs["tokenizer"] = tokenizer.hash
        toolchain = self.toolchain(config, planning.config.numerics, machine=planning.machine)
        return Step.create(f"{self.name}:{stage.name}", self.name, config, inputs, toolchain)


KIND = DataKind()
