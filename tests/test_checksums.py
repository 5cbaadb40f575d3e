"""Per-update checksums of the weights, computed where the weights live (the GPU's record between
checkpoints): exact integer sums, so the same on any device and thread count, and sensitive to a
change in any element or to two elements trading places."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.steps.train import state
from buildtrain.steps.train.state import checksums

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def values(size: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 100_000),
    seed=st.integers(0, 2**16),
    where=st.floats(0, 1, exclude_max=True),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_changing_one_element_changes_the_checksum(size: int, seed: int, where: float, dtype) -> None:
    tensor = values(size, seed, dtype)
    changed = tensor.clone()
    index = int(where * size)
    changed.view(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[index] ^= 1  # one bit
    assert checksums({"w": changed})["w"] != checksums({"w": tensor})["w"]


def defined_sums(tensor: torch.Tensor) -> list[int]:
    """The four sums as `state` defines them, word by word: each 16-bit half of each 32-bit word
    (or narrower element) times each of its position's two weights."""
    bits = state._words(tensor).to(torch.int64)
    position = torch.arange(bits.numel(), dtype=torch.int64)
    mask = (1 << state.WEIGHT_BITS) - 1
    weights = ((position & mask) + 1, ((position >> state.WEIGHT_BITS) & mask) + 1)
    halves = (bits & 0xFFFF, (bits >> 16) & 0xFFFF)
    return [int((weight * half).sum()) for weight in weights for half in halves]


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 2**16 + 300), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
)
def test_the_sums_are_the_defined_sums(sizes: list[int], dtype: torch.dtype) -> None:
    """Summed by rows for speed, each tensor's sums are still its words' sums by position
    (sizes reach past 2**15 words, where the high weight first changes)."""
    tensors = [values(size, i, dtype) for i, size in enumerate(sizes)]
    summed = state._group_sums([state._words(tensor) for tensor in tensors]).tolist()
    assert summed == [defined_sums(tensor) for tensor in tensors]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_every_bit_of_a_wide_element_counts(dtype: torch.dtype) -> None:
    tensor = values(1000, 7).to(dtype)
    for bit in (0, 40, 62):
        changed = tensor.clone()
        changed.view(torch.int64)[500] ^= 1 << bit
        assert checksums({"w": changed})["w"] != checksums({"w": tensor})["w"], bit


@settings(max_examples=20, deadline=None)
@given(size=st.integers(2, 50_000), seed=st.integers(0, 2**16), data=st.data())
def test_two_elements_trading_places_change_the_checksum(size: int, seed: int, data) -> None:
    tensor = values(size, seed)
    i, j = data.draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=2, unique=True))
    if tensor[i] == tensor[j]:
        return
    swapped = tensor.clone()
    swapped[[i, j]] = swapped[[j, i]]
    assert checksums({"w": swapped})["w"] != checksums({"w": tensor})["w"]


@pytest.mark.parametrize("threads", [2, 3, 8, 16])
def test_checksums_do_not_depend_on_the_thread_count(threads: int) -> None:
    tensors = {"a": values(300_000, 1), "b": values(70_001, 2, torch.bfloat16)}
    reference = checksums(tensors)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert checksums(tensors) == reference
    finally:
        torch.set_num_threads(before)


def test_names_map_to_their_own_checksums_and_empty_tensors_work() -> None:
    a, b = values(1000, 3), values(1000, 4)
    both = checksums({"b": b, "a": a, "empty": torch.zeros(0)})
    assert list(both) == ["a", "b", "empty"]
    assert both["a"] == checksums({"a": a})["a"] != both["b"]
    assert all(len(value) == 16 and int(value, 16) >= 0 for value in both.values())


@CUDA
def test_a_gpu_computes_the_checksums_of_the_host() -> None:
    tensors = {"a": values(300_000, 5), "b": values(4096, 6, torch.bfloat16)}
    on_device = {name: tensor.cuda() for name, tensor in tensors.items()}
    assert checksums(on_device) == checksums(tensors)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.uint8]), min_size=8, max_size=8
    ),
    group_words=st.integers(1, 5000),
)
def test_grouping_tensors_never_changes_a_checksum(sizes: list[int], dtypes, group_words: int) -> None:
    """Tensors are summed in groups for speed; each one's checksum is the one it has alone."""
    tensors = {f"t{i}": values(size, i, dtypes[i]) for i, size in enumerate(sizes)}
    alone = {name: checksums({name: tensor})[name] for name, tensor in tensors.items()}
    original = state.GROUP_WORDS
    try:
        state.GROUP_WORDS = group_words
        assert checksums(tensors) == alone
    finally:
        state.GROUP_WORDS = original


@settings(max_examples=25, deadline=None)
@given(
    writes=st.lists(st.tuples(st.sampled_from(["a", "b", "frozen"]), st.integers(0, 99)), max_size=6),
    through_a_view=st.booleans(),
)
def test_frozen_digests_equal_fresh_digests_after_any_in_place_writes(
    writes: list[tuple[str, int]], through_a_view: bool
) -> None:
    """LoRA's frozen weights are hashed once, yet after any sequence of in-place writes (under
    no_grad, to trained or frozen tensors, directly or through a view) every digest is the one a
    fresh hash gives."""
    model = torch.nn.ParameterDict(
        {name: torch.nn.Parameter(values(100, seed)) for seed, name in enumerate(("a", "b", "frozen"))}
    )
    model["frozen"].requires_grad_(False)
    memo = state.FrozenDigests(model)
    assert memo.names == {"model.frozen"}
    for name, index in [*writes, ("a", 0)]:
        tensors = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
        assert memo.digests(tensors) == state.digests(tensors)
        with torch.no_grad():
            (model[name][index : index + 1] if through_a_view else model[name]).add_(1.0)
