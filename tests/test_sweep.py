"""Sweeps: the grid is the product of the axes, its hash ignores order, shared steps are built once."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import MICRO, BtRunner, plan_hash, summaries
from hypothesis import given
from hypothesis import strategies as st
from sweeps_built import BuiltSweep, built_sweep

from buildtrain.errors import ExitCode, UsageError
from buildtrain.plan.sweep import Axis, grid, parse_axis, sweep_hash


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> BuiltSweep:
    return built_sweep(tmp_path_factory)


values = st.one_of(
    st.integers(-1000, 1000), st.floats(allow_nan=False, allow_infinity=False, width=32), st.booleans()
)
axes_strategy = st.lists(
    st.tuples(
        st.sampled_from(["train.lr", "train.seed", "model.dim", "eval.every"]),
        st.lists(values, min_size=1, max_size=4, unique_by=repr),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda pair: pair[0],
)


def _axes(pairs: list[tuple[str, list]]) -> list[Axis]:
    return [Axis(key, tuple(dict.fromkeys(vals, None))) for key, vals in pairs]


@given(axes_strategy)
def test_the_grid_is_the_product_of_the_axes(pairs: list[tuple[str, list]]) -> None:
    axes = _axes(pairs)
    points = grid(axes)
    assert len(points) == len(list(itertools.product(*(a.values for a in axes))))
    assert len(set(points)) == len(points)  # every combination once
    for point in points:
        assert [assignment.split("=", 1)[0] for assignment in point] == [a.key for a in axes]


@given(axes_strategy, st.randoms())
def test_the_sweep_hash_ignores_the_order_of_axes_and_values(pairs: list[tuple[str, list]], rng) -> None:
    axes = _axes(pairs)
    points = [(p, f"{i:064x}") for i, p in enumerate(grid(axes))]
    shuffled = [Axis(a.key, tuple(rng.sample(a.values, len(a.values)))) for a in axes]
    rng.shuffle(shuffled)
    by_point = {frozenset(p): h for p, h in points}
    reordered = [(p, by_point[frozenset(p)]) for p in grid(shuffled)]
    assert sweep_hash(shuffled, reordered) == sweep_hash(axes, points)


def test_axis_values_are_toml_and_commas_inside_brackets_stay() -> None:
    assert parse_axis("train.lr=1e-3, 3e-3").values == (1e-3, 3e-3)
    assert parse_axis("train.betas=[0.9,0.95],[0.9,0.99]").values == ([0.9, 0.95], [0.9, 0.99])
    assert parse_axis("model.mlp=swiglu,gelu").values == ("swiglu", "gelu")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("train.lr", "expected KEY=V1,V2"),
        ("=1,2", "expected KEY=V1,V2"),
        ("train.lr=", "an empty value"),
        ("train.lr=1e-3,,2e-3", "an empty value"),
        ("train.lr=1e-3,1e-3", "given twice"),
        ("train.lr=[1,", "not a TOML value"),
    ],
)
def test_a_bad_axis_is_one_line_naming_the_key_and_the_fix(text: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment) as caught:
        parse_axis(text)
    assert "\n" not in str(caught.value)


def test_bad_sweeps_at_the_command_line_store_nothing(bt: BtRunner, store: Path) -> None:
    for axis in ("train.lr=", "train.lrr=1e-3,2e-3", "train.lr=1e-3,-1"):
        result = bt("plan", str(MICRO), "--sweep", axis)
        assert result.returncode == ExitCode.USAGE, result.stderr
        assert result.stdout == ""
        assert "Traceback" not in result.stderr
        assert "--sweep train.lr" in result.stderr
        assert not (store / "plans").exists()  # every point is validated before any is stored


def test_each_point_is_the_plan_of_its_overrides(bt: BtRunner) -> None:
    result = bt("plan", str(MICRO), "--sweep", "train.lr=1e-3,3e-3", "--sweep", "model.n_layers=1,2")
    hashes = result.stdout.split()
    assert result.returncode == 0 and len(hashes) == 4
    assert "data:main" in result.stderr and "in 4 of 4 plans" in result.stderr
    alone = plan_hash(bt("plan", str(MICRO), "--set", "train.lr=3e-3", "--set", "model.n_layers=2"))
    assert hashes[3] == alone


def test_a_preset_declares_its_sweep_and_keeps_its_hash_without_one(bt: BtRunner, tmp_path: Path) -> None:
    preset = tmp_path / "swept.toml"
    preset.write_text(
        f'extends = "{MICRO}"\n\n[sweep]\n"train.lr" = [1e-3, 3e-3]\nmodel = {{ n_layers = [1, 2] }}\n'
    )
    hashes = bt("plan", str(preset)).stdout.split()
    assert len(hashes) == 4
    # --sweep replaces the preset's axis of the same key
    assert len(bt("plan", str(preset), "--sweep", "train.lr=1e-2").stdout.split()) == 2
    plain = tmp_path / "plain.toml"
    plain.write_text(f'extends = "{MICRO}"\n')
    assert plan_hash(bt("plan", str(plain))) == plan_hash(bt("plan", str(MICRO)))
    bad = tmp_path / "bad.toml"
    bad.write_text(f'extends = "{MICRO}"\n\n[sweep]\n"train.lr" = 1e-3\n')
    result = bt("plan", str(bad))
    assert result.returncode == ExitCode.USAGE and "sweep.train.lr: expected an array" in result.stderr


def test_a_3x2_sweep_builds_shared_steps_once_and_then_is_a_null_build(sweep: BuiltSweep) -> None:
    records = summaries(sweep.experiments)
    assert len(records) == 12  # 6 plans, run twice
    executed = Counter(
        (step["label"], step["hash"])
        for record in records
        for step in record["steps"]
        if step["action"] == "executed"
    )
    assert set(executed.values()) == {1}  # no step was executed twice
    labels = Counter(label for label, _ in executed)
    assert labels == {
        "data:pretrain": 1,
        "data:finetune": 1,
        "train:pretrain": 1,
        "train:finetune": 6,
        "eval": 6,
        "export": 6,
    }
    assert (
        "21 distinct steps for 36 step slots: 21 executed, 0 already built, 15 shared"
        in sweep.first_run_stderr
    )
    assert "0 executed, 21 already built" in sweep.second_run_stderr
    assert all(record["executed"] == 0 for record in records[6:])  # the second run: a null build


def test_run_reads_plans_from_stdin_and_from_a_stored_sweep(sweep: BuiltSweep, tmp_path: Path) -> None:
    env = {"BT_STORE": str(sweep.store), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    listed = "\n".join(sweep.plans[:2]) + "\n# a comment\n"
    result = subprocess.run(
        [sys.executable, "-m", "buildtrain", "run", "-", "--progress", "off"],
        input=listed,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "2 of 2 plans done" in result.stderr and "0 executed" in result.stderr
    stored = next((sweep.store / "sweeps").glob("*.json"))
    body = json.loads(stored.read_bytes())
    assert sorted(p["plan"] for p in body["points"]) == sorted(sweep.plans)
    result = subprocess.run(
        [sys.executable, "-m", "buildtrain", "run", stored.stem[:10], "--progress", "off"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 0 and "6 of 6 plans done" in result.stderr, result.stderr


def test_each_plan_of_a_sweep_finds_its_record_without_listing_the_experiments(
    sweep: BuiltSweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records of earlier runs, the same plans' included, are never read or listed: a sweep
    once listed the experiments folder twice per plan, a cost that grew with every run ever made."""
    from buildtrain.executor.loop.batch import run_plans
    from buildtrain.executor.loop.run import RunOptions
    from buildtrain.plan.stored import load_plan
    from buildtrain.store.store import Store

    experiments = tmp_path / "experiments"
    earlier = [experiments / f"20200101T000000Z-{plan[:12]}" for plan in sweep.plans]
    for folder in earlier:
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text('{"steps": [{"hash": "x", "action": "executed"}]}')
    listed: list[Path] = []
    iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: listed.append(self) or iterdir(self))
    store = Store(sweep.store)
    options = RunOptions(experiments=experiments, progress=False)
    summary = run_plans(store, [(load_plan(store, plan), options) for plan in sweep.plans])
    assert summary.code == ExitCode.OK and summary.executed == 0
    assert experiments not in listed
    assert len(summary.records) == 6 and not set(summary.records) & {str(f) for f in earlier}
    assert [Path(r).name[-12:] for r in summary.records] == [plan[:12] for plan in sweep.plans]


def test_a_sweep_file_with_something_else_is_refused_in_one_line(bt: BtRunner, tmp_path: Path) -> None:
    listing = tmp_path / "sweep.txt"
    listing.write_text("0123abcd\nnot-a-hash\n")
    result = bt("run", str(listing))
    assert result.returncode == ExitCode.USAGE
    assert (
        "is not a preset" in result.stderr or "not a plan hash" in result.stderr or "no plan" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_a_failing_point_stops_the_batch_and_says_which(bt: BtRunner) -> None:
    result = bt(
        "run", str(MICRO), "--sweep", "train.lr=1e9,3e-3", "--set", "train.steps=4", "--progress", "off"
    )
    assert result.returncode == ExitCode.FAILED
    assert "0 of 2 plans done" in result.stderr
    assert "stopped at plan" in result.stderr and "loss is nan" in result.stderr
    assert "Traceback" not in result.stderr
