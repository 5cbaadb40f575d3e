"""Full fine-tuning from an imported checkpoint, end to end: `bt run` imports, tokenizes with the
checkpoint's tokenizer, trains every weight, and exports an hf/ folder that transformers loads as
the base architecture, computing buildtrain's logits within 1e-5."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import make_checkpoint
from conftest import plan_hash, run_bt
from test_import import TOLERANCE, write_preset

from buildtrain.config.convert import converter
from buildtrain.config.schema import ModelConfig
from buildtrain.plan.stored import load_plan
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.state import load_model
from buildtrain.store.store import Store

os.environ["HF_HUB_OFFLINE"] = "1"


def built_export(store: Path, plan: str) -> tuple[Path, ModelConfig]:
    loaded = load_plan(Store(store), plan)
    (export,) = [s for s in loaded.steps if s.label == "export"]
    return Store(store).outputs.path(export.hash), converter.structure(loaded.config["model"], ModelConfig)


@pytest.mark.parametrize(("architecture", "tie"), [("qwen2", False), ("mistral", True)])
def test_a_fine_tuned_export_loads_as_the_base_architecture(
    tmp_path: Path, architecture: str, tie: bool
) -> None:
    base = make_checkpoint(tmp_path / "checkpoint", architecture, heads=4, kv_heads=2, tie=tie)
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(write_preset(tmp_path)), store=store))
    built = run_bt("run", plan, store=store)
    assert built.returncode == 0, built.stderr
    package, settings = built_export(store, plan)
    ours = Transformer.build(settings, settings.vocab_size, torch.Generator())
    load_model(ours, package / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(package / "hf").eval()
    assert type(theirs) is type(base)  # the base architecture, not a look-alike
    hf_config = json.loads((package / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == architecture and hf_config["tie_word_embeddings"] == tie
    tokens = torch.randint(0, settings.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fine_tuned = ours.eval()(tokens)
        assert (fine_tuned - theirs(tokens).logits).abs().max().item() <= TOLERANCE
        assert (fine_tuned - base(tokens).logits).abs().max().item() > 1e-3  # training moved it
    # the checkpoint's tokenizer and chat template travel with the export, covered by BLAKE3SUMS
    sums = (package / "BLAKE3SUMS").read_text()
    for name in ("hf/tokenizer.json", "hf/tokenizer_config.json", "hf/chat_template.jinja"):
        assert f"  {name}\n" in sums
    assert (package / "hf" / "tokenizer.json").read_bytes() == (
        tmp_path / "checkpoint" / "tokenizer.json"
    ).read_bytes()


def test_a_stage_fine_tunes_what_the_first_imported(tmp_path: Path) -> None:
    """Two stages: the first starts from the checkpoint, the second from the first; one import."""
    make_checkpoint(tmp_path / "checkpoint", "llama")
    preset = write_preset(tmp_path)
    staged = tmp_path / "staged.toml"
    staged.write_text(
        f'extends = "{preset.name}"\n[[stages]]\nname = "first"\n'
        '[[stages]]\nname = "second"\ninit_from = "first"\ntrain = { lr = 1e-3 }\n'
    )
    store = tmp_path / ".bt"
    plan = plan_hash(run_bt("plan", str(staged), store=store))
    labels = [step.label for step in load_plan(Store(store), plan).steps]
    assert labels.count("import_hf") == 1 and "train:second" in labels
    built = run_bt("run", plan, store=store)
    assert built.returncode == 0, built.stderr
