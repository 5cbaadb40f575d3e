"""`Ranks.finish_tree` across real processes (gloo): three ranks completing trees whose shares
are not whole subtrees, over vectors that do not split evenly into shards, give exactly the bits
of one process summing everything."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from buildtrain.steps.train.ranks import Ranks
from buildtrain.steps.train.reduce import cover, tree_sum

WORLD = 3
LENGTH = 101  # not a multiple of the world size: the last shard is padded
MICRO_BATCHES = (3, 6, 9, 12)


def leaves(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    scale = torch.exp2(torch.randint(-20, 20, (count, LENGTH), generator=generator).float())
    return list(torch.randn(count, LENGTH, generator=generator) * scale)


def summed(vectors: list[torch.Tensor], node: tuple[int, int]) -> torch.Tensor:
    """The tree node over `vectors` as one process computes it."""
    return tree_sum(node, lambda i: vectors[i].clone())


def rank_main(rank: int, rendezvous: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    ranks = Ranks(rank, WORLD)
    totals = {}
    for count in MICRO_BATCHES:
        vectors = leaves(count)
        partials = {node: summed(vectors, node) for node in cover((0, count), *ranks.share(count))}
        totals[str(count)] = ranks.finish_tree(partials, count)
    torch.save(totals, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_three_ranks_finish_the_tree_of_one_process(tmp_path: Path) -> None:
    mp.spawn(rank_main, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=WORLD)
    for count in MICRO_BATCHES:
        alone = summed(leaves(count), (0, count))
        for rank in range(WORLD):
            total = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)[str(count)]
            assert torch.equal(total, alone), (count, rank)
