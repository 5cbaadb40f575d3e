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


class Tree:
    """The canonical tree evaluated as its leaves arrive, in micro-batch order.

    Sharded training receives micro-batch gradients a few at a time (one per rank per pass), so
    it cannot call `tree_sum` with every leaf at hand. A node is summed as soon as both of its
    children are: the same additions, left += right, as `tree_sum` performs, so the same bits,
    with at most one pending partial sum per tree level.
    """

    def __init__(self, leaves: int) -> None:
        self.leaves = leaves
        self.parents: dict[tuple[Node, Node], Node] = {}
        pending = [(0, leaves)]
        while pending:
            node = pending.pop()
            if node[1] - node[0] > 1:
                left, right = children(node)
                self.parents[(left, right)] = node
                pending += [left, right]
        self.stack: list[tuple[Node, torch.Tensor]] = []
        self.pushed = 0

    def push(self, leaf: torch.Tensor) -> None:
        """Add the next micro-batch's vector (summed into in place: pass one nobody reads after)."""
        node, total = (self.pushed, self.pushed + 1), leaf
        self.pushed += 1
        while self.stack and (self.stack[-1][0], node) in self.parents:
            left_node, left = self.stack.pop()
            left += total
            node, total = self.parents[(left_node, node)], left
        self.stack.append((node, total))

    def total(self) -> torch.Tensor | None:
        """The root's sum once every leaf arrived, else None."""
        if self.pushed == self.leaves:
            assert len(self.stack) == 1
            return self.stack[0][1]
        return None
