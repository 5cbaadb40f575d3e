"""The hf/ folder: transformers loads it offline and computes buildtrain's logits (float32, CPU,
within 1e-5) for every norm x mlp the schema admits, GQA or not, tied or not. transformers is a
test dependency: this file fails, never skips, without it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from conftest import Reference, run_bt

from buildtrain.config.schema import ModelConfig
from buildtrain.steps.export.hf import ARCHITECTURES, read_tensors, write_hf
from buildtrain.steps.tokenizer.files import byte_level_json
from buildtrain.steps.train.model import Transformer
from buildtrain.steps.train.state import model_tensors, save_tensors
from buildtrain.store.objects import hash_file

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded: the folder must be complete

SHAPES = [
    # norm, mlp, n_heads, n_kv_heads, tie
    ("rmsnorm", "swiglu", 4, 2, True),
    ("rmsnorm", "swiglu", 4, 4, False),
    ("rmsnorm", "gelu", 4, 1, True),
    ("rmsnorm", "gelu", 2, 2, False),
    ("layernorm", "swiglu", 4, 2, False),
    ("layernorm", "gelu", 4, 2, True),
    ("layernorm", "gelu", 4, 4, False),
]
VOCAB = 257


def export_random_model(folder: Path, model_config: ModelConfig, seed: int) -> Transformer:
    """A model with random weights (norm weights and biases too), written as hf/ into `folder`."""
    model = Transformer.build(model_config, VOCAB, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # norms start at ones and zeros: make them count
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(hash(name) % 1000))
    weights = folder / "model.safetensors"
    save_tensors(weights, model_tensors(model))
    write_hf(
        folder / "hf",
        weights,
        _as_dict(model_config),
        byte_level_json(256),
        "<|endoftext|>",
        256,
        64,
        "float32",
    )
    return model.eval()


def _as_dict(model_config: ModelConfig) -> dict:
    from buildtrain.config.convert import converter

    return converter.unstructure(model_config)


@pytest.mark.parametrize(("norm", "mlp", "heads", "kv_heads", "tie"), SHAPES)
def test_transformers_computes_the_same_logits(
    tmp_path: Path, norm: str, mlp: str, heads: int, kv_heads: int, tie: bool
) -> None:
    config = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden=48,
        mlp=mlp,
        norm=norm,
        tie_embeddings=tie,
        rope_theta=500.0,
    )
    ours = export_random_model(tmp_path, config, seed=heads * 10 + kv_heads)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == ARCHITECTURES[(norm, mlp)][1]
    generator = torch.Generator().manual_seed(7)
    for length in (1, 9, 40):
        tokens = torch.randint(0, VOCAB, (3, length), generator=generator)
        with torch.no_grad():
            expected, got = ours(tokens), theirs(tokens).logits
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-5, (norm, mlp, length)


def test_the_weights_are_the_same_bits_renamed_and_split(tmp_path: Path) -> None:
    config = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    export_random_model(tmp_path, config, seed=1)
    ours = {name: values for name, (_, _, values) in read_tensors(tmp_path / "model.safetensors").items()}
    theirs = {
        name: values for name, (_, _, values) in read_tensors(tmp_path / "hf" / "model.safetensors").items()
    }
    assert ours["blocks.0.ffn.w1.weight"].tobytes() == theirs["model.layers.0.mlp.gate_proj.weight"].tobytes()
    # wqkv of 4 query heads and 2 key/value heads of 8 channels: rows 0..31 q, 32..47 k, 48..63 v
    qkv = ours["blocks.1.attention.wqkv.weight"]
    hf = "model.layers.1.self_attn"
    split = (theirs[f"{hf}.q_proj.weight"], theirs[f"{hf}.k_proj.weight"], theirs[f"{hf}.v_proj.weight"])
    assert [part.shape for part in split] == [(32, 32), (16, 32), (16, 32)]
    assert b"".join(part.tobytes() for part in split) == qkv.tobytes()  # rows split, never changed
    write_hf(
        tmp_path / "again",
        tmp_path / "model.safetensors",
        _as_dict(config),
        byte_level_json(256),
        "<|endoftext|>",
        256,
        64,
        "float32",
    )
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert hash_file(tmp_path / "hf" / name) == hash_file(tmp_path / "again" / name)


def test_the_byte_tokenizer_loads_in_transformers_and_gives_the_byte_ids(tmp_path: Path) -> None:
    export_random_model(tmp_path, ModelConfig(), seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "héllo wörld\n  12+30=42"
    assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
    assert tokenizer.eos_token_id == 256
    assert tokenizer.decode(list(text.encode("utf-8"))) == text
    every_byte = bytes(range(256)).decode("latin-1")  # code points 0..255: UTF-8 of one or two bytes
    assert tokenizer(every_byte)["input_ids"] == list(every_byte.encode("utf-8"))
    from tokenizers import pre_tokenizers

    vocab = json.loads(byte_level_json(256))["model"]["vocab"]
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(vocab.values()) == list(
        range(256)
    )


def test_a_built_plan_exports_hf_covered_by_checksums(micro_built: Reference, tmp_path: Path) -> None:
    store, planned, _ = micro_built
    result = run_bt("export", planned, str(tmp_path / "out"), store=store, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    package = tmp_path / "out"
    sums = dict(line.split("  ")[::-1] for line in (package / "BLAKE3SUMS").read_text().splitlines())
    for name in ("hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "hf/tokenizer_config.json"):
        assert sums[name] == hash_file(package / name)[0]
    assert json.loads((package / "hf" / "config.json").read_text())["model_type"] == "llama"
    model = transformers.AutoModelForCausalLM.from_pretrained(package / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(package / "hf")
    ids = tokenizer("12+30=", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, 6, 257)


def test_a_bfloat16_export_keeps_its_bits_and_loads_as_bfloat16(tmp_path: Path) -> None:
    config = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, tie_embeddings=False)
    model = Transformer.build(config, VOCAB, torch.Generator().manual_seed(3)).eval()
    weights = tmp_path / "model.safetensors"
    save_tensors(weights, {k: v.to(torch.bfloat16) for k, v in model_tensors(model).items()})
    write_hf(
        tmp_path / "hf", weights, _as_dict(config), byte_level_json(256), "<|endoftext|>", 256, 64, "bfloat16"
    )
    ours = read_tensors(weights)
    theirs = read_tensors(tmp_path / "hf" / "model.safetensors")
    assert ours["output.weight"][2].tobytes() == theirs["lm_head.weight"][2].tobytes()
    assert theirs["lm_head.weight"][0] == "BF16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, model.output.weight.to(torch.bfloat16))
