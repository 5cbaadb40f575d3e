"""Per-update fingerprints of the training state (`steps/train/fingerprint.py`): two integer sums
per tensor, the same from the C pass, from torch's block reductions and from their definition, at
any thread count and grouping; sensitive to any change of one or two words; and the record's lines
the same whether written at once or in batches (`record.Recorder`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.steps.train import fingerprint
from buildtrain.steps.train.fingerprint import Pending, in_blocks, lanes, words
from buildtrain.steps.train.record import Recorder, update_entry

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
C_BUILT = pytest.mark.skipif(fingerprint._compiled() is None, reason="needs a C compiler")
WRAP = 1 << 64


def values(size: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def defined(tensor: torch.Tensor) -> list[int]:
    """The two sums as the module defines them, word by word, in Python's unbounded integers."""
    w = words(tensor).tolist()
    return [sum(w) % WRAP, sum((q + 1) * x for q, x in enumerate(w)) % WRAP]


def unsigned(rows: torch.Tensor) -> list[list[int]]:
    return [[value % WRAP for value in row] for row in rows.tolist()]


def extremes(size: int, seed: int) -> torch.Tensor:
    """Words at the ends of the int32 range, where the weighted sum wraps soonest."""
    pick = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed))
    return torch.where(pick == 1, -(2**31), 2**31 - 1).to(torch.int32).view(torch.float32)


DTYPES = [torch.float32, torch.bfloat16, torch.uint8, torch.float64]


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 2 * fingerprint.BLOCK + 300), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    extreme=st.booleans(),
)
def test_every_way_of_summing_gives_the_defined_sums(sizes: list[int], dtype, extreme: bool) -> None:
    """C (where built), torch's block reductions and the definition agree, past block and row
    boundaries, and where the weighted sum wraps modulo 2**64."""
    tensors = [extremes(n, i) if extreme else values(n, i, dtype) for i, n in enumerate(sizes)]
    expected = [defined(tensor) for tensor in tensors]
    assert unsigned(in_blocks([words(tensor) for tensor in tensors])) == expected
    assert unsigned(lanes(tensors)) == expected
    if tensors and tensors[0].element_size() <= 4:  # one dtype: the path a GPU takes
        assert unsigned(in_blocks(tensors)) == expected


@C_BUILT
def test_the_c_pass_is_what_the_cpu_uses() -> None:
    tensors = [values(100_003, 1), values(5, 2, torch.bfloat16), values(900, 3).view(30, 30).t()]
    computed = fingerprint.in_c(fingerprint._compiled(), tensors)
    assert computed.tolist() == lanes(tensors).tolist() == in_blocks([words(t) for t in tensors]).tolist()


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 100_000),
    seed=st.integers(0, 2**16),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_changing_one_bit_anywhere_changes_the_fingerprint(size, seed, where, bit, dtype) -> None:
    tensor = values(size, seed, dtype)
    changed = tensor.clone()
    view = words(changed)
    width = 8 * view.element_size()
    bit %= width
    view[int(where * size)] ^= 1 << bit if bit < width - 1 else -(1 << bit)  # the sign bit too
    assert lanes([changed]).tolist() != lanes([tensor]).tolist()


@settings(max_examples=30, deadline=None)
@given(size=st.integers(2, 50_000), seed=st.integers(0, 2**16), data=st.data())
def test_two_words_that_trade_places_or_flip_sign_change_the_fingerprint(size, seed, data) -> None:
    """The changes `plain` alone cannot see: a swap, and two sign flips that cancel in it."""
    tensor = values(size, seed)
    i, j = data.draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=2, unique=True))
    swapped = tensor.clone()
    swapped[[i, j]] = swapped[[j, i]]
    if not torch.equal(words(swapped), words(tensor)):
        assert lanes([swapped]).tolist() != lanes([tensor]).tolist()
    flipped = tensor.clone()
    flipped[i], flipped[j] = -flipped[i], -flipped[j]  # +2**31 words on one, -2**31 on the other
    if (words(tensor)[i] < 0) != (words(tensor)[j] < 0):
        assert lanes([flipped]).tolist() != lanes([tensor]).tolist()


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_the_thread_count_changes_no_sum(threads: int) -> None:
    tensors = [values(300_000, 1), values(70_001, 2, torch.bfloat16)]
    reference = lanes(tensors).tolist()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert lanes(tensors).tolist() == reference
        assert in_blocks([words(t) for t in tensors]).tolist() == reference
    finally:
        torch.set_num_threads(before)


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8), group_words=st.integers(1, 5000))
def test_grouping_tensors_never_changes_their_sums(sizes: list[int], group_words: int) -> None:
    tensors = [values(size, i) for i, size in enumerate(sizes)]
    alone = [in_blocks([words(tensor)]).tolist()[0] for tensor in tensors]
    original = fingerprint.GROUP_WORDS
    try:
        fingerprint.GROUP_WORDS = group_words
        assert in_blocks([words(tensor) for tensor in tensors]).tolist() == alone
    finally:
        fingerprint.GROUP_WORDS = original


@CUDA
def test_a_gpu_computes_the_sums_of_the_host() -> None:
    tensors = [values(300_000, 5), values(4096, 6, torch.bfloat16), extremes(40_000, 7)]
    assert lanes([tensor.cuda() for tensor in tensors]).tolist() == lanes(tensors).tolist()


@settings(max_examples=25, deadline=None)
@given(
    writes=st.lists(st.tuples(st.sampled_from(["a", "b", "frozen"]), st.integers(0, 99)), max_size=6),
    through_a_view=st.booleans(),
)
def test_frozen_weights_fingerprinted_once_still_show_every_write(writes, through_a_view: bool) -> None:
    """LoRA's frozen weights are summed once, yet after any sequence of in-place writes (to
    trained or frozen tensors, directly or through a view) every fingerprint is a fresh one."""
    model = torch.nn.ParameterDict(
        {name: torch.nn.Parameter(values(100, seed)) for seed, name in enumerate(("a", "b", "frozen"))}
    )
    remembered, fresh = Pending({"model.frozen"}), Pending()
    for name, index in [*writes, ("a", 0)]:
        tensors = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
        remembered.add(tensors)
        fresh.add(tensors)
        assert remembered.take() == fresh.take()
        with torch.no_grad():
            (model[name][index : index + 1] if through_a_view else model[name]).add_(1.0)


def test_pending_fingerprints_come_back_in_order_and_once() -> None:
    pending = Pending()
    pending.add({"w": values(10, 1)})
    pending.add({"w": values(10, 2), "v": values(3, 3)})
    first, second = pending.take()
    assert list(first) == ["w"] and sorted(second) == ["v", "w"] and first["w"] != second["w"]
    assert all(len(value) == fingerprint.HEX_CHARS for value in second.values())
    assert pending.take() == [] and len(pending) == 0


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(st.sampled_from([None, "weights", "state", "eval"]), min_size=1, max_size=12),
    flushes=st.sets(st.integers(0, 11)),
)
def test_lines_written_in_batches_are_the_lines_written_at_once(kinds, flushes: set[int]) -> None:
    """When the record writes its lines (at once for `bt verify`, in batches for `bt run`) never
    changes a byte of them."""
    weights = torch.nn.Linear(4, 3)
    at_once, batched = [], []
    one, other = Recorder(set()), Recorder(set())
    for update, kind in enumerate(kinds, start=1):
        with torch.no_grad():
            weights.weight.add_(0.5)  # every update its own weights
        tensors = {f"model.{n}": p.detach() for n, p in weights.named_parameters()}
        for recorder in (one, other):
            if kind == "eval":
                recorder.evaluated(update, {"loss": 1.0})
            else:
                entry = update_entry(update, 1.0, 2.0, 3e-4, update)
                recorder.update(entry, kind, lambda tensors=tensors: dict(tensors))
        one.flush(at_once.append)
        if update - 1 in flushes:
            other.flush(batched.append)
    other.flush(batched.append)
    assert batched == at_once
    updates = [line for line in at_once if "eval" not in line]
    recorded = [kind for kind in kinds if kind != "eval"]
    assert [("weights" in line) for line in updates] == [kind is not None for kind in recorded]
