"""The learning-rate schedule: linear warmup to lr, then cosine/linear decay to lr * min_lr_ratio."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from buildtrain.config.schema import TrainConfig
from buildtrain.steps.train.schedule import learning_rate


@st.composite
def train_configs(draw: st.DrawFn, schedule: str | None = None) -> TrainConfig:
    steps = draw(st.integers(1, 400))
    return TrainConfig(
        steps=steps,
        warmup_steps=draw(st.integers(0, steps)),
        lr=draw(st.floats(1e-6, 1.0, allow_nan=False)),
        min_lr_ratio=draw(st.floats(0.0, 1.0)),
        schedule=schedule or draw(st.sampled_from(["cosine", "linear", "constant"])),
    )


def rates(train: TrainConfig) -> list[float]:
    return [learning_rate(step, train) for step in range(1, train.steps + 1)]


@settings(max_examples=200, deadline=None)
@given(train=train_configs())
def test_warmup_is_linear_and_reaches_lr(train: TrainConfig) -> None:
    for step in range(1, train.warmup_steps + 1):
        assert learning_rate(step, train) == pytest.approx(train.lr * step / train.warmup_steps, rel=1e-12)
    if train.warmup_steps:
        assert learning_rate(train.warmup_steps, train) == pytest.approx(train.lr, rel=1e-12)
        assert learning_rate(1, train) == pytest.approx(train.lr / train.warmup_steps, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(train=train_configs(schedule="cosine"))
def test_cosine_ends_exactly_at_lr_times_min_lr_ratio(train: TrainConfig) -> None:
    if train.warmup_steps < train.steps:
        assert learning_rate(train.steps, train) == train.lr * train.min_lr_ratio


@settings(max_examples=200, deadline=None)
@given(train=train_configs(schedule="linear"))
def test_linear_ends_at_lr_times_min_lr_ratio(train: TrainConfig) -> None:
    if train.warmup_steps < train.steps:
        assert learning_rate(train.steps, train) == pytest.approx(train.lr * train.min_lr_ratio, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(train=train_configs())
def test_rate_stays_between_the_floor_and_lr_up_to_rounding(train: TrainConfig) -> None:
    floor = train.lr * train.min_lr_ratio
    for step, rate in enumerate(rates(train), start=1):
        assert rate > 0.0 or floor < 4 * math.ulp(train.lr)  # 0 only when the floor is (about) 0
        if step > train.warmup_steps:  # after warmup, decay never goes below the floor
            assert rate >= floor - 4 * math.ulp(train.lr)
        assert rate <= train.lr + math.ulp(train.lr)


@settings(max_examples=100, deadline=None)
@given(train=train_configs())
@example(train=TrainConfig(steps=10, warmup_steps=3, lr=0.1))
def test_rate_never_exceeds_lr(train: TrainConfig) -> None:
    assert max(rates(train)) <= train.lr


@settings(max_examples=200, deadline=None)
@given(train=train_configs())
def test_warmup_increases_and_decay_never_increases(train: TrainConfig) -> None:
    after = rates(train)[train.warmup_steps :]
    assert all(b <= a for a, b in itertools.pairwise(after))
    assert all(rate <= train.lr for rate in after)  # exactly: the overshoot is only in warmup
    warmup = rates(train)[: train.warmup_steps]
    assert all(b > a for a, b in itertools.pairwise(warmup))


def test_cosine_midpoint_and_constant_schedule() -> None:
    cosine = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.2, schedule="cosine")
    assert learning_rate(60, cosine) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(60, cosine) == pytest.approx(0.6)
    assert learning_rate(11, cosine) < 1.0
    constant = TrainConfig(steps=50, warmup_steps=5, lr=0.3, min_lr_ratio=0.1, schedule="constant")
    assert [learning_rate(s, constant) for s in (6, 30, 50)] == [0.3, 0.3, 0.3]
    assert learning_rate(5, constant) == pytest.approx(0.3)


def test_no_warmup_starts_near_lr() -> None:
    train = TrainConfig(steps=100, warmup_steps=0, lr=0.5, min_lr_ratio=0.0, schedule="cosine")
    assert 0.49 < learning_rate(1, train) < 0.5
    assert learning_rate(100, train) == 0.0


@given(st.integers(1, 500), st.integers(1, 60), st.integers(1, 8))
def test_the_kept_updates_are_the_newest_scheduled_checkpoints(steps: int, every: int, keep: int) -> None:
    """What a resumed build pulls besides its resume point (`kinds/train.py`) is what an output
    keeps: the `keep` newest updates at which `checkpoint_due` takes a checkpoint."""
    from buildtrain.kinds import kind_of
    from buildtrain.steps.train.schedule import checkpoint_due

    train = TrainConfig(steps=steps, checkpoint_every=every, keep_checkpoints=keep, warmup_steps=0)
    config = {"train": {"steps": steps, "checkpoint_every": every, "keep_checkpoints": keep}}
    due = [update for update in range(steps, 0, -1) if checkpoint_due(update, train)]
    assert kind_of("train").kept_updates(config) == due[:keep]
