"""LoRA fine-tuning (`train.lora`) from an imported checkpoint, on chat records: only the adapters train and only
they have optimizer state; the result reproduces across stores, across a hard kill and resume and
at another thread count; peft places the exported adapters on the base checkpoint and computes
buildtrain's logits (within 1e-4), and the merged hf/ export computes them too.

Tolerances: merged (W + s B A) against unmerged (W x + s B A x) differ by float32 rounding only;
1e-5 on logits of order 1 holds with a wide margin (measured: about 1e-6)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import peft
import pytest
import safetensors.torch
import torch
import transformers
from checkpoints import make_checkpoint
from conftest import plan_hash, run_bt, step_digests
from test_chat import chat_preset
from test_suites import ARITH, ARITHMETIC

from buildtrain.config.convert import converter
from buildtrain.config.schema import ModelConfig, NumericsConfig, TrainConfig
from buildtrain.config.steps import EvalStep
from buildtrain.plan.stored import load_plan
from buildtrain.steps.eval import step as evaluation
from buildtrain.steps.train.lora import add_adapters
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.state import load_model
from buildtrain.store.store import Store

os.environ["HF_HUB_OFFLINE"] = "1"
PEFT_TOLERANCE = 1e-4
MERGED_TOLERANCE = 1e-5
LORA = (
    "[train]\nlr = 1e-2\n"
    'lora = { rank = 4, alpha = 8.0, dropout = 0.1, targets = ["q", "v", "o", "gate", "down"] }\n'
)


@pytest.fixture(scope="module")
def lora_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(folder, store, plan): a LoRA fine-tune of a tiny qwen2 (q/k/v biases, GQA) on chat
    records (instruction JSONL: loss masks, records packed), built once."""
    root = tmp_path_factory.mktemp("lora")
    make_checkpoint(root / "checkpoint", "qwen2", heads=4, kv_heads=2, tie=False)
    preset = chat_preset(root)
    preset.write_text(preset.read_text().replace("[train]\n", LORA.replace("[train]\n", "[train]\n", 1), 1))
    store = root / ".bt"
    plan = plan_hash(run_bt("plan", str(preset), store=store))
    built = run_bt("run", plan, "--threads", "1", store=store)
    assert built.returncode == 0, built.stderr
    return root, store, plan


def outputs(store: Path, plan: str) -> dict[str, Path]:
    return {s.label: Store(store).outputs.path(s.hash) for s in load_plan(Store(store), plan).steps}


def test_only_the_adapters_train_and_hold_optimizer_state(lora_built: tuple[Path, Path, str]) -> None:
    """A checkpoint holds the adapters (model.safetensors) apart from the frozen weights
    (frozen.safetensors), which one process writes once and links from its later checkpoints."""
    _, store, plan = lora_built
    found = outputs(store, plan)
    result = json.loads((found["train:main"] / "result.json").read_text())
    kept = [found["train:main"] / "checkpoints" / name for name in result["checkpoints"]]
    final = kept[0]
    moments = safetensors.torch.load_file(str(final / "optimizer.safetensors"))
    assert moments and all(".lora_" in name for name in moments)
    adapters = safetensors.torch.load_file(str(final / "model.safetensors"))
    assert adapters and all(".lora_" in name for name in adapters)
    assert any(name.endswith(".B") and v.abs().sum() > 0 for name, v in adapters.items())
    frozen = safetensors.torch.load_file(str(final / "frozen.safetensors"))
    imported = safetensors.torch.load_file(str(found["import_hf"] / "model.safetensors"))
    assert set(frozen) == set(imported)
    for name, tensor in imported.items():  # the frozen weights are the imported ones, bit for bit
        assert torch.equal(frozen[name], tensor), name
    assert len(kept) == 2 and len({(p / "frozen.safetensors").stat().st_ino for p in kept}) == 1


def test_peft_and_the_merged_export_compute_buildtrains_logits(lora_built: tuple[Path, Path, str]) -> None:
    root, store, plan = lora_built
    found = outputs(store, plan)
    loaded = load_plan(Store(store), plan)
    settings = converter.structure(loaded.config["model"], ModelConfig)
    lora = converter.structure(loaded.config["stages"][0]["train"], TrainConfig).lora
    assert lora is not None
    result = json.loads((found["train:main"] / "result.json").read_text())
    final = found["train:main"] / "checkpoints" / result["checkpoints"][0]
    ours = Transformer.build(settings, settings.vocab_size, torch.Generator())
    add_adapters(ours, lora, settings, torch.Generator())
    load_model(ours, final)  # unmerged: the frozen weights and the adapters as trained

    base = transformers.AutoModelForCausalLM.from_pretrained(root / "checkpoint")
    with_adapters = peft.PeftModel.from_pretrained(base, found["export"] / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(found["export"] / "hf").eval()
    tokens = torch.randint(0, settings.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ours.eval()(tokens)
        assert (with_adapters(tokens).logits - expected).abs().max().item() <= PEFT_TOLERANCE
        assert (merged(tokens).logits - expected).abs().max().item() <= MERGED_TOLERANCE
    sums = (found["export"] / "BLAKE3SUMS").read_text()
    assert "  peft/adapter_model.safetensors\n" in sums and "  hf/model.safetensors\n" in sums


def test_two_stores_build_identical_adapters(lora_built: tuple[Path, Path, str], tmp_path: Path) -> None:
    """The second store trains on two ranks (the invariant reduction: the same bits as one)."""
    root, store, plan = lora_built
    other = tmp_path / ".bt"
    assert plan_hash(run_bt("plan", str(root / "imported.toml"), store=other)) == plan
    run = run_bt("run", plan, "--nproc", "2", "--threads", "2", store=other)
    assert run.returncode == 0, run.stderr
    assert step_digests(other, plan) == step_digests(store, plan)


def test_verify_with_a_kill_and_resume_at_four_threads_reproduces(lora_built: tuple[Path, Path, str]) -> None:
    _, store, plan = lora_built
    checked = run_bt("verify", plan, "--resume-at", "2", "--threads", "4", store=store)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_curve_scores_the_kept_checkpoints_with_their_adapters_merged(
    lora_built: tuple[Path, Path, str],
) -> None:
    """eval.checkpoints_every after LoRA: a kept checkpoint holds the frozen weights and the adapters
    apart, and the eval step scores them merged (the unmerged model's logits within 1e-5, not the
    base model's); `bt eval --update` finds the point the step scored in the evaluation cache."""
    root, store, _ = lora_built
    shutil.copyfile(ARITHMETIC, root / "arithmetic.jsonl")
    curve = root / "curve.toml"  # the fixture's preset ends with its [eval] table
    curve.write_text((root / "imported.toml").read_text() + f"suites = [{ARITH}]\ncheckpoints_every = 2\n")
    plan = plan_hash(run_bt("plan", str(curve), store=store))
    built = run_bt("run", plan, store=store)
    assert built.returncode == 0, built.stderr
    point = run_bt("eval", plan, "--suite", "arith", "--update", "2", store=store)
    assert point.returncode == 0, point.stderr
    assert json.loads(point.stdout)["cached"] is True, point.stdout

    found = outputs(store, plan)
    (step,) = [s for s in load_plan(Store(store), plan).steps if s.label == "eval"]
    config = EvalStep.from_config(step.config)
    assert config.lora is not None
    kept = found["train:main"] / "checkpoints" / "step-000002"
    scored = evaluation.load(config, found["data:main"], kept, NumericsConfig()).model.eval()
    unmerged = Transformer.build(config.model, config.model.vocab_size, torch.Generator())
    add_adapters(unmerged, config.lora, config.model, torch.Generator())
    load_model(unmerged, kept)  # the folder: its adapters and its frozen weights
    base = Transformer.build(config.model, config.model.vocab_size, torch.Generator())
    load_model(base, found["import_hf"] / "model.safetensors")
    tokens = torch.randint(0, config.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = unmerged.eval()(tokens)
        assert (scored(tokens) - expected).abs().max().item() <= MERGED_TOLERANCE
        assert (base.eval()(tokens) - expected).abs().max().item() > 1e-3  # the adapters trained
