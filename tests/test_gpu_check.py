"""The GPU measurement fits a short lease: figures as they come, rounds fitted to a budget.

A GPU machine is lent for minutes at a time; `benchmarks/gpu.py` once printed nothing in 215 s
because it reported only at the end. Checked here on the CPU (`--device cpu`, the same code at a
small shape); `scripts/gpu_check.sh OUTDIR --device cpu` runs the whole sequence the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from common import alternate

CONTENDERS = ["bt run", "plain loop", "previous layout", "reference GPT"]


def test_each_value_is_heard_the_moment_it_exists() -> None:
    heard: list[tuple[str, int, float]] = []
    contenders = [("a", lambda: 1.0), ("b", lambda: 2.0)]
    results = alternate(contenders, 2, warmup=0, on_value=lambda *value: heard.append(value))
    assert heard == [("a", 1, 1.0), ("b", 1, 2.0), ("a", 2, 1.0), ("b", 2, 2.0)]
    assert results == {"a": [1.0, 1.0], "b": [2.0, 2.0]}


def test_a_budget_runs_the_first_round_and_no_round_that_would_not_fit() -> None:
    spent = alternate([("slow", lambda: time.sleep(0.05) or 1.0)], 10, warmup=0, deadline=time.monotonic())
    assert spent == {"slow": [1.0]}  # the deadline has passed: one round, never none
    roomy = alternate([("fast", lambda: 1.0)], 3, warmup=0, deadline=time.monotonic() + 60)
    assert roomy == {"fast": [1.0, 1.0, 1.0]}  # within the budget: every round asked for


def test_gpu_py_prints_and_records_each_figure_before_its_table(tmp_path: Path) -> None:
    figures = tmp_path / "figures.jsonl"
    command = [sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--quick", "--budget", "1"]
    done = subprocess.run(
        [*command, "--jsonl", str(figures)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    printed = [line for line in lines if line.startswith("figure  ")]
    assert [line.split(",")[0].removeprefix("figure  ") for line in printed] == CONTENDERS
    table = next(i for i, line in enumerate(lines) if line.startswith("tokens/s, a single round"))
    assert all(lines.index(line) < table for line in printed)
    records = [json.loads(line) for line in figures.read_text(encoding="utf-8").splitlines()]
    assert [record["contender"] for record in records] == CONTENDERS
    assert all(record["round"] == 1 and record["value"] > 0 for record in records)


def test_gpu_py_compares_the_cublas_workspace_in_fresh_processes(tmp_path: Path) -> None:
    """--workspace: forward+backward with the variable and without, each child checked to have
    seen the setting it stands for (on the CPU the figures check the script, not cuBLAS)."""
    figures = tmp_path / "figures.jsonl"
    command = [sys.executable, "benchmarks/gpu.py", "--workspace", "--device", "cpu", "--budget", "1"]
    done = subprocess.run(
        [*command, "--jsonl", str(figures)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in figures.read_text(encoding="utf-8").splitlines()]
    names = [record["contender"] for record in records]
    assert names == [
        "forward+backward, CUBLAS_WORKSPACE_CONFIG=:4096:8",
        "forward+backward, torch's workspace",
    ]
    assert all(record["unit"] == "ms" and record["value"] > 0 for record in records)
    assert "pinned workspace / torch's workspace:" in done.stdout


def test_gpu_py_profiles_the_plain_loop_against_bt(tmp_path: Path) -> None:
    """--profile: three stages' kernel tables, the differences, and each stage's time as a figure."""
    figures = tmp_path / "figures.jsonl"
    command = [sys.executable, "benchmarks/gpu.py", "--profile", "--device", "cpu", "--jsonl", str(figures)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-- kernels that differ most" in done.stdout
    assert "the step process's settings:" in done.stdout
    records = [json.loads(line) for line in figures.read_text(encoding="utf-8").splitlines()]
    assert [record["contender"] for record in records] == [
        "profile: plain loop",
        "profile: bt's loss, torch defaults",
        "profile: bt (settings, deterministic)",
    ]


def test_gpu_py_weighs_the_architecture_part_by_part(tmp_path: Path) -> None:
    """--architecture: the reference and buildtrain's model with each part swapped, each a figure,
    and the kernels that differ between the reference and buildtrain's model."""
    figures = tmp_path / "figures.jsonl"
    command = [
        sys.executable,
        "benchmarks/gpu.py",
        "--architecture",
        "--device",
        "cpu",
        "--jsonl",
        str(figures),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-- kernels that differ most" in done.stdout
    records = [json.loads(line) for line in figures.read_text(encoding="utf-8").splitlines()]
    assert [record["contender"].removeprefix("architecture: ") for record in records] == [
        "reference GPT",
        "buildtrain",
        "buildtrain, LayerNorm",
        "buildtrain, GELU MLP",
        "buildtrain, no RoPE",
        "buildtrain, all three",
    ]
    assert all(record["unit"] == "ms" and record["value"] > 0 for record in records)


def test_gpu_check_refuses_a_part_it_does_not_have(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path), "--only", "parts,partz"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no part named 'partz'" in done.stderr and done.stdout == ""


@pytest.mark.parametrize(
    "option", ["--budget", "--jsonl", "--only-compiled", "--workspace", "--profile", "--architecture"]
)
def test_gpu_py_explains_its_lease_options(option: str) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and option in done.stdout
