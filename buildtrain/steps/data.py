"""The data step: ingest, tokenize (bytes, or a tokenizer step's tokenizer: `tokenized.py`), split
train/held-out, write token shards (`shards.py`; what train and eval read of them: `data_index.py`).

Streams from start to end: files are read in chunks, tokens go out in shards of fixed size, and only
a few MB of tokens are held in memory. Sources are read in the order of their content digests, which is
how the plan lists them, so neither file names nor locations influence the tokens. Needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from buildtrain.config.convert import converter
from buildtrain.config.schema import END_OF_DOCUMENT
from buildtrain.config.steps import DataStep
from buildtrain.steps import split
from buildtrain.steps.corpus import corpus
from buildtrain.steps.shards import ShardWriter, finish
from buildtrain.steps.sources import Source

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext


END_OF_DOCUMENT_TOKEN = np.array([END_OF_DOCUMENT], dtype="<u2")
ROUTE_TOKENS = 1 << 21  # tokens gathered before their whole blocks are routed: 4 MB, 2,048 blocks


class BlockRouter:
    """The byte-token stream cut into split blocks, each sent to its split, many at a time.

    Bytes are widened to uint16 little-endian tokens straight into a buffer of `ROUTE_TOKENS`;
    when it is full, its whole blocks are split at once (`split.held_out`) and written in runs
    of consecutive blocks of one split. Widening one byte at a time through a bytearray slice
    cost 256 ms per 80 MB here, numpy's conversion 20 ms. The shard writers copy what they are
    given, so the buffer is reused: what is left of a block moves to its front."""

    def __init__(self, writers: dict[str, ShardWriter], block_size: int, fraction: float, seed: int) -> None:
        self.writers, self.block_size, self.fraction, self.seed = writers, block_size, fraction, seed
        self.capacity = max(ROUTE_TOKENS, block_size)
        self.buffer = np.empty(self.capacity, dtype="<u2")
        self.filled = 0
        self.blocks = 0

    def add(self, data: bytes | np.ndarray) -> None:
        """Append bytes (each one token) or an array of tokens to the stream."""
        tokens = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        position = 0
        while position < len(tokens):
            take = min(self.capacity - self.filled, len(tokens) - position)
            self.buffer[self.filled : self.filled + take] = tokens[position : position + take]
            self.filled += take
            position += take
            if self.filled == self.capacity:
                self._route(last=False)

    def close(self) -> None:
        """Route what is left, the last block even if it is short."""
        self._route(last=True)

    def _route(self, *, last: bool) -> None:
        whole = self.filled // self.block_size
        count = whole + (1 if last and self.filled % self.block_size else 0)
        if count:
            held_out = split.held_out(self.seed, self.fraction, self.blocks, count)
            # runs of consecutive blocks in one split: one write each, no per-block work
            changes = np.flatnonzero(held_out[1:] != held_out[:-1]) + 1
            starts = [0, *changes.tolist()]
            ends = [*changes.tolist(), count]
            for first, end in zip(starts, ends, strict=True):
                tokens = self.buffer[first * self.block_size : min(end * self.block_size, self.filled)]
                self.writers["heldout" if held_out[first] else "train"].write(tokens.data)
            self.blocks += count
        rest = 0 if last else self.filled - whole * self.block_size  # less than a block
        self.buffer[:rest] = self.buffer[whole * self.block_size : whole * self.block_size + rest]
        self.filled = rest


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
    document_count = 0
    with ThreadPoolExecutor(max_workers=1) as pool:  # shards written and hashed beside the routing
        writers = {s: ShardWriter(out, s, settings.shard_tokens, pool=pool) for s in ("train", "heldout")}
        router = BlockRouter(writers, settings.split_block, settings.heldout_fraction, settings.split_seed)
        for _, document in corpus(settings.text, sources):
            for chunk in document:
                router.add(chunk)
            router.add(END_OF_DOCUMENT_TOKEN)
            document_count += 1
            if document_count % 1000 == 0:
                log.info("data_progress", documents=document_count, blocks=router.blocks)
        router.close()
        for writer in writers.values():
            writer.close()
    block_index = router.blocks
    return finish(
        out,
        writers,
        tokenizer=converter.unstructure(step.tokenizer),
        documents=document_count,
        blocks=block_index,
        units=f"{block_index} blocks of {settings.split_block} tokens",
        log=log,
    )
