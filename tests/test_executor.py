"""The executor seam: the DAG order written once above every engine, the choice of engine, and
that nothing of an engine is loaded unless it is asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import MICRO, Reference, run_bt
from hypothesis import given, settings
from hypothesis import strategies as st

from buildtrain.executor.engines.engine import ENGINES, Resources, engine_name
from buildtrain.executor.loop.schedule import build_in_order
from buildtrain.executor.process.outcome import StepResult
from buildtrain.plan.plan import Step

ENGINE_PACKAGES = ("ray", "submitit")


def dag(parents: list[list[int]]) -> list[Step]:
    """Steps in plan order whose inputs are the earlier steps `parents[i]` names."""
    steps: list[Step] = []
    for index, chosen in enumerate(parents):
        inputs = {f"in{j}": steps[j].hash for j in sorted({p % index for p in chosen})} if index else {}
        steps.append(Step.create(f"s{index}", "eval", {"n": index}, inputs, {}))
    return steps


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=3), min_size=1, max_size=8), st.booleans())
def test_a_step_starts_only_once_its_inputs_are_built(parents: list[list[int]], concurrent: bool) -> None:
    steps = dag(parents)
    finished: set[str] = set()
    lock = threading.Lock()
    started_before_inputs: list[str] = []

    def build(step: Step) -> StepResult:
        with lock:
            if not set(step.upstream.values()) <= finished:
                started_before_inputs.append(step.label)
        with lock:
            finished.add(step.hash)
        return StepResult(label=step.label, hash=step.hash, action="executed")

    results = build_in_order(steps, build, concurrent=concurrent, cancel=lambda: None)
    assert [r.hash for r in results] == [s.hash for s in steps]  # reported in plan order
    assert started_before_inputs == []


def test_a_failed_step_stops_what_depends_on_it_and_is_raised() -> None:
    steps = dag([[], [0], [], [2]])  # two chains: s0 -> s1, s2 -> s3
    built: list[str] = []

    def build(step: Step) -> StepResult:
        if step.label == "s0":
            raise ValueError("s0 broke")
        built.append(step.label)
        return StepResult(label=step.label, hash=step.hash, action="executed")

    with pytest.raises(ValueError, match="s0 broke"):
        build_in_order(steps, build, concurrent=True, cancel=lambda: None)
    assert "s1" not in built


def test_the_engine_is_named_by_flag_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BT_EXECUTOR", raising=False)
    assert engine_name(None) == "local"
    monkeypatch.setenv("BT_EXECUTOR", "ray")
    assert engine_name(None) == "ray"
    assert engine_name("local") == "local"
    assert set(ENGINES) == {"local", "ray", "slurm"}
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        Resources(ranks=0)


def test_an_unknown_executor_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = run_bt("run", str(MICRO), store=tmp_path / ".bt", env={"BT_EXECUTOR": "kubernetes"})
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "BT_EXECUTOR" in done.stderr


def imported(store: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Every module `bt ARGS` imported (python -X importtime writes them to stderr)."""
    environment = {**os.environ, "BT_STORE": str(store), **(env or {})}
    environment.setdefault("BT_EXPERIMENTS", str(store.parent / "experiments"))
    environment.pop("BT_EXECUTOR", None) if env is None or "BT_EXECUTOR" not in env else None
    argv = [sys.executable, "-X", "importtime", "-m", "buildtrain", *args]
    done = subprocess.run(argv, env=environment, capture_output=True, text=True, cwd=store.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def loaded(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in stderr.splitlines() if "|" in line}


def test_plan_and_a_local_null_build_load_no_engine(micro_built: Reference) -> None:
    store, plan, _ = micro_built
    for args in (("plan", str(MICRO)), ("run", plan)):
        assert not loaded(imported(store, *args)) & set(ENGINE_PACKAGES), args
