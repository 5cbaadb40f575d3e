"""The tokenizer step of a plan: what it reads and how a data or export step refers to it.

A stage whose `data.tokenizer` is a table gets a `tokenizer` step; its hash covers the tokenizer
settings and only the data settings that choose its training text (source, format, field, split),
so a change of `shard_tokens` or of training settings never retrains it, and every stage or plan
that asks for the same tokenizer on the same text shares the step. A given file enters as its
content digest and size: renaming it changes nothing, editing one byte changes the hash.
"""

from __future__ import annotations

from typing import Any

from buildtrain.config.schema import DataConfig, NumericsConfig, TokenizerConfig
from buildtrain.plan.plan import Step
from buildtrain.plan.toolchain import fingerprint, library_facts
from buildtrain.store.sources import SourceFile


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


def tokenizer_step(
    label: str,
    data: DataConfig,
    synthetic: dict[str, Any] | None,
    sources: list[dict[str, Any]],
    given: SourceFile | None,
    numerics: NumericsConfig,
) -> Step | None:
    """The tokenizer step of a stage, or None for the byte tokenizer."""
    tokenizer = data.tokenizer
    if not isinstance(tokenizer, TokenizerConfig):
        return None
    toolchain = {**fingerprint("tokenizer", numerics), **library_facts("tokenizer", {})}
    if tokenizer.kind == "file":
        assert given is not None, "the planner digests every tokenizer file"
        inputs = {"sources": [{"blake3": given.blake3, "size": given.size}]}
        return Step.create(label, "tokenizer", {"tokenizer": tokenizer_view(tokenizer)}, inputs, toolchain)
    config = {"tokenizer": tokenizer_view(tokenizer), "text": text_view(data, synthetic)}
    return Step.create(label, "tokenizer", config, {"sources": sources}, toolchain)
