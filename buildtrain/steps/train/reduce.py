"""How the micro-batch gradients of one update become the batch gradient.

Floating-point addition is not associative, so the order of the sum decides the bits. The
`invariant` reduction fixes that order once, as a binary tree over the micro-batches that depends
only on their number: node (lo, hi) is the sum of micro-batches lo..hi-1, split at the midpoint.
However the micro-batches are divided among processes, each process evaluates the tree nodes that
cover its share, and whoever finishes the tree performs exactly the additions a single process
would have performed. So any world size gives the same bits, including world size 1.

The gradient travels as one flat float32 vector per micro-batch: every parameter's gradient, then
the (scaled) loss, so the loss is summed in the same tree and its bits do not depend on the world
size either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Node = tuple[int, int]  # the micro-batches [lo, hi) this subtree sums


def children(node: Node) -> tuple[Node, Node]:
    lo, hi = node
    middle = lo + (hi - lo + 1) // 2
    return (lo, middle), (middle, hi)


def cover(node: Node, first: int, end: int) -> list[Node]:
    """The fewest tree nodes below `node` that together hold exactly micro-batches [first, end)."""
    lo, hi = node
    if end <= lo or hi <= first:
        return []
    if first <= lo and hi <= end:
        return [node]
    left, right = children(node)
    return cover(left, first, end) + cover(right, first, end)


def tree_sum(
    node: Node, leaf: Callable[[int], torch.Tensor], known: Mapping[Node, torch.Tensor] | None = None
) -> torch.Tensor:
    """Evaluate `node` depth first: a partial sum from `known` if it has one, a leaf, or left + right.

    Depth first keeps at most one pending vector per tree level, not one per micro-batch.
    """
    if known is not None and node in known:
        return known[node]
    lo, hi = node
    if hi - lo == 1:
        return leaf(lo)
    left, right = children(node)
    total = tree_sum(left, leaf, known)
    total += tree_sum(right, leaf, known)  # in place, the same bits as left + right
    return total


def gradients_to_vector(parameters: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    """One vector: each parameter's gradient (zeros where it has none), then the loss."""
    parts = [
        p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
        for p in parameters
    ]
    return torch.cat([*parts, loss.detach().reshape(1).to(parts[0].dtype)])


def vector_to_gradients(flat: torch.Tensor, parameters: list[torch.Tensor]) -> torch.Tensor:
    """Set each parameter's gradient from the vector; returns the loss at its end."""
    offset = 0
    for parameter in parameters:
        count = parameter.numel()
        parameter.grad = flat[offset : offset + count].view_as(parameter)  # a view: no copy
        offset += count
    return flat[offset]
