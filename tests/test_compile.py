"""numerics.compile: a compiled train step has other bits than eager, so it is another step hash;
nothing else in the plan changes. (Compiled runs are checked end to end in test_cuda.py on a GPU;
on the CPU a first compile takes most of a minute, too long for this suite.)"""

from __future__ import annotations

from pathlib import Path

from conftest import MICRO, plan_hash, run_bt

from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store


def steps_by_label(store: Path, *overrides: str) -> dict[str, object]:
    planned = plan_hash(run_bt("plan", str(MICRO), *overrides, store=store))
    return {step.label: step for step in load_plan(Store(store), planned).steps}


def test_compile_changes_the_train_step_and_what_depends_on_it_only(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    eager = steps_by_label(store)
    compiled = steps_by_label(store, "--set", "numerics.compile=true")
    assert compiled["data:main"].hash == eager["data:main"].hash
    assert compiled["train:main"].hash != eager["train:main"].hash
    assert compiled["train:main"].toolchain["compile"] is True
    assert "compile" not in eager["train:main"].toolchain  # eager fingerprints are as they were
    assert "compile" not in compiled["eval"].toolchain  # evaluation stays eager


def test_bt_diff_names_the_compile_setting(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    eager = plan_hash(run_bt("plan", str(MICRO), store=store))
    compiled = plan_hash(run_bt("plan", str(MICRO), "--set", "numerics.compile=true", store=store))
    shown = run_bt("diff", eager, compiled, store=store)
    assert shown.returncode == 0, shown.stderr
    assert "numerics.compile" in shown.stdout and "invalidated" in shown.stdout
