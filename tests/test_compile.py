"""numerics.compile: a compiled train step has other bits than eager, so it is another step hash;
nothing else in the plan changes. (Compiled runs are checked end to end in test_cuda.py on a GPU;
on the CPU a first compile takes most of a minute, too long for this suite.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MICRO, plan_hash, run_bt

from buildtrain.config.schema import ModelConfig
from buildtrain.plan.stored import load_plan
from buildtrain.steps.train.model import Transformer, record_mask
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


@pytest.mark.parametrize("n_kv_heads, mlp", [(4, "swiglu"), (2, "gelu")])
def test_the_model_compiles_to_one_graph(n_kv_heads: int, mlp: str) -> None:
    """torch.compile traces the whole forward (causal and packed, under bf16 autocast as on a
    GPU) as one graph: a graph break costs each layer a round trip through eager mode, which made
    the compiled model slower than the eager one on an H200 (issue 26)."""
    import torch
    import torch._dynamo

    config = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, mlp=mlp)
    model = Transformer.build(config, 64, torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        for mask in (None, record_mask(tokens, 0)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                explained = torch._dynamo.explain(model)(tokens, None, mask)
            reasons = [reason.reason.splitlines()[0] for reason in explained.break_reasons]
            assert (explained.graph_count, reasons) == (1, []), f"mask: {mask is not None}"
    finally:
        torch._dynamo.reset()
