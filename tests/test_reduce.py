"""The canonical reduction tree: any division of the micro-batches among ranks performs exactly the
additions one process performs, so the sum has the same bits (and a different order would not)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.steps.train.reduce import (
    Node,
    Tree,
    children,
    cover,
    gradients_to_vector,
    tree_sum,
    vector_to_gradients,
)


def leaves(count: int, seed: int, length: int = 64) -> list[torch.Tensor]:
    """Vectors with magnitudes over many orders, so that the order of addition shows in the bits."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (count, length), generator=generator).float())
    return list(torch.randn(count, length, generator=generator) * scale)


def in_one_process(vectors: list[torch.Tensor]) -> torch.Tensor:
    return tree_sum((0, len(vectors)), lambda i: vectors[i].clone())


def from_partials(vectors: list[torch.Tensor], bounds: list[int]) -> torch.Tensor:
    """Each share [bounds[k], bounds[k+1]) sums its covering nodes; then the tree is completed."""
    root: Node = (0, len(vectors))
    partials = {}
    for first, end in itertools.pairwise(bounds):
        for node in cover(root, first, end):
            partials[node] = tree_sum(node, lambda i: vectors[i].clone())

    def no_leaf(micro: int) -> torch.Tensor:
        raise AssertionError(micro)

    return tree_sum(root, no_leaf, partials)


@st.composite
def divisions(draw: st.DrawFn) -> tuple[int, list[int]]:
    """A number of micro-batches and a division of them into contiguous, non-empty shares."""
    count = draw(st.integers(1, 24))
    cuts = draw(st.sets(st.integers(1, count - 1), max_size=count - 1)) if count > 1 else set()
    return count, [0, *sorted(cuts), count]


@settings(max_examples=150, deadline=None)
@given(divisions(), st.integers(0, 2**16))
def test_any_division_gives_the_bits_of_one_process(division: tuple[int, list[int]], seed: int) -> None:
    count, bounds = division
    vectors = leaves(count, seed)
    assert torch.equal(from_partials(vectors, bounds), in_one_process(vectors))


@given(st.integers(1, 64), st.data())
def test_cover_holds_each_micro_batch_exactly_once(count: int, data: st.DataObject) -> None:
    first = data.draw(st.integers(0, count - 1))
    end = data.draw(st.integers(first + 1, count))
    covered = [m for lo, hi in cover((0, count), first, end) for m in range(lo, hi)]
    assert covered == list(range(first, end))


def test_a_rank_with_an_aligned_share_sends_one_partial() -> None:
    """Powers of two divide into whole subtrees: one vector per rank to exchange."""
    for world in (1, 2, 4, 8):
        per_rank = 8 // world
        for rank in range(world):
            assert cover((0, 8), rank * per_rank, (rank + 1) * per_rank) == [
                (rank * per_rank, (rank + 1) * per_rank)
            ]


def test_children_split_at_the_midpoint() -> None:
    assert children((0, 4)) == ((0, 2), (2, 4))
    assert children((0, 5)) == ((0, 3), (3, 5))


def test_the_order_of_addition_matters() -> None:
    """Negative control: a left-to-right sum of the same vectors differs from the tree's, so the
    property above is a real constraint and not true of any order."""
    differing = 0
    for seed in range(20):
        vectors = leaves(6, seed)
        sequential = vectors[0].clone()
        for vector in vectors[1:]:
            sequential += vector
        differing += not torch.equal(sequential, in_one_process(vectors))
    assert differing > 0


def test_gradients_to_vector_and_back_round_trip() -> None:
    weights = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for weight in weights:
        weight.grad = torch.randn_like(weight)
    expected = [weight.grad.clone() for weight in weights]
    flat = gradients_to_vector(weights, torch.tensor(2.5))
    assert flat.shape == (3 * 4 + 5 + 1,)
    for weight in weights:
        weight.grad = None
    assert vector_to_gradients(flat, weights).item() == 2.5
    for weight, grad in zip(weights, expected, strict=True):
        assert torch.equal(weight.grad, grad)


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 33), seed=st.integers(0, 2**16), world=st.sampled_from([1, 2, 4]))
def test_the_tree_summed_as_leaves_arrive_has_the_bits_of_the_whole_tree(
    count: int, seed: int, world: int
) -> None:
    """Sharded training pushes one leaf per rank per pass, in micro-batch order."""
    vectors = leaves(count, seed)
    tree = Tree(count)
    for index, vector in enumerate(vectors):
        assert tree.total() is None
        tree.push(vector.clone())
        assert (tree.total() is None) == (index < count - 1)
        assert len(tree.stack) <= count.bit_length() + 1  # one pending sum per level at most
    total = tree.total()
    assert total is not None and torch.equal(total, in_one_process(vectors))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_one_micro_batch_on_one_rank_leaves_the_gradients_the_vector_would(seed: int) -> None:
    """The shortcut past the vector (one leaf, one rank) leaves the round trip's bits: the same
    gradients, zeros where backward reached no parameter, and the same loss."""
    from buildtrain.steps.train.gradient import backward_alone

    generator = torch.Generator().manual_seed(seed)
    used = torch.nn.Parameter(torch.randn(7, 5, generator=generator))
    unused = torch.nn.Parameter(torch.randn(3, generator=generator))
    x = torch.randn(4, 7, generator=generator)

    def backward() -> torch.Tensor:
        loss = (x @ used).square().mean() / 1
        loss.backward()
        return loss.detach()

    loss = backward_alone([used, unused], backward)
    alone = [used.grad.clone(), unused.grad.clone()]
    used.grad = unused.grad = None
    expected_loss = vector_to_gradients(gradients_to_vector([used, unused], backward()), [used, unused])
    assert torch.equal(loss.reshape(1).view(torch.int32), expected_loss.reshape(1).view(torch.int32))
    for mine, theirs in zip(alone, [used.grad, unused.grad], strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine.view(torch.int32), theirs.view(torch.int32))
