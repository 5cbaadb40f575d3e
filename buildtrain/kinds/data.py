"""The data kind: a stage's sources read, tokenized, split into train and held-out, and written as
token shards. Needs no torch; its bits depend on buildtrain's code and, where a tokenizer step's
BPE encodes the text, on the `tokenizers` release."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from buildtrain.config.convert import converter
from buildtrain.config.schema import BYTE_VOCAB_SIZE, END_OF_DOCUMENT, DataConfig, Stage, TokenizerConfig
from buildtrain.kinds.kind import StepKind
from buildtrain.kinds.tokenizer import format_view, tokenizer_view
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import tokenizers_version

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


def byte_tokenizer() -> dict[str, Any]:
    """The byte tokenizer's description (other tokenizers are described by their step's output)."""
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


class DataKind(StepKind):
    name = "data"
    computes = "buildtrain.steps.data"
    headline = "data"
    per_stage = True
    reads_sources = True

    def library_facts(self, config: Mapping[str, Any]) -> dict[str, str]:
        # Encoding with a tokenizer step's BPE: the token ids are that library's numbers.
        return {} if "tokenizer" in config else {"tokenizers": tokenizers_version()}

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        assert stage is not None
        tokenizer = planning.planned("tokenizer", stage.name)
        inputs: dict[str, Any] = {"sources": planning.sources_input(stage.name)}
        config: dict[str, Any] = {"data": data_view(stage.data)}
        if tokenizer is None:
            config["tokenizer"] = byte_tokenizer()
        else:  # the description (vocabulary size, end-of-document id) comes from the tokenizer step
            inputs["tokenizer"] = tokenizer.hash
        toolchain = self.toolchain(config, planning.config.numerics)
        return Step.create(f"{self.name}:{stage.name}", self.name, config, inputs, toolchain)


KIND = DataKind()
