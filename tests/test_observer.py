"""The training loop's observer seam: the no-op default, several observers as one, the fault plan
read from a job, and the rule that the executor reaches verify only through it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from cattrs.errors import ClassValidationError

from buildtrain.steps.train.faults import FaultPlan, Faults
from buildtrain.steps.train.observer import Observer, Observers

PACKAGE = Path(__file__).resolve().parents[1] / "buildtrain"


class Log:
    def info(self, event: str, **fields: Any) -> None:
        pass


class Counting(Observer):
    def __init__(self, stop_at: int) -> None:
        self.stop_at, self.calls = stop_at, 0

    def updated(self, update: int, model: torch.nn.Module) -> bool:
        self.calls += 1
        return update >= self.stop_at


def test_the_default_observer_changes_nothing() -> None:
    observer = Observer()
    assert observer.resumed(40) == 40
    assert not observer.updated(1, torch.nn.Linear(1, 1))
    assert not observer.recorded({"step": 1}, {})
    assert not observer.wants_checkpoint(1)


def test_observers_call_every_observer_even_after_one_says_stop() -> None:
    first, second = Counting(1), Counting(5)
    both = Observers(first, second)
    assert both.updated(1, torch.nn.Linear(1, 1))
    assert first.calls == second.calls == 1
    assert not Observers(Counting(5), Counting(5)).updated(1, torch.nn.Linear(1, 1))


def test_a_fault_plan_comes_from_a_jobs_hooks_table() -> None:
    plan = FaultPlan.from_job({"kill_after": [3, 5], "perturb": [7, "norm.weight", 1e-3], "stop_after": 9})
    assert plan.kill_after == (3, 5) and plan.perturb == (7, "norm.weight", 1e-3)
    faults = Faults(plan, 0, Log())
    assert faults.wants_checkpoint(3) and not faults.wants_checkpoint(4)
    assert not faults.updated(8, torch.nn.Linear(1, 1)) and faults.updated(9, torch.nn.Linear(1, 1))
    assert Faults(FaultPlan.from_job({"skip_cursor_restore": True}), 0, Log()).resumed(40) == 0
    with pytest.raises(ClassValidationError) as caught:  # an unknown fault is a mistake, not a no-op
        FaultPlan.from_job({"kill_everything": 1})
    assert "kill_everything" in repr(caught.value.exceptions)


def test_a_perturbation_changes_one_element_of_the_named_tensor() -> None:
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    faults = Faults(FaultPlan(perturb=(2, "weight", 0.5)), 0, Log())
    faults.updated(1, model)
    assert torch.equal(model.weight, before)
    faults.updated(2, model)
    assert model.weight.view(-1)[0].item() == pytest.approx(before.view(-1)[0].item() + 0.5)
    assert torch.equal(model.weight.view(-1)[1:], before.view(-1)[1:])


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("layer", ["steps", "executor"])
def test_nothing_below_verify_imports_verify(layer: str) -> None:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        assert not [m for m in _imports(path) if m.startswith("buildtrain.verify")], path
