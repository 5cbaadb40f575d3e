"""Packed training batches streamed from memory-mapped token shards.

Sample g of a run is window `order(epoch, i)` of the train split, with epoch, i = divmod(g, n):
each epoch visits every window of `seq_len + 1` tokens once, in an order that is a pure function of
(seed, epoch, i). The data cursor is therefore a single integer (samples consumed so far), and a
micro-batch is a pure function of (seed, cursor, micro-batch index), whichever process or rank
computes it. Sequences cross document boundaries (packing): no padding, fixed tokens per batch.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path
from typing import Any

import torch

from buildtrain.errors import StepFailed
from buildtrain.steps.seeds import derive_seed

M64 = (1 << 64) - 1


class TokenStream:
    """One split (train or held-out) of a data step's output, as a flat token sequence."""

    def __init__(self, folder: Path, split: dict[str, Any], key: str = "shards") -> None:
        """`key`: "shards" for the tokens, "masks" for their loss masks (one byte each)."""
        self.maps: list[mmap.mmap] = []
        self.shards: list[torch.Tensor] = []
        self.starts: list[int] = []
        total = 0
        for shard in split[key]:
            with open(folder / shard["file"], "rb") as handle:
                # A private copy-on-write map: pages load lazily, and torch gets a writable buffer.
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self.maps.append(mapped)
            # uint32 when the vocabulary passes 65,536 ids (see steps/data/index.py)
            wide = split.get("dtype") == "u32"
            dtype = torch.uint8 if key == "masks" else torch.uint32 if wide else torch.uint16
            self.shards.append(torch.frombuffer(mapped, dtype=dtype))
            self.starts.append(total)
            total += shard["tokens"]
        self.length = total

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start + length) as int64, crossing shard boundaries as needed."""
        pieces, position, remaining = [], start, length
        for shard, shard_start in zip(self.shards, self.starts, strict=True):
            if remaining == 0:
                break
            if position >= shard_start + len(shard):
                continue
            offset = position - shard_start
            take = min(remaining, len(shard) - offset)
            pieces.append(shard[offset : offset + take].to(torch.int64))
            position += take
            remaining -= take
        if remaining:
            raise IndexError(f"tokens [{start}, {start + length}) outside a split of {self.length}")
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def windows(self, starts: list[int], length: int) -> torch.Tensor:
        """Rows of `length` tokens starting at each of `starts`, as int64 (B, length).

        One gather when all rows lie in one shard (the common case), row by row otherwise.
        """
        for shard, shard_start in zip(self.shards, self.starts, strict=True):
            if all(shard_start <= s and s + length <= shard_start + len(shard) for s in starts):
                offsets = torch.tensor(starts, dtype=torch.int64) - shard_start
                return shard[offsets[:, None] + torch.arange(length)].to(torch.int64)
        return torch.stack([self.read(start, length) for start in starts])


def _mix(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & M64
    return value ^ (value >> 31)


class WindowOrder:
    """A keyed permutation of range(n) per epoch: a 4-round Feistel network with cycle walking.

    Stateless and O(1) in memory, so it scales to any corpus and needs no checkpointing.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, bounded
    def _keys(self, epoch: int) -> tuple[int, ...]:
        return tuple(derive_seed(self.seed, "window-order", epoch, r) for r in range(4))

    def __call__(self, epoch: int, index: int) -> int:
        keys = self._keys(epoch)
        value = index
        while True:
            left, right = value >> self.half, value & self.mask
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
            value = (left << self.half) | right
            if value < self.n:
                return value


class Batches:
    """Micro-batches of packed sequences for one training stage."""

    def __init__(
        self, stream: TokenStream, seq_len: int, seed: int, masks: TokenStream | None = None
    ) -> None:
        self.stream = stream
        self.masks = masks  # chat records: 1 where a target counts in the loss
        self.seq_len = seq_len
        self.windows = (len(stream) - 1) // seq_len
        if self.windows < 1:
            raise StepFailed(
                f"the train split has {len(stream)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                "lower train.seq_len or give the stage more data"
            )
        self.order = WindowOrder(self.windows, seed)

    def start(self, index: int) -> int:
        """Where global sample `index` starts in the split."""
        epoch, position = divmod(index, self.windows)
        return self.order(epoch, position) * self.seq_len

    def starts(self, cursor: int, micro: int, size: int) -> list[int]:
        first = cursor + micro * size
        return [self.start(first + j) for j in range(size)]

    def micro_batch(self, cursor: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) of micro-batch `micro` of the step starting at `cursor`."""
        rows = self.stream.windows(self.starts(cursor, micro, size), self.seq_len + 1)  # (B, T + 1)
        return rows[:, :-1], rows[:, 1:]

    def target_masks(self, cursor: int, micro: int, size: int) -> torch.Tensor | None:
        """The loss masks (B, T) of that micro-batch's targets; None where every target counts."""
        if self.masks is None:
            return None
        return self.masks.windows(self.starts(cursor, micro, size), self.seq_len + 1)[:, 1:]
