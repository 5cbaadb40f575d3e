"""The tokenizer kind: a byte-level BPE trained on a stage's text, or a given tokenizer file.

A stage whose `data.tokenizer` is a table gets a `tokenizer` step; its hash covers the tokenizer
settings and only the data settings that choose its training text (source, format, field, split),
so a change of `shard_tokens` or of training settings never retrains it, and every stage or plan
that asks for the same tokenizer on the same text shares the step. A given file enters as its
content digest and size: renaming it changes nothing, editing one byte changes the hash.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from buildtrain.config.convert import converter
from buildtrain.config.schema import DataConfig, Stage, TokenizerConfig
from buildtrain.errors import ConfigError
from buildtrain.kinds.kind import StepKind
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import tokenizers_version

if TYPE_CHECKING:
    from buildtrain.kinds.planning import Planning


def tokenizer_view(tokenizer: TokenizerConfig) -> dict[str, Any]:
    """The settings without the path: a file's content enters the step's inputs instead."""
    if tokenizer.kind == "file":
        return {"kind": "file", "end_of_document": tokenizer.end_of_document}
    return {
        "kind": "bpe",
        "vocab_size": tokenizer.vocab_size,
        "min_frequency": tokenizer.min_frequency,
        "end_of_document": tokenizer.end_of_document,
    }


def format_view(data: DataConfig) -> dict[str, Any]:
    """The format keys, only where they say something: plans of plain text files keep their hashes."""
    if data.format == "jsonl":
        return {"format": "jsonl", "text_field": data.text_field}
    if data.format == "parquet":
        return {"format": "parquet", "text_column": data.text_column}
    return {}


def text_view(data: DataConfig, synthetic: dict[str, Any] | None) -> dict[str, Any]:
    """What chooses the training text: the corpus and the train/held-out split of its pieces."""
    view: dict[str, Any] = {
        "source": data.source,
        "split_block": data.split_block,
        "heldout_fraction": data.heldout_fraction,
        "split_seed": data.split_seed,
        **format_view(data),
    }
    if synthetic is not None:
        view["synthetic"] = synthetic
    return view


class TokenizerKind(StepKind):
    name = "tokenizer"
    computes = "buildtrain.steps.tokenizer"
    headline = "tokenizer"
    per_stage = True
    reads_sources = True

    def library_facts(self, config: Mapping[str, Any]) -> dict[str, str]:
        return {"tokenizers": tokenizers_version()}  # a trained vocabulary is that library's numbers

    def plan(self, planning: Planning, stage: Stage | None) -> Step | None:
        """The stage's tokenizer step, or None for the byte tokenizer. A stage that starts from
        another's weights keeps its tokenizer (the ids must mean the same tokens)."""
        assert stage is not None
        if stage.init_from is not None:
            if stage.data.tokenizer != planning.config.stage(stage.init_from).data.tokenizer:
                raise ConfigError(
                    [
                        f"stages.{stage.name}.data.tokenizer: differs from the tokenizer of stage "
                        f"'{stage.init_from}', whose weights it starts from; a stage keeps its parent's "
                        "tokenizer, so leave it out"
                    ]
                )
            return planning.planned(self.name, stage.init_from)
        tokenizer = stage.data.tokenizer
        if not isinstance(tokenizer, TokenizerConfig):
            return None
        if tokenizer.kind == "file":
            given = planning.tokenizer_files[stage.name]  # the planner digests every tokenizer file
            config: dict[str, Any] = {"tokenizer": tokenizer_view(tokenizer)}
            inputs = {"sources": [{"blake3": given.blake3, "size": given.size}]}
        else:
            data = stage.data
            synthetic = converter.unstructure(data.synthetic) if data.source == "synthetic" else None
            config = {"tokenizer": tokenizer_view(tokenizer), "text": text_view(stage.data, synthetic)}
            inputs = {"sources": planning.sources_input(stage.name)}
        toolchain = self.toolchain(config, planning.config.numerics)
        return Step.create(f"{self.name}:{stage.name}", self.name, config, inputs, toolchain)


KIND = TokenizerKind()
