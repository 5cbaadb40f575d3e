"""Imports run one way: a module imports only its own layer or lower ones (DESIGN.md, issue 13).

Checked here for the modules of sweeps, metrics, reports and lineage; the rest of the package is
being moved into the same order and can join the list as it arrives.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

LAYERS = ["base", "store", "config", "plan", "steps", "executor", "verify", "presentation"]
BASE = {"buildtrain.errors", "buildtrain.canonical"}
PRESENTATION = {"buildtrain.cli", "buildtrain.report", "buildtrain.views"}
CHECKED = [
    "buildtrain/plan/sweep.py",
    "buildtrain/plan/refs.py",
    "buildtrain/executor/events.py",
    "buildtrain/executor/metrics.py",
    "buildtrain/executor/batch.py",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "buildtrain" / "views").glob("*.py")),
]


def layer_of(module: str) -> int:
    if module in BASE:
        return 0
    if any(module == p or module.startswith(p + ".") for p in PRESENTATION):
        return LAYERS.index("presentation")
    return LAYERS.index(module.split(".")[1])


def imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("relative", CHECKED)
def test_imports_go_down(relative: str) -> None:
    module = relative.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    own = layer_of(module)
    for name in imported(REPO / relative):
        if name == "buildtrain" or name.startswith("buildtrain."):
            assert layer_of(name) <= own, (
                f"{module} ({LAYERS[own]}) imports {name} ({LAYERS[layer_of(name)]})"
            )
        if LAYERS[own] == "presentation":
            assert name.split(".")[0] != "torch", f"{module} imports torch"
