"""The CUDA path end to end: same weights in two stores, dropout drawn on the device, compiled
training deterministic. Skipped where there is no GPU (this project's CI has none); run them on a
machine with one: python -m pytest tests/test_cuda.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MICRO, plan_hash, run_bt, step_digests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ON_CUDA = ["--set", "numerics.device=cuda", "--set", "numerics.dtype=bfloat16"]


def build(tmp_path: Path, name: str, *overrides: str) -> tuple[str, dict[str, dict[str, str]]]:
    store = tmp_path / name / ".bt"
    store.parent.mkdir(parents=True)
    planned = plan_hash(run_bt("plan", str(MICRO), *ON_CUDA, *overrides, store=store))
    result = run_bt("run", planned, store=store)
    assert result.returncode == 0, result.stderr
    return planned, step_digests(store, planned)


@pytest.mark.parametrize(
    "overrides",
    [(), ("--set", "model.dropout=0.1"), ("--set", "numerics.compile=true")],
    ids=["eager", "dropout", "compiled"],
)
def test_two_stores_give_the_same_weights_on_cuda(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    first_plan, first = build(tmp_path, "a", *overrides)
    second_plan, second = build(tmp_path, "b", *overrides)
    assert first_plan == second_plan
    assert first["train:main"] == second["train:main"]


def test_verify_with_a_resume_passes_on_cuda(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO), *ON_CUDA, "--set", "model.dropout=0.1", store=store))
    assert run_bt("run", planned, store=store).returncode == 0
    result = run_bt("verify", planned, "--resume-at", "5", store=store)
    assert result.returncode == 0, result.stdout + result.stderr
