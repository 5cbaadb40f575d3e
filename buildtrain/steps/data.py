"""The data step: ingest, tokenize (bytes), split train/held-out, write token shards.

Streams from start to end: files are read in chunks, tokens go out in shards of fixed size, and only
one split block is held in memory. Sources are read in the order of their content digests, which is
how the plan lists them, so neither file names nor locations influence the tokens. Needs no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.config.convert import converter
from buildtrain.config.schema import BYTE_VOCAB_SIZE, END_OF_DOCUMENT, SyntheticConfig
from buildtrain.errors import StepFailed
from buildtrain.steps.seeds import derive_unit
from buildtrain.steps.text import TextSettings, corpus
from buildtrain.store.objects import write_bytes_durably
from buildtrain.store.tensors import tensor_digest

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext

DATA_FORMAT = 1
DATA_INDEX = "data.json"


@attrs.frozen(kw_only=True)
class DataSettings:
    """The data section as a data step's config holds it: no paths (the files arrive as sources,
    in plan order), and the synthetic corpus only when it is the source."""

    source: str
    synthetic: SyntheticConfig | None = None
    tokenizer: Any  # "bytes", or the settings of the tokenizer step the data step reads
    format: str = "text"  # the format keys appear only where they say something (plan/tokenizers.py)
    text_field: str = "text"
    text_column: str = "text"
    heldout_fraction: float
    split_block: int
    split_seed: int
    shard_tokens: int

    @property
    def text(self) -> TextSettings:
        return TextSettings.from_config(converter.unstructure(self))


@attrs.frozen(kw_only=True)
class TokenizerDescription:
    """How text becomes tokens, as the plan describes it and the outputs record it."""

    type: str
    vocab_size: int
    end_of_document: int


@attrs.frozen(kw_only=True)
class DataStep:
    """A data step's config, typed."""

    data: DataSettings
    tokenizer: TokenizerDescription | None = None  # None: a tokenizer step's output describes it

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DataStep:
        """From the plan's step config (`Step.config`), which stays a plain dict for the hash."""
        return converter.structure(config, cls)


def vocab_size(index: dict[str, Any]) -> int:
    """The size of the vocabulary a data step's tokens come from, as its `data.json` records it."""
    return int(index["tokenizer"].get("vocab_size", BYTE_VOCAB_SIZE))


def widen(chunk: bytes) -> bytearray:
    """Bytes as uint16 little-endian tokens, at C speed: each byte becomes a low byte."""
    wide = bytearray(2 * len(chunk))
    wide[0::2] = chunk
    return wide


END_OF_DOCUMENT_BYTES = END_OF_DOCUMENT.to_bytes(2, "little")


class ShardWriter:
    """Writes one split as uint16 little-endian shard files of a fixed number of tokens."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, width: int = 2) -> None:
        # width 4 (uint32) for vocabularies past 65,536 ids; see steps/tokenized.py
        self.folder, self.split, self.width = folder, split, width
        self.shard_bytes = width * shard_tokens
        self.buffer = bytearray()
        self.shards: list[dict[str, Any]] = []

    def write(self, tokens: bytes | bytearray) -> None:
        self.buffer += tokens
        while len(self.buffer) >= self.shard_bytes:
            self._flush(bytes(self.buffer[: self.shard_bytes]))
            del self.buffer[: self.shard_bytes]

    def close(self) -> None:
        if self.buffer:
            self._flush(bytes(self.buffer))
            self.buffer = bytearray()

    def _flush(self, raw: bytes) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        (self.folder / name).write_bytes(raw)
        count = len(raw) // self.width
        dtype = "u16" if self.width == 2 else "u32"
        self.shards.append(
            {"file": name, "tokens": count, "digest": tensor_digest(name, dtype, [count], raw)}
        )

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)


def execute(ctx: StepContext, out: Path) -> dict[str, str]:
    return build_from_plan(ctx.step.config, ctx.sources, out, ctx.log, ctx.inputs.get("tokenizer"))


def build_from_plan(
    config: dict[str, Any], sources: list[Path], out: Path, log: Any, tokenizer: Path | None = None
) -> dict[str, str]:
    """A data step's output from its config as the plan holds it (`Step.config`) and, for a BPE
    or a given tokenizer.json, the tokenizer step's output."""
    if tokenizer is not None:
        from buildtrain.steps.tokenized import build_tokenized

        return build_tokenized(DataStep.from_config(config).data, sources, tokenizer, out, log)
    return build(DataStep.from_config(config), sources, out, log)


def build(step: DataStep, sources: list[Path], out: Path, log: Any) -> dict[str, str]:
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


def finish(
    out: Path,
    writers: dict[str, ShardWriter],
    *,
    tokenizer: dict[str, Any],
    documents: int,
    blocks: int,
    units: str,
    log: Any,
) -> dict[str, str]:
    """Close the shards, refuse an empty split (`units` says what the corpus was cut into), write
    `data.json` and return the output's logical digests: the end of every data step."""
    for writer in writers.values():
        writer.close()
    for split, writer in writers.items():
        if writer.tokens < 2:
            raise StepFailed(
                f"the {split} split is empty: the corpus has {units}; "
                "use more data, a smaller data.split_block, or another data.heldout_fraction"
            )
    splits: dict[str, Any] = {s: {"tokens": w.tokens, "shards": w.shards} for s, w in writers.items()}
    for writer, split in zip(writers.values(), splits.values(), strict=True):
        if writer.width != 2:
            split["dtype"] = "u32"  # only when wide: uint16 indexes keep their meaning
    index = {"format": DATA_FORMAT, "tokenizer": tokenizer, "documents": documents, "splits": splits}
    write_bytes_durably(out / DATA_INDEX, canonical_bytes(index))
    digests = {shard["file"]: shard["digest"] for w in writers.values() for shard in w.shards}
    digests["data"] = digest("data", {s: [x["digest"] for x in w.shards] for s, w in writers.items()})
    log.info(
        "data_built",
        documents=documents,
        train_tokens=writers["train"].tokens,
        heldout_tokens=writers["heldout"].tokens,
        blocks=blocks,
    )
    return digests
