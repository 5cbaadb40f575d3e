"""The CUDA path end to end: same weights in two stores (under the cuBLAS workspace setting the
installed torch requires, `numerics.cublas_workspace_required`), dropout drawn on the device,
compiled training deterministic, also through a kill and resume, and FSDP2 at world size 1 on
NCCL training to the unsharded bits. Skipped where there is no GPU (this project's CI has none);
run them on a machine with one: python -m pytest -n 8 tests/test_cuda.py (the `long_cuda` ones
take a minute or more each; scripts/gpu_check.sh runs them all at once on the one GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import MICRO, plan_hash, run_bt, step_digests
from test_resume import killed_in_checkpoint, resume

from buildtrain.executor.process import numerics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ON_CUDA = ["--set", "numerics.device=cuda", "--set", "numerics.dtype=bfloat16"]


def build(tmp_path: Path, name: str, *overrides: str) -> tuple[str, dict[str, dict[str, str]]]:
    store = tmp_path / name / ".bt"
    store.parent.mkdir(parents=True)
    planned = plan_hash(run_bt("plan", str(MICRO), *ON_CUDA, *overrides, store=store))
    result = run_bt("run", planned, store=store, env={"BT_EXPERIMENTS": str(store.parent / "experiments")})
    assert result.returncode == 0, result.stderr
    return planned, step_digests(store, planned)


def workspaces(experiments: Path) -> set[str]:
    """The cuBLAS workspace every step process of these run records computed under."""
    return {
        event["cublas_workspace"]
        for log in experiments.glob("*/train.log")
        for event in map(json.loads, log.read_text().splitlines())
        if event.get("event") == "numerics_applied" and "cublas_workspace" in event
    }


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
    chosen = ":4096:8" if numerics.cublas_workspace_required() else "torch's default"
    assert (
        workspaces(tmp_path / "a" / "experiments") == {chosen} == workspaces(tmp_path / "b" / "experiments")
    )


def test_verify_with_a_resume_passes_on_cuda(tmp_path: Path) -> None:
    store = tmp_path / ".bt"
    planned = plan_hash(run_bt("plan", str(MICRO), *ON_CUDA, "--set", "model.dropout=0.1", store=store))
    assert run_bt("run", planned, store=store).returncode == 0
    result = run_bt("verify", planned, "--resume-at", "5", store=store)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.long_cuda
def test_compiled_training_reproduces_through_a_kill_and_resume_on_cuda(tmp_path: Path) -> None:
    """numerics.compile = true: a build SIGKILLed while writing its checkpoint of update 8 resumes
    in a fresh process (compiling again) to the bits of an uninterrupted build in another store."""
    compiled = ("--set", "numerics.compile=true")
    planned, whole = build(tmp_path, "whole", *compiled)
    store, experiments = tmp_path / "killed" / ".bt", tmp_path / "killed" / "experiments"
    store.parent.mkdir()  # run_bt runs bt in the store's folder
    assert plan_hash(run_bt("plan", str(MICRO), *ON_CUDA, *compiled, store=store)) == planned
    killed_in_checkpoint(planned, store, experiments, 8, "--target", "train:main")
    assert resume(planned, store, experiments)["train:main"] == whole["train:main"]


@pytest.mark.long_cuda
def test_fsdp_at_world_size_one_trains_to_the_unsharded_bits_on_cuda(tmp_path: Path) -> None:
    """FSDP2 on NCCL in one process (its streams, the exchange's hook; sharding.py says why the
    order holds): without clipping, the weights and the kept checkpoints of unsharded training.
    The CPU twin, on gloo at world size 2: tests/test_sharding.py."""
    unclipped = ("--set", "train.grad_clip=0", "--set", "train.micro_batch_size=1")
    _, sharded = build(tmp_path, "sharded", *unclipped, "--set", 'train.sharding="fsdp"')
    _, unsharded = build(tmp_path, "unsharded", *unclipped)
    assert sharded["train:main"]["weights"] == unsharded["train:main"]["weights"]
    assert sharded["train:main"]["state"] == unsharded["train:main"]["state"]
