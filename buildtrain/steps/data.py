"""The data step: ingest, tokenize (bytes, or a tokenizer step's tokenizer: `tokenized.py`), split
train/held-out, write token shards (`shards.py`; what train and eval read of them: `data_index.py`).

Streams from start to end: files are read in chunks, tokens go out in shards of fixed size, and only
one split block is held in memory. Sources are read in the order of their content digests, which is
how the plan lists them, so neither file names nor locations influence the tokens. Needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buildtrain.config.convert import converter
from buildtrain.config.schema import END_OF_DOCUMENT
from buildtrain.config.steps import DataStep
from buildtrain.steps.corpus import corpus
from buildtrain.steps.seeds import derive_unit
from buildtrain.steps.shards import ShardWriter, finish
from buildtrain.steps.sources import Source

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext


def widen(chunk: bytes) -> bytearray:
    """Bytes as uint16 little-endian tokens, at C speed: each byte becomes a low byte."""
    wide = bytearray(2 * len(chunk))
    wide[0::2] = chunk
    return wide


END_OF_DOCUMENT_BYTES = END_OF_DOCUMENT.to_bytes(2, "little")


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    return build_from_plan(ctx.step.config, ctx.sources, out, ctx.log, ctx.inputs.get("tokenizer"))


def build_from_plan(
    config: dict[str, Any],
    sources: Sequence[Source | Path],
    out: Path,
    log: Any,
    tokenizer: Path | None = None,
) -> dict[str, str]:
    """A data step's output from its config as the plan holds it (`Step.config`) and, for a BPE
    or a given tokenizer.json, the tokenizer step's output. `sources` are checked against the
    plan as they are read when they are `Source`s (what the executor hands a step)."""
    if tokenizer is not None:
        from buildtrain.steps.tokenized import build_tokenized  # numpy and tokenizers

        settings = DataStep.from_config(config).data
        return build_tokenized(settings.text, settings.shard_tokens, sources, tokenizer, out, log)
    return build(DataStep.from_config(config), sources, out, log)


def build(step: DataStep, sources: Sequence[Source | Path], out: Path, log: Any) -> dict[str, str]:
    """Write byte-token shards and `data.json` into `out`; return the logical digests of the output."""
    settings = step.data
    block_size, fraction, split_seed = settings.split_block, settings.heldout_fraction, settings.split_seed
    writers = {split: ShardWriter(out, split, settings.shard_tokens) for split in ("train", "heldout")}
    block = bytearray()  # the current split block, as uint16 little-endian bytes
    block_bytes = 2 * block_size
    block_index = 0
    document_count = 0

    def route(tokens: bytes | bytearray) -> None:
        nonlocal block_index
        held_out = derive_unit(split_seed, "heldout", block_index) < fraction
        writers["heldout" if held_out else "train"].write(tokens)
        block_index += 1

    def append(tokens: bytes | bytearray) -> None:
        nonlocal block
        position = 0
        while position < len(tokens):
            take = min(block_bytes - len(block), len(tokens) - position)
            block += tokens[position : position + take]
            position += take
            if len(block) == block_bytes:
                route(block)
                block = bytearray()

    for _, document in corpus(settings.text, sources):
        for chunk in document:
            append(widen(chunk))
        append(END_OF_DOCUMENT_BYTES)
        document_count += 1
        if document_count % 1000 == 0:
            log.info("data_progress", documents=document_count, blocks=block_index)
    if block:
        route(block)
    return finish(
        out,
        writers,
        tokenizer=converter.unstructure(step.tokenizer),
        documents=document_count,
        blocks=block_index,
        units=f"{block_index} blocks of {block_size} tokens",
        log=log,
    )
