"""`train.steps = 0`: a stage that trains nothing is the weights it starts from. Its train step is
not planned; evaluation and the export read the imported checkpoint's weights as they are, so a
pretrained model is scored on a suite without any update, and the exported weights are the
imported ones bit for bit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from checkpoints import make_checkpoint
from conftest import REPO, plan_hash, run_bt, step_digests
from test_import import write_preset

from buildtrain.plan.stored import load_plan
from buildtrain.store.store import Store

os.environ["HF_HUB_OFFLINE"] = "1"
UNTRAINED = """\
extends = "imported.toml"
[train]
steps = 0
[eval]
suites = [{ name = "arith", file = "arithmetic.jsonl" }]
"""


def test_an_imported_checkpoint_is_scored_on_a_suite_without_any_update(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "checkpoint", "qwen2", tie=True)
    write_preset(tmp_path)
    shutil.copyfile(REPO / "tests" / "suites" / "arithmetic.jsonl", tmp_path / "arithmetic.jsonl")
    (tmp_path / "untrained.toml").write_text(UNTRAINED)
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(tmp_path / "untrained.toml"), store=store))
    steps = {step.label: step for step in load_plan(Store(store), plan).steps}
    assert not [label for label in steps if label.startswith("train")]  # nothing to train
    assert steps["eval"].inputs["weights"] == steps["import_hf"].hash
    built = run_bt("run", plan, store=store)
    assert built.returncode == 0, built.stderr
    digests = step_digests(store, plan)
    assert digests["export"]["weights"] == digests["import_hf"]["weights"]  # the checkpoint's, as it was
    listed = run_bt("ls", "--metrics", "--json", store=store)
    (row,) = json.loads(listed.stdout)
    assert row["suites"]["arith"]["questions"] == 24 and 0.0 <= row["suites"]["arith"]["accuracy"] <= 1.0
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        Store(store).outputs.path(steps["export"].hash) / "hf"
    )
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(exported.eval()(tokens).logits, base(tokens).logits)  # no update at all


def test_zero_steps_with_nothing_to_start_from_or_with_adapters_is_refused(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch.toml"
    scratch.write_text(f'extends = "{REPO / "presets" / "tiny.toml"}"\n[train]\nsteps = 0\n')
    refused = run_bt("plan", str(scratch), store=tmp_path / ".bt")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (
        "scratch.toml: stages.main.train.steps: 0 evaluates the weights a stage starts from" in refused.stderr
    )
    make_checkpoint(tmp_path / "checkpoint", "llama")
    preset = write_preset(tmp_path)
    lora = run_bt(
        "plan", str(preset), "--set", "train.steps=0", "--set", "train.lora.rank=4", store=tmp_path / ".bt"
    )
    assert lora.returncode == 2 and "Traceback" not in lora.stderr
    assert "stages.main.train.lora: a stage of 0 steps trains no adapters" in lora.stderr
