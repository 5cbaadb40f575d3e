"""Token streams over shards, the keyed window order, and packed micro-batches."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.errors import StepFailed
from buildtrain.steps.train.batches import Batches, TokenStream, WindowOrder


def write_split(folder: Path, shards: list[list[int]], split: str = "train") -> dict[str, Any]:
    """Shard files of uint16 little-endian tokens and their entry in data.json."""
    entries = []
    for number, tokens in enumerate(shards):
        name = f"{split}-{number:05d}.bin"
        (folder / name).write_bytes(b"".join(t.to_bytes(2, "little") for t in tokens))
        entries.append({"file": name, "tokens": len(tokens)})
    return {"tokens": sum(len(s) for s in shards), "shards": entries}


token_values = st.integers(min_value=0, max_value=65535)
shard_lists = st.lists(st.lists(token_values, min_size=1, max_size=12), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(shards=shard_lists, data=st.data())
def test_read_across_shard_boundaries_equals_slicing_the_concatenation(
    shards: list[list[int]], data: st.DataObject
) -> None:
    flat = [t for shard in shards for t in shard]
    with tempfile.TemporaryDirectory() as scratch:
        stream = TokenStream(Path(scratch), write_split(Path(scratch), shards))
        assert len(stream) == len(flat)
        for _ in range(5):
            start = data.draw(st.integers(0, len(flat) - 1))
            length = data.draw(st.integers(1, len(flat) - start))
            tokens = stream.read(start, length)
            assert tokens.dtype == torch.int64
            assert tokens.tolist() == flat[start : start + length]
        start = data.draw(st.integers(0, len(flat)))
        with pytest.raises(IndexError):
            stream.read(start, len(flat) - start + 1)


@settings(max_examples=60, deadline=None)
@given(shards=shard_lists, data=st.data())
def test_windows_equal_one_read_per_row_within_and_across_shards(
    shards: list[list[int]], data: st.DataObject
) -> None:
    flat = [t for shard in shards for t in shard]
    with tempfile.TemporaryDirectory() as scratch:
        stream = TokenStream(Path(scratch), write_split(Path(scratch), shards))
        length = data.draw(st.integers(1, len(flat)))
        starts = data.draw(st.lists(st.integers(0, len(flat) - length), min_size=1, max_size=6))
        rows = stream.windows(starts, length)
        assert rows.dtype == torch.int64 and rows.shape == (len(starts), length)
        assert rows.tolist() == [flat[s : s + length] for s in starts]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=600), seed=st.integers(0, (1 << 63) - 1), epoch=st.integers(0, 9))
def test_window_order_is_a_bijection_of_range_n(n: int, seed: int, epoch: int) -> None:
    order = WindowOrder(n, seed)
    assert sorted(order(epoch, i) for i in range(n)) == list(range(n))


def test_window_order_is_keyed_by_seed_and_epoch_and_is_a_pure_function() -> None:
    n = 200
    first = [WindowOrder(n, 7)(0, i) for i in range(n)]
    assert first == [WindowOrder(n, 7)(0, i) for i in range(n)]  # a fresh instance agrees
    assert first != [WindowOrder(n, 8)(0, i) for i in range(n)]
    assert first != [WindowOrder(n, 7)(1, i) for i in range(n)]
    assert first != list(range(n))  # it does shuffle
    order = WindowOrder(n, 7)
    assert [order(e, 5) for e in (3, 0, 2, 0)] == [WindowOrder(n, 7)(e, 5) for e in (3, 0, 2, 0)]


def write_corpus(folder: Path, tokens: int, shard: int = 37) -> dict[str, Any]:
    values = [(i * 7919 + 13) % 257 for i in range(tokens)]
    return write_split(folder, [values[i : i + shard] for i in range(0, tokens, shard)])


def make_batches(folder: Path, tokens: int, seq_len: int, seed: int) -> Batches:
    return Batches(TokenStream(folder, write_corpus(folder, tokens)), seq_len, seed)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """500 tokens in shards of 37, written once."""
    folder = tmp_path_factory.mktemp("corpus")
    return folder, write_corpus(folder, 500)


def batches_of(corpus: tuple[Path, dict[str, Any]], seed: int) -> Batches:
    return Batches(TokenStream(*corpus), 8, seed)


def sample(batches: Batches, index: int) -> torch.Tensor:
    """The seq_len + 1 tokens of global sample `index`, read where the batches read it."""
    return batches.stream.read(batches.start(index), batches.seq_len + 1)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    cursor=st.integers(0, 400),
    micro=st.integers(0, 3),
    size=st.integers(1, 4),
)
def test_micro_batch_is_a_pure_function_of_seed_cursor_and_micro_index(
    corpus: tuple[Path, dict[str, Any]], seed: int, cursor: int, micro: int, size: int
) -> None:
    one, two = batches_of(corpus, seed), batches_of(corpus, seed)
    two.micro_batch(cursor + 3, 1, 2)  # unrelated reads in between change nothing
    x, y = one.micro_batch(cursor, micro, size)
    x2, y2 = two.micro_batch(cursor, micro, size)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # It depends only on the global sample numbers it covers.
    x3, y3 = one.micro_batch(cursor + micro * size, 0, size)
    assert torch.equal(x, x3) and torch.equal(y, y3)
    rows = torch.stack([sample(one, cursor + micro * size + j) for j in range(size)])
    assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])


def test_micro_batch_shapes_and_targets_are_inputs_shifted(corpus: tuple[Path, dict[str, Any]]) -> None:
    batches = batches_of(corpus, 1)
    x, y = batches.micro_batch(10, 2, 4)
    assert x.shape == y.shape == (4, 8)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_each_epoch_visits_every_window_once(corpus: tuple[Path, dict[str, Any]]) -> None:
    batches = batches_of(corpus, 3)
    stream = batches.stream
    assert batches.windows == (500 - 1) // 8
    windows = [stream.read(w * 8, 9) for w in range(batches.windows)]
    for epoch in range(2):
        seen = [sample(batches, epoch * batches.windows + i) for i in range(batches.windows)]
        matched = sorted(next(w for w in range(batches.windows) if torch.equal(s, windows[w])) for s in seen)
        assert matched == list(range(batches.windows))
    first = [sample(batches, i) for i in range(batches.windows)]
    second = [sample(batches, batches.windows + i) for i in range(batches.windows)]
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))  # epochs reshuffle


def test_batches_need_at_least_seq_len_plus_one_tokens(tmp_path: Path) -> None:
    with pytest.raises(StepFailed, match=r"train split has 8 tokens, fewer than train.seq_len \+ 1 = 9"):
        make_batches(tmp_path, 8, 8, 0)


def test_batches_with_exactly_seq_len_plus_one_tokens_have_one_window(tmp_path: Path) -> None:
    batches = make_batches(tmp_path, 9, 8, 0)
    assert batches.windows == 1
    x, y = batches.micro_batch(0, 0, 3)
    assert x.shape == y.shape == (3, 8)
    assert all(torch.equal(row, x[0]) for row in x)  # every sample is the one window
    assert torch.equal(torch.cat([x[0], y[0, -1:]]), batches.stream.read(0, 9))
