"""The data step: ingest, tokenize (bytes, or a tokenizer step's tokenizer: `tokenized.py`), split
train/held-out, write token shards (`shards.py`; what train and eval read of them: `data_index.py`).

Streams from start to end: files are read in chunks, tokens go out in shards of fixed size, and only
a few MB of tokens are held in memory. Sources are read in the order of their content digests, which is
how the plan lists them, so neither file names nor locations influence the tokens. Needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from buildtrain.config.convert import converter
from buildtrain.config.schema import END_OF_DOCUMENT
from buildtrain.config.steps import DataStep
from buildtrain.steps.corpus import corpus
from buildtrain.steps.data import split
from buildtrain.steps.data.documents import Recorder
from buildtrain.steps.data.shards import ShardWriter, finish
from buildtrain.steps.sources import Source

if TYPE_CHECKING:
    from buildtrain.steps.context import StepContext


END_OF_DOCUMENT_TOKEN = np.array([END_OF_DOCUMENT], dtype="<u2")
BULK_BLOCKS = 8  # whole blocks in hand from which they are routed by a mask rather than by runs


class BlockRouter:
    """The byte-token stream cut into split blocks, each block's tokens sent to its split.

    Which split a block goes to depends on its index alone, so it is known before its bytes
    arrive (`split.SplitRuns`, decided many blocks at a time): bytes are copied once, from the
    chunk just read straight into the shard of their split, widened to uint16 on the way, a run
    of consecutive blocks of one split at a time. Widening one byte at a time through a
    bytearray slice cost 256 ms per 80 MB here, numpy's conversion 20 ms."""

    def __init__(self, writers: dict[str, ShardWriter], block_size: int, fraction: float, seed: int) -> None:
        self.writers, self.block_size = writers, block_size
        self.runs = split.SplitRuns(seed, fraction)
        self.tokens = 0  # so far in the stream

    @property
    def blocks(self) -> int:
        """Blocks begun so far: the last one may be short."""
        return -(-self.tokens // self.block_size)

    def add(self, data: bytes | np.ndarray) -> None:
        """Append bytes (each one token) or an array of tokens to the stream."""
        tokens = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        position = 0
        while position < len(tokens):
            whole = (len(tokens) - position) // self.block_size
            if self.tokens % self.block_size == 0 and whole >= BULK_BLOCKS:
                position += self._whole_blocks(tokens[position : position + whole * self.block_size])
                continue
            held_out, run_end = self.runs.run(self.tokens // self.block_size)
            take = min(run_end * self.block_size - self.tokens, len(tokens) - position)
            self.writers["heldout" if held_out else "train"].write(tokens[position : position + take])
            position += take
            self.tokens += take

    def _whole_blocks(self, tokens: np.ndarray) -> int:
        """Route whole blocks from a block boundary: each split's blocks gathered in one copy of
        the bytes (one call per split instead of one per run: 80 MB has 7,600 runs)."""
        rows = tokens.reshape(-1, self.block_size)
        held_out = self.runs.blocks(self.tokens // self.block_size, len(rows))
        for flag, name in ((False, "train"), (True, "heldout")):
            chosen = held_out == flag
            if chosen.all():
                self.writers[name].write(tokens)
            elif chosen.any():
                self.writers[name].write(rows[chosen].reshape(-1))
        self.tokens += len(tokens)
        return len(tokens)


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
        from buildtrain.steps.data.tokenized import build_tokenized  # numpy and tokenizers

        step = DataStep.from_config(config)
        settings = step.data
        if settings.format == "chat":
            from buildtrain.steps.data.chat import build_chat  # jinja2

            return build_chat(settings.text, settings.shard_tokens, sources, tokenizer, out, log)
        return build_tokenized(settings.text, settings.shard_tokens, sources, tokenizer, out, log)
    return build(DataStep.from_config(config), sources, out, log)


def build(step: DataStep, sources: Sequence[Source | Path], out: Path, log: Any) -> dict[str, str]:
    """Write byte-token shards and `data.json` into `out`; return the logical digests of the output."""
    settings = step.data
    document_count = 0
    # No helper threads: writing and hashing shards in one and reading ahead in another (both
    # release the GIL) took 448 ms median per 80 MB against 229 ms in this thread alone; the
    # reader thread alone 279 ms, the writer alone 320 ms, against 203 ms (alternated rounds,
    # 2 shared cores at load 4-6): a thread that holds the GIL when it is preempted stalls all.
    writers = {s: ShardWriter(out, s, settings.shard_tokens) for s in ("train", "heldout")}
    router = BlockRouter(writers, settings.split_block, settings.heldout_fraction, settings.split_seed)
    recorder = Recorder()
    for _, document in recorder.documents(corpus(settings.text, sources)):
        for chunk in document:
            router.add(chunk)
        router.add(END_OF_DOCUMENT_TOKEN)
        document_count += 1
        if document_count % 1000 == 0:
            log.info("data_progress", documents=document_count, blocks=router.blocks)
    block_index = router.blocks
    return finish(
        out,
        writers,
        tokenizer=converter.unstructure(step.tokenizer),
        documents=document_count,
        blocks=block_index,
        units=f"{block_index} blocks of {settings.split_block} tokens",
        log=log,
        recorder=recorder,
    )
