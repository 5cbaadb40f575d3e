"""The train/held-out split decided many blocks at once (steps/data/split.py) is the per-block rule
(`derive_unit(seed, "heldout", i) < fraction`), and the blake3 under it, in C and in numpy, is
blake3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain import native
from buildtrain.steps.data import short_blake3, split
from buildtrain.steps.data.short_blake3 import digest_prefixes
from buildtrain.steps.data.split import held_out
from buildtrain.steps.seeds import MASK_63, derive_unit

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler to build short_blake3.c")


def engines() -> list[tuple[str, object]]:
    """Each way of computing the digests, by name: numpy always, C where it is built."""
    compiled = short_blake3._compiled()
    found: list[tuple[str, object]] = [("numpy", short_blake3.in_numpy)]
    if compiled is not None:
        found.append(("c", lambda messages: short_blake3.in_c(compiled, messages)))
    return found


# seeds of every length, up to ones whose message is longer than one blake3 block (the fallback)
seeds = st.one_of(st.integers(0, 1000), st.integers(0, 2**64), st.integers(10**40, 10**45))
# fractions at the edges as well as between them; units are in [0, 1)
fractions = st.one_of(st.sampled_from([0.0, 1e-9, 0.05, 0.5, 1.0]), st.floats(0.0, 1.0))
# ranges that start anywhere, including just below a power of ten (the digit count changes)
starts = st.one_of(st.integers(0, 10**6), st.integers(1, 17).map(lambda k: 10**k - 3), st.integers(0, 10**18))


def per_block(seed: int, fraction: float, start: int, count: int) -> list[bool]:
    return [derive_unit(seed, "heldout", index) < fraction for index in range(start, start + count)]


@settings(max_examples=300, deadline=None)
@given(seed=seeds, fraction=fractions, start=starts, count=st.integers(1, 40))
def test_the_batch_split_is_the_per_block_rule(seed: int, fraction: float, start: int, count: int) -> None:
    assert held_out(seed, fraction, start, count).tolist() == per_block(seed, fraction, start, count)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**63), start=st.integers(0, 10**5))
def test_units_at_the_threshold_agree_exactly(seed: int, start: int) -> None:
    """Each block's own unit as the fraction: the batch rule must round it to the same float
    (held out just above it, not at it), which a careless int to float conversion would not."""
    count = 64
    for offset in (0, count // 2, count - 1):
        unit = derive_unit(seed, "heldout", start + offset)
        for fraction in (unit, np.nextafter(unit, 2.0), np.nextafter(unit, -1.0)):
            assert held_out(seed, float(fraction), start, count).tolist() == per_block(
                seed, float(fraction), start, count
            )


def test_a_long_range_crossing_batches_and_digit_counts() -> None:
    """Across the batch size (8,192) and from 4 to 5 digits: every block as the rule says."""
    start, count = 9_000, 20_000
    assert held_out(11, 0.05, start, count).tolist() == per_block(11, 0.05, start, count)


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 64), count=st.integers(1, 30), data=st.data())
def test_short_blake3_is_blake3(length: int, count: int, data: st.DataObject) -> None:
    raw = data.draw(st.binary(min_size=length * count, max_size=length * count))
    messages = np.frombuffer(raw, dtype=np.uint8).reshape(count, length)
    if data.draw(st.booleans()) and count > 1:  # shared words become scalars: mix both kinds
        messages = messages.copy()
        messages[:, : length // 2] = messages[0, : length // 2]
    expected = [int.from_bytes(blake3.blake3(bytes(row)).digest()[:8], "little") for row in messages]
    assert digest_prefixes(messages).tolist() == expected
    for name, engine in engines():
        assert engine(messages).tolist() == expected, name


@needs_compiler
def test_the_c_digests_are_built_where_there_is_a_compiler() -> None:
    """Where cc exists the split is decided in C: a broken build would fall back to numpy silently
    (same bits, five times the time), so a test says it did not."""
    assert short_blake3._compiled() is not None


@needs_compiler
def test_c_and_numpy_agree_on_a_window_of_whole_groups_and_a_tail() -> None:
    """32,768 + 5 messages of the split's own shape (16 per vector group, then a short group)."""
    prefix = np.frombuffer(b'[7,"heldout",[', dtype=np.uint8)
    count = (1 << 15) + 5
    digits = np.char.zfill(np.arange(count).astype(str), 6).astype("S6").view(np.uint8).reshape(count, 6)
    messages = np.concatenate(
        [np.broadcast_to(prefix, (count, len(prefix))), digits, np.full((count, 2), 93, np.uint8)], axis=1
    )
    compiled = short_blake3._compiled()
    assert short_blake3.in_c(compiled, messages).tolist() == short_blake3.in_numpy(messages).tolist()


@pytest.fixture
def no_built_digests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A compiler that fails every build, an empty kernel cache, and no library loaded yet."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    short_blake3._compiled.cache_clear()
    native.load.cache_clear()
    yield
    short_blake3._compiled.cache_clear()  # the next caller builds or loads it again
    native.load.cache_clear()


@pytest.mark.usefixtures("no_built_digests")
def test_a_failed_build_falls_back_to_numpy_with_the_same_split() -> None:
    assert short_blake3._compiled() is None
    assert held_out(5, 0.2, 95, 10).tolist() == per_block(5, 0.2, 95, 10)


def test_the_split_in_numpy_is_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no compiler (the numpy fallback), a range across digit counts is still the rule."""
    monkeypatch.setattr(short_blake3, "_compiled", lambda: None)
    start, count = 9_990, 40
    assert held_out(3, 0.3, start, count).tolist() == per_block(3, 0.3, start, count)


def test_short_blake3_refuses_what_is_not_one_block() -> None:
    with pytest.raises(ValueError, match="at most 64 bytes"):
        digest_prefixes(np.zeros((2, 65), dtype=np.uint8))
    with pytest.raises(ValueError, match="1 or more"):
        digest_prefixes(np.zeros((0, 8), dtype=np.uint8))


def test_the_mask_is_what_derive_unit_masks() -> None:
    """The 63-bit mask of derive_seed: the top bit of the 8 bytes never reaches the unit."""
    assert MASK_63 == (1 << 63) - 1
    assert held_out(0, 1.0, 0, 100).all() and not held_out(0, 0.0, 0, 100).any()


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**40),
    fraction=st.floats(0.0, 1.0),
    window=st.integers(1, 50),
    blocks=st.lists(st.integers(0, 400), min_size=1, max_size=60),
)
def test_split_runs_answer_each_block_as_the_rule_does(
    seed: int, fraction: float, window: int, blocks: list[int]
) -> None:
    """Asked about blocks in any order and with any window: the block's own split, and a run
    end past it inside which every block has that split; and the splits of a range of blocks."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(split, "WINDOW", window)
        runs = split.SplitRuns(seed, fraction)
        for block in [*sorted(blocks), *blocks]:
            held, end = runs.run(block)
            assert end > block
            assert per_block(seed, fraction, block, end - block) == [held] * (end - block)
            count = 1 + block % (2 * window)  # within a window and past one
            assert runs.blocks(block, count).tolist() == per_block(seed, fraction, block, count)
