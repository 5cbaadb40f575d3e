"""How every data step ends: token shards of a fixed size per split, then `data.json`.

Shared by the byte data step (`data.py`) and the one that encodes with a tokenizer step's
tokenizer (`tokenized.py`). Needs no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import StepFailed
from buildtrain.sources.durable import write_bytes_durably
from buildtrain.steps.data.documents import Recorder
from buildtrain.steps.data.index import DATA_FORMAT, DATA_INDEX
from buildtrain.store.tensors import tensor_digest

WIDTHS = {1: ("<u1", "u8"), 2: ("<u2", "u16"), 4: ("<u4", "u32")}  # bytes -> numpy dtype, digest code


class ShardWriter:
    """Writes one split as uint16 (or uint32) little-endian shard files of a fixed number of tokens.

    Tokens are copied (and converted) once, straight into the shard being filled; a full shard
    is written and hashed, and its buffer filled again."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, width: int = 2) -> None:
        # width 4 (uint32) for vocabularies past 65,536 ids; see data_index.token_width; width 1
        # (uint8) for the loss masks of chat records
        self.folder, self.split, self.width = folder, split, width
        self.buffer = np.empty(shard_tokens, dtype=WIDTHS[width][0])
        self.filled = 0
        self.shards: list[dict[str, Any]] = []

    def write(self, tokens: np.ndarray) -> None:
        """Append `tokens`, an array of token ids (any unsigned type that fits the width)."""
        position = 0
        while position < len(tokens):
            take = min(len(self.buffer) - self.filled, len(tokens) - position)
            self.buffer[self.filled : self.filled + take] = tokens[position : position + take]
            self.filled += take
            position += take
            if self.filled == len(self.buffer):
                self._flush()

    def close(self) -> None:
        if self.filled:
            self._flush()

    def _flush(self) -> None:
        raw = self.buffer[: self.filled].data.cast("B")
        name = f"{self.split}-{len(self.shards):05d}.bin"
        (self.folder / name).write_bytes(raw)
        dtype = WIDTHS[self.width][1]
        digest = tensor_digest(name, dtype, [self.filled], raw)
        self.shards.append({"file": name, "tokens": self.filled, "digest": digest})
        self.filled = 0

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)


def finish(
    out: Path,
    writers: dict[str, ShardWriter],
    *,
    tokenizer: dict[str, Any],
    documents: int,
    blocks: int,
    units: str,
    log: Any,
    recorder: Recorder,
    masks: dict[str, ShardWriter] | None = None,
) -> dict[str, str]:
    """Close the shards, refuse an empty split (`units` says what the corpus was cut into), write
    `data.json` and return the output's logical digests: the end of every data step. `masks`:
    each split's loss masks, one byte per token (chat records)."""
    for writer in [*writers.values(), *(masks or {}).values()]:
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
    for name, writer in (masks or {}).items():
        splits[name]["masks"] = writer.shards  # only with masks: other indexes keep their bytes
    index = {"format": DATA_FORMAT, "tokenizer": tokenizer, "documents": documents, "splits": splits}
    write_bytes_durably(out / DATA_INDEX, canonical_bytes(index))
    every = [*writers.items(), *(masks or {}).items()]
    digests = {shard["file"]: shard["digest"] for _, w in every for shard in w.shards}
    shards = {s: [x["digest"] for x in w.shards] for s, w in writers.items()}
    if masks:
        shards.update({f"{s}-mask": [x["digest"] for x in w.shards] for s, w in masks.items()})
    digests["data"] = digest("data", shards)
    digests.update(recorder.write(out))  # what the contamination check intersects
    log.info(
        "data_built",
        documents=documents,
        train_tokens=writers["train"].tokens,
        heldout_tokens=writers["heldout"].tokens,
        blocks=blocks,
    )
    return digests
