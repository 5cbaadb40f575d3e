"""The models people fine-tune today: Llama 3.x (llama3 RoPE scaling), Qwen3 (per-head q/k norms,
a head size of its own) and SmolLM2 (llama-shaped, tied), each on a small random checkpoint made
by transformers: imported, its logits transformers' within 1e-5 (float32, CPU); fine-tuned one
step and exported, the export loading in transformers as the base architecture with our logits.
Whatever else a config.json asks for is refused at `bt plan` by its key, exit 2."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from checkpoints import make_checkpoint
from conftest import plan_hash, run_bt
from hypothesis import given, settings
from hypothesis import strategies as st
from test_finetune import built_export
from test_hf_export import VOCAB, export_random_model
from test_import import TOLERANCE, _refused, imported, write_preset
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from buildtrain.config.convert import converter
from buildtrain.config.schema import ModelConfig, RopeScalingConfig
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.rope import inverse_frequencies
from buildtrain.steps.train.state import load_model

os.environ["HF_HUB_OFFLINE"] = "1"

# original_max_position_embeddings 32 with head size 8 and theta 500: wavelengths 6.3, 30, 140
# and 664 positions, so one frequency is kept, one interpolated and two divided by the factor.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.x": ("llama", {"rope_scaling": LLAMA3}),
    "qwen3": ("qwen3", {"head_dim": 16}),  # 4 heads of 16 channels on a width of 32
    # SmolLM2: llama with tied embeddings, 3 query heads per key/value head, theta 1e5. Width 24
    # (heads of 8): at width 48 float32 rounding alone reached 1.4e-5 on logits of 6.7
    "smollm2": (
        "llama",
        {
            "hidden_size": 24,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "tie": True,
            "rope_theta": 1e5,
        },
    ),
}


def logits_gap(ours: torch.nn.Module, theirs: torch.nn.Module, vocab_size: int) -> float:
    """The largest difference of two models' logits, at positions past the original context."""
    tokens = torch.randint(0, vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("name", MODELS)
def test_imported_fine_tuned_and_exported_back_computing_transformers_logits(
    tmp_path: Path, name: str
) -> None:
    architecture, keys = MODELS[name]
    keys = copy.deepcopy(keys)  # transformers writes rope_theta into the rope_scaling it is given
    base = make_checkpoint(tmp_path / "checkpoint", architecture, tie=keys.pop("tie", False), **keys)
    store = tmp_path / ".bt"
    preset = str(write_preset(tmp_path))
    plan = plan_hash(run_bt("plan", preset, "--set", "train.steps=1", store=store))
    built = run_bt("run", plan, store=store)
    assert built.returncode == 0, built.stderr
    model, config = imported(store, plan)
    assert config.get("qk_norm", False) == (architecture == "qwen3")
    assert config.get("rope_scaling") == (LLAMA3 if "rope_scaling" in keys else None)
    assert config.get("head_dim", 0) == keys.get("head_dim", 0)
    assert logits_gap(model, base, config["vocab_size"]) <= TOLERANCE
    package, settings_ = built_export(store, plan)
    ours = Transformer.build(settings_, settings_.vocab_size, torch.Generator())
    load_model(ours, package / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(package / "hf").eval()
    assert type(theirs) is type(base)
    assert logits_gap(ours.eval(), theirs, settings_.vocab_size) <= TOLERANCE
    assert logits_gap(ours, base, settings_.vocab_size) > 1e-4  # the update moved it


@settings(max_examples=60, deadline=None)
@given(
    half=st.integers(1, 64),
    theta=st.floats(2.0, 1e7),
    factor=st.floats(1.0, 64.0),
    low=st.floats(0.25, 4.0),
    band=st.floats(0.01, 16.0),
    original=st.integers(1, 1 << 17),
)
def test_llama3_frequencies_are_transformers_bit_for_bit(
    half: int, theta: float, factor: float, low: float, band: float, original: int
) -> None:
    """Law: for any llama3 scaling, the inverse frequencies are the bits transformers computes."""
    scaling = RopeScalingConfig(
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=low + band,
        original_max_position_embeddings=original,
    )
    config = transformers.LlamaConfig(
        hidden_size=2 * half * 4,
        num_attention_heads=4,
        rope_theta=theta,
        rope_scaling={"rope_type": "llama3", **converter.unstructure(scaling)},
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = inverse_frequencies(2 * half, theta, scaling)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_a_from_scratch_model_with_qk_norm_and_llama3_rope_exports_to_transformers(tmp_path: Path) -> None:
    config = ModelConfig(
        dim=32,
        head_dim=12,  # 3 x 12 channels of heads on a width of 32
        n_heads=3,
        n_kv_heads=1,
        ffn_hidden=48,
        qk_norm=True,
        rope_theta=500.0,
        rope_scaling=RopeScalingConfig(**{k: v for k, v in LLAMA3.items() if k != "rope_type"}),
    )
    ours = export_random_model(tmp_path, config, seed=5)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    assert logits_gap(ours, theirs, VOCAB) <= TOLERANCE


def test_the_new_model_keys_enter_a_plan_only_when_used() -> None:
    """Existing plans keep their config (and so their hashes): defaults are left out."""
    plain = converter.unstructure(ModelConfig())
    assert not {"head_dim", "qk_norm", "rope_scaling"} & set(plain)
    used = converter.unstructure(ModelConfig(head_dim=8, qk_norm=True, rope_scaling=RopeScalingConfig()))
    assert used["head_dim"] == 8 and used["qk_norm"] is True
    assert used["rope_scaling"]["rope_type"] == "llama3"
    assert converter.structure(used, ModelConfig) == ModelConfig(
        head_dim=8, qk_norm=True, rope_scaling=RopeScalingConfig()
    )


@pytest.mark.parametrize(
    ("architecture", "edit", "expected"),
    [
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling.rope_type = 'yarn' is not supported",
        ),
        (
            "llama",
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_scaling.type = 'dynamic' is not supported",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_parameters.rope_type = 'longrope'",
        ),
        (
            "llama",
            {"rope_scaling": {**LLAMA3, "factor": None}},
            "rope_scaling.factor must be a positive finite number",
        ),
        (
            "llama",
            {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}},
            "rope_scaling.high_freq_factor 1.0 must exceed",
        ),
        ("llama", {"rope_scaling": {**LLAMA3, "beta_fast": 32}}, "rope_scaling.beta_fast is not supported"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5 is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias and mlp_bias must be false"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window is not supported"),
        (
            "qwen3",
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types names 'sliding_attention'",
        ),
        ("qwen3", {"head_dim": 7}, "head_dim must be a positive even integer (got 7)"),
    ],
)
def test_what_buildtrain_does_not_compute_is_refused_by_its_key(
    tmp_path: Path, architecture: str, edit: dict, expected: str
) -> None:
    make_checkpoint(tmp_path / "checkpoint", architecture)
    path = tmp_path / "checkpoint" / "config.json"
    config = json.loads(path.read_text())
    if "rope_parameters" in edit:  # transformers 5 wrote one: replace it
        config.pop("rope_parameters", None)
    path.write_text(json.dumps({**config, **edit}))
    line = _refused(tmp_path)
    assert "config.json: " in line and expected in line, line
