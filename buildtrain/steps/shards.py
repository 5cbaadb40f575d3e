"""How every data step ends: token shards of a fixed size per split, then `data.json`.

Shared by the byte data step (`data.py`) and the one that encodes with a tokenizer step's
tokenizer (`tokenized.py`). Needs no torch.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np

from buildtrain.canonical import canonical_bytes, digest
from buildtrain.errors import StepFailed
from buildtrain.steps.data_index import DATA_FORMAT, DATA_INDEX
from buildtrain.store.objects import write_bytes_durably
from buildtrain.store.tensors import tensor_digest

MAX_IN_FLIGHT = 4  # full shards handed to the pool and not yet written: 4 x 2 MB by default


class ShardWriter:
    """Writes one split as uint16 (or uint32) little-endian shard files of a fixed number of tokens.

    Tokens are copied (and converted) once, straight into the shard being filled. With a `pool`,
    a full shard is written and hashed in the pool's thread while the caller goes on (both
    release the GIL); at most `MAX_IN_FLIGHT` shards wait, so memory stays bounded. Names and
    digests are the same either way: a shard's name is fixed when it is handed over."""

    def __init__(
        self, folder: Path, split: str, shard_tokens: int, width: int = 2, pool: Executor | None = None
    ) -> None:
        # width 4 (uint32) for vocabularies past 65,536 ids; see data_index.token_width
        self.folder, self.split, self.width, self.pool = folder, split, width, pool
        self.dtype = np.dtype("<u2" if width == 2 else "<u4")
        self.shard_tokens = shard_tokens
        self.buffer = np.empty(0, dtype=self.dtype)  # allocated when the first token arrives
        self.filled = 0
        self.shards: list[dict[str, Any]] = []
        self.in_flight: deque[tuple[dict[str, Any], Future[str]]] = deque()

    def write(self, tokens: np.ndarray) -> None:
        """Append `tokens`, an array of token ids (any unsigned type that fits the width)."""
        position = 0
        while position < len(tokens):
            if not len(self.buffer):
                self.buffer = np.empty(self.shard_tokens, dtype=self.dtype)
            take = min(self.shard_tokens - self.filled, len(tokens) - position)
            self.buffer[self.filled : self.filled + take] = tokens[position : position + take]
            self.filled += take
            position += take
            if self.filled == self.shard_tokens:
                self._flush()

    def close(self) -> None:
        if self.filled:
            self._flush()
        while self.in_flight:
            self._settle()

    def _flush(self) -> None:
        raw, count = self.buffer[: self.filled], self.filled
        self.buffer, self.filled = np.empty(0, dtype=self.dtype), 0  # the full one belongs to the flush
        name = f"{self.split}-{len(self.shards):05d}.bin"
        shard: dict[str, Any] = {"file": name, "tokens": count, "digest": ""}
        self.shards.append(shard)
        dtype = "u16" if self.width == 2 else "u32"
        if self.pool is None:
            shard["digest"] = _store_shard(self.folder / name, dtype, raw)
            return
        self.in_flight.append((shard, self.pool.submit(_store_shard, self.folder / name, dtype, raw)))
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self._settle()

    def _settle(self) -> None:
        shard, future = self.in_flight.popleft()
        shard["digest"] = future.result()

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)


def _store_shard(path: Path, dtype: str, tokens: np.ndarray) -> str:
    """Write one shard file and return its tensor digest."""
    raw = tokens.data.cast("B")
    path.write_bytes(raw)
    return tensor_digest(path.name, dtype, [len(tokens)], raw)


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
